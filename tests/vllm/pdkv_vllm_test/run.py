"""Everything `cargo xtask vllm-test` runs: the harness's and the connector's unit tests
(python/tests/test_connector.py), the `mori` stub's tests, the native module on loopback without
vLLM (python/tests/test_native.py), the proof runs of the suite (vLLM's ExampleConnector and
pdkv's connector, each driven by vLLM 0.34's scheduler and engine core), then `vllm serve` pairs
behind pdkv's proxy (serve.py): pdkv on both sides, and mixed pairs with vLLM's own MoRIIO
connector on one side, in both directions.
Arguments go to the suite (`--only NAME ...`). Exits non-zero when any part fails.

    PYTHONPATH=tests/vllm python -m pdkv_vllm_test.run [--only NAME ...]
"""

from __future__ import annotations

import json
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


def must_fail(name: str, argv: list[str], cwd: str, check) -> bool:
    """A negative control: the run must fail, and `check` must accept its JSON verdict."""
    print(f"== {name}: {' '.join(argv)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests", "vllm")}
    proc = subprocess.run(argv, cwd=cwd, env=env, check=False, capture_output=True, text=True)
    try:
        verdict = json.loads(proc.stdout)
        why = check(verdict) if proc.returncode != 0 and not verdict.get("ok") else "it passed"
    except (ValueError, KeyError, TypeError) as e:
        why = f"no usable verdict ({e}): {proc.stdout[-1000:]} {proc.stderr[-1000:]}"
    print(proc.stdout if why else "", end="", file=sys.stderr)
    result = "ok, it failed as it must" if not why else f"FAILED: {why}"
    print(f"== {name}: {result} in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return not why


def one_flipped_byte(verdict) -> str | None:
    """The flipped byte, and nothing else, named by decode's check."""
    # (The stand-in model's tokens do not depend on the KV, so the completions stay right.)
    dec = verdict["decode"]
    wanted = {"layer": 0, "position": 0, "kv": "K", "byte_offset": 0}
    if dec["mismatched_bytes"] != 1 or len(dec["mismatches"]) != 1:
        return f"expected exactly one mismatched byte, decode counted {dec['mismatched_bytes']}: {dec['mismatches']}"
    if any(dec["mismatches"][0].get(k) != v for k, v in wanted.items()):
        return f"expected the mismatch {wanted}, decode named {dec['mismatches'][0]}"
    return None


def main(argv: list[str]) -> int:
    python = sys.executable
    results = [
        step("harness unit tests", [python, "-m", "unittest", "-q", "pdkv_vllm_test.test_kvpattern"], ROOT),
        step("connector unit tests", [python, os.path.join(ROOT, "python", "tests", "test_connector.py")], ROOT),
        step("mori stub unit tests", [python, "-m", "pdkv_vllm_test.test_mori_stub"], os.path.join(ROOT, "tests", "vllm")),
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
    serve = [python, "-m", "pdkv_vllm_test.serve"]
    tp2 = ["--prefill-tp", "2", "--decode-tp", "2", "--requests", "64", "--concurrency", "64"]
    for p, d in (("pdkv", "moriio"), ("moriio", "pdkv")):
        sides = ["--prefill-connector", p, "--decode-connector", d]
        results += [
            step(f"vllm serve, {p} TP1 -> {d} TP1", serve + sides + ["--requests", "32"], ROOT),
            step(f"vllm serve, {p} TP2 -> {d} TP2, 64 in flight", serve + sides + tp2, ROOT),
        ]
    # The stub's data plane corrupts one byte of the first block it moves: decode must name it.
    results += [
        must_fail(
            "vllm serve, moriio -> pdkv with one served byte flipped",
            serve + ["--prefill-connector", "moriio", "--requests", "8", "--mori-stub-flip", "serve:1"],
            ROOT, one_flipped_byte,
        ),
        must_fail(
            "vllm serve, pdkv -> moriio with one read byte flipped",
            serve + ["--decode-connector", "moriio", "--requests", "8", "--mori-stub-flip", "read:1"],
            ROOT, one_flipped_byte,
        ),
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
