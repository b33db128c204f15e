"""Everything `cargo xtask vllm-test` runs: the harness's and the connector's unit tests
(python/tests/test_connector.py), the native module on loopback without vLLM
(python/tests/test_native.py), the proof runs of the suite (vLLM's
ExampleConnector and pdkv's connector, each driven by vLLM 0.34's scheduler and engine core),
then `vllm serve` pairs behind pdkv's proxy (serve.py).
Arguments go to the suite (`--only NAME ...`). Exits non-zero when any part fails.

    PYTHONPATH=tests/vllm python -m pdkv_vllm_test.run [--only NAME ...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))


def step(name: str, argv: list[str], cwd: str) -> bool:
    print(f"== {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests", "vllm")}
    code = subprocess.run(argv, cwd=cwd, env=env, check=False).returncode
    verdict = "ok" if code == 0 else f"FAILED (exit {code})"
    print(f"== {name}: {verdict} in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return code == 0


def main(argv: list[str]) -> int:
    python = sys.executable
    results = [
        step("harness unit tests", [python, "-m", "unittest", "-q", "pdkv_vllm_test.test_kvpattern"], ROOT),
        step("connector unit tests", [python, os.path.join(ROOT, "python", "tests", "test_connector.py")], ROOT),
        step("native module on loopback", [python, os.path.join(ROOT, "python", "tests", "test_native.py")], ROOT),
        step("proof runs", [python, "-m", "pdkv_vllm_test.suite", *argv], ROOT),
        step("vllm serve, TP1 -> TP1", [python, "-m", "pdkv_vllm_test.serve", "--requests", "32"], ROOT),
        step(
            "vllm serve, TP2 -> TP2, 64 in flight",
            [python, "-m", "pdkv_vllm_test.serve", "--prefill-tp", "2", "--decode-tp", "2",
             "--requests", "64", "--concurrency", "64"],
            ROOT,
        ),
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
