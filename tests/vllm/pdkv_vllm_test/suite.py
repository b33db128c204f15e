"""The proof runs: the P/D driver against vLLM's ExampleConnector in the shapes that matter, each
in its own process, with the verdict each must reach. Prints one JSON summary; exits non-zero if
any run's verdict differs from its expectation.

    cd tests/vllm && PYTHONPATH=. python -m pdkv_vllm_test.suite [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Case:
    name: str
    args: list[str]
    expect_ok: bool
    # For a run that must fail: the mismatch the decode side must name.
    expect_mismatch: dict[str, Any] | None = None
    note: str = ""
    # Decode-side figures that must reach at least these values.
    expect_decode_min: dict[str, int] = field(default_factory=dict)
    # Whether each side must get all of its blocks back (default: both).
    expect_blocks_returned: dict[str, bool] = field(
        default_factory=lambda: {"prefill": True, "decode": True}
    )
    extra_env: dict[str, str] = field(default_factory=dict)


EXAMPLE = ["--example-connector"]


def _pdkv(deployment: str, port: int) -> list[str]:
    from pdkv_vllm_test.pdkv_hook import pdkv_args

    return pdkv_args(deployment, port)


CASES = [
    Case("tp1", EXAMPLE + ["--requests", "32"], True, note="TP1 prefill -> TP1 decode"),
    Case(
        "tp2-tp1",
        EXAMPLE + ["--requests", "32", "--prefill-tp", "2", "--num-kv-heads", "1"],
        True,
        note="TP2 prefill -> TP1 decode; one KV head, replicated on both prefill ranks",
    ),
    Case(
        "tp1-tp2",
        EXAMPLE + ["--requests", "32", "--decode-tp", "2", "--num-kv-heads", "1"],
        True,
        note="TP1 prefill -> TP2 decode",
    ),
    Case(
        "c256",
        EXAMPLE + ["--requests", "256", "--concurrency", "256"],
        True,
        note="256 requests in flight",
    ),
    Case(
        "sync-sched",
        EXAMPLE + ["--requests", "32", "--no-async-scheduling"],
        True,
        note="vLLM's synchronous scheduler (async scheduling, vLLM's default, elsewhere)",
    ),
    Case(
        "preempt",
        EXAMPLE
        + ["--requests", "64", "--concurrency", "64", "--max-tokens", "32"]
        + ["--max-model-len", "256", "--kv-cache-bytes", "300000"],
        True,
        expect_decode_min={"requests_readded": 1},
        note="a KV pool of 73 blocks: decode preempts and resumes requests",
    ),
    Case(
        "corrupt",
        EXAMPLE + ["--requests", "32", "--corrupt", "4:1:5:3"],
        False,
        expect_mismatch={"layer": 1, "position": 5, "kv": "K", "byte_offset": 3},
        note="prefill flips byte 3 of K, position 5, layer 1 of req-4: decode must name it",
    ),
    Case(
        "leak",
        EXAMPLE + ["--requests", "16", "--leak", "--drain-timeout", "2"],
        False,
        expect_blocks_returned={"prefill": False, "decode": True},
        note="prefill's connector holds one request's blocks and never reports them sent: "
        "the prefill pool must come back one block short",
    ),
    Case(
        "tp2-kvheads2",
        EXAMPLE + ["--requests", "32", "--prefill-tp", "2", "--num-kv-heads", "2"],
        False,
        note="ExampleConnector is not TP-aware: both prefill ranks write one file per layer, "
        "each with its own head; decode must see the wrong head",
    ),
    # pdkv's connector, each pair on its own ports.
    Case(
        "pdkv-tp1",
        _pdkv("1P_TP1:1D_TP1", 26500) + ["--requests", "32"],
        True,
        expect_decode_min={"requests_checked": 32},
        note="pdkv: TP1 prefill -> TP1 decode; every request's KV read, none recomputed",
    ),
    Case(
        "pdkv-tp2",
        _pdkv("1P_TP2:1D_TP2", 26510) + ["--requests", "32", "--prefill-tp", "2", "--decode-tp", "2"],
        True,
        expect_decode_min={"requests_checked": 32},
        note="pdkv: TP2 -> TP2, two KV heads split over the ranks; the eager barrier's MIN over gloo",
    ),
    Case(
        "pdkv-tp2-tp1",
        _pdkv("1P_TP2:1D_TP1", 26520) + ["--requests", "32", "--prefill-tp", "2", "--num-kv-heads", "1"],
        True,
        expect_decode_min={"requests_checked": 32},
        note="pdkv: TP2 -> TP1, one replicated KV head: rank 1 is not read and has a zero quorum",
    ),
    Case(
        "pdkv-tp1-tp2",
        _pdkv("1P_TP1:1D_TP2", 26530) + ["--requests", "32", "--decode-tp", "2", "--num-kv-heads", "1"],
        True,
        expect_decode_min={"requests_checked": 32},
        note="pdkv: TP1 -> TP2, both decode ranks read the one prefill rank (a quorum of two)",
    ),
    Case(
        "pdkv-c256",
        _pdkv("1P_TP2:1D_TP2", 26540)
        + ["--requests", "256", "--concurrency", "256", "--prefill-tp", "2", "--decode-tp", "2"],
        True,
        expect_decode_min={"requests_checked": 256},
        note="pdkv: 256 requests in flight on TP2 -> TP2",
    ),
    Case(
        "pdkv-preempt",
        _pdkv("1P_TP1:1D_TP1", 26550)
        + ["--requests", "64", "--concurrency", "64", "--max-tokens", "32"]
        + ["--max-model-len", "256", "--kv-cache-bytes", "300000"],
        True,
        expect_decode_min={"requests_readded": 1},
        note="pdkv: a decode pool of 73 blocks; vLLM preempts and resumes requests whose KV was read",
    ),
    Case(
        "pdkv-corrupt",
        _pdkv("1P_TP1:1D_TP1", 26560) + ["--requests", "32", "--corrupt", "4:1:5:3"],
        False,
        expect_mismatch={"layer": 1, "position": 5, "kv": "K", "byte_offset": 3},
        note="pdkv: prefill flips a byte after its forward; decode must name it",
    ),
]


def run_case(case: Case, python: str) -> dict[str, Any]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [python, "-m", "pdkv_vllm_test.pd", *case.args],
        capture_output=True,
        text=True,
        env={**os.environ, **case.extra_env},
        check=False,
    )
    elapsed = round(time.monotonic() - t0, 1)
    try:
        verdict = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {
            "name": case.name,
            "passed": False,
            "why": f"no JSON (exit {proc.returncode}): {proc.stderr[-2000:]}",
            "process_s": elapsed,
        }
    why = []
    if verdict["ok"] != case.expect_ok or (proc.returncode == 0) != case.expect_ok:
        why.append(f"ok={verdict['ok']} exit={proc.returncode}, expected ok={case.expect_ok}")
    if case.expect_mismatch is not None:
        named = verdict["decode"].get("mismatches", [])
        if verdict["decode"].get("mismatched_bytes") != 1 or not any(
            all(m.get(k) == v for k, v in case.expect_mismatch.items())
            and m["request_id"].startswith("req-4-")
            for m in named
        ):
            why.append(f"expected exactly the mismatch {case.expect_mismatch}, got {named}")
    for side, returned in case.expect_blocks_returned.items():
        if verdict[side].get("blocks_returned") != returned:
            why.append(f"{side} blocks_returned={verdict[side].get('blocks_returned')}")
    for key, least in case.expect_decode_min.items():
        if (verdict["decode"].get(key) or 0) < least:
            why.append(f"decode {key}={verdict['decode'].get(key)}, expected >= {least}")
    summary = {
        side: {
            k: verdict[side].get(k)
            for k in (
                "requests_finished",
                "requests_failed",
                "bytes_verified",
                "requests_checked",
                "requests_readded",
                "mismatched_bytes",
                "blocks_returned",
                "blocks",
            )
        }
        for side in ("prefill", "decode")
    }
    return {
        "name": case.name,
        "note": case.note,
        "passed": not why,
        "why": "; ".join(why) or None,
        "ok": verdict["ok"],
        "sides": summary,
        "first_mismatch": (verdict["decode"].get("mismatches") or [None])[0],
        "corrupted": verdict["prefill"].get("corrupted"),
        "wall_s": verdict["wall_s"],
        "process_s": elapsed,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="case names: " + ", ".join(c.name for c in CASES))
    args = p.parse_args()
    cases = [c for c in CASES if not args.only or c.name in args.only]
    results = [run_case(c, sys.executable) for c in cases]
    print(json.dumps(results, indent=1))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
