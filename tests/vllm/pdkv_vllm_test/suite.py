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
    # For a `--kill` run: the engine that must have been killed, with this many processes.
    expect_kill: str | None = None
    expect_killed_processes: int = 1
    # A phrase the verdict's `why` must contain (a run that must fail, for that reason).
    expect_why: str | None = None
    # For a `--kill` run: every request whose prefill answered before the kill must finish.
    expect_answered_finish: bool = False
    # A phrase the run's log (stderr) must contain, e.g. that an injected fault hit.
    expect_log: str | None = None


EXAMPLE = ["--example-connector"]


from pdkv_vllm_test.pdkv_hook import pdkv_args as _pdkv  # noqa: E402


# The hostile runs: TP2 on both sides, 64 requests, 32 in flight, one engine SIGKILLed once 40
# prefill legs have answered. Small pdkv timeouts, so that reads of a dead peer fail fast.
_FAST = {"transfer_timeout": 3, "handshake_timeout": 2}
_KILL_RUN = ["--requests", "64", "--concurrency", "32", "--prefill-tp", "2", "--decode-tp", "2"]


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
    # Hostile runs of pdkv's connector (ports 26400-26499).
    Case(
        "pdkv-kill-prefill",
        _pdkv("1P_TP2:1D_TP2", 26400, 26450, _FAST)
        + _KILL_RUN
        + ["--kill", "prefill:40", "--timeout", "60", "--drain-timeout", "15"],
        True,
        expect_blocks_returned={"decode": True},
        expect_kill="prefill",
        expect_killed_processes=3,
        note="pdkv: prefill's engine core and both workers SIGKILLed with requests in flight: no "
        "hang, requests read before the kill finish with every byte right, the others fail as "
        "the kill explains, decode gets every block back",
    ),
    Case(
        "pdkv-kill-prefill-recompute",
        _pdkv("1P_TP2:1D_TP2", 26444, 26494, _FAST, {"kv_load_failure_policy": "recompute"})
        + _KILL_RUN
        + ["--kill", "prefill:40", "--timeout", "60", "--drain-timeout", "15"]
        + ["--no-async-scheduling"],
        True,
        expect_blocks_returned={"decode": True},
        expect_kill="prefill",
        expect_killed_processes=3,
        expect_answered_finish=True,
        expect_decode_min={"requests_rolled_back": 1},
        note="pdkv-kill-prefill with vLLM's kv_load_failure_policy recompute: decode recomputes "
        "what it could not read, so every request that reached decode finishes with the right "
        "tokens (synchronous scheduling: the stand-in's sampler does not follow vLLM's rollback "
        "under async scheduling)",
    ),
    Case(
        "pdkv-kill-decode",
        _pdkv("1P_TP2:1D_TP2", 26410, 26460, {**_FAST, "defer_timeout": 3})
        + _KILL_RUN
        + ["--kill", "decode:40", "--timeout", "60", "--drain-timeout", "20"],
        True,
        expect_blocks_returned={"prefill": True},
        expect_kill="decode",
        expect_killed_processes=3,
        note="pdkv: decode SIGKILLed; prefill's reaper frees what decode never released "
        "(defer_timeout 3 s): the prefill pool must come back whole",
    ),
    Case(
        "pdkv-kill-decode-noreap",
        _pdkv("1P_TP2:1D_TP2", 26420, 26470, {**_FAST, "defer_timeout": 600})
        + _KILL_RUN
        + ["--kill", "decode:40", "--timeout", "60", "--drain-timeout", "5"],
        False,
        expect_blocks_returned={"prefill": False},
        expect_kill="decode",
        expect_killed_processes=3,
        expect_why="prefill blocks not returned",
        note="pdkv-kill-decode with a reaper that cannot run in time (defer_timeout 600 s, "
        "drain 5 s): the check must find the prefill pool short",
    ),
    Case(
        "pdkv-kill-decode-tp1",
        _pdkv("1P_TP1:1D_TP1", 26440, 26490, {**_FAST, "defer_timeout": 3})
        + ["--requests", "64", "--concurrency", "32"]
        + ["--kill", "decode:40", "--timeout", "60", "--drain-timeout", "20"],
        True,
        expect_blocks_returned={"prefill": True},
        expect_kill="decode",
        note="pdkv-kill-decode on TP1 engines (vLLM's UniProcExecutor). Expected to pass; it "
        "FAILS (README, findings): an idle TP1 prefill engine never calls the connector's "
        "update_connector_output, so pdkv's reaper never runs and the prefill pool stays short",
    ),
    Case(
        "pdkv-delay-control",
        _pdkv("1P_TP2:1D_TP2", 26414, 26464, {"pdkv_message_faults": {
            "delay": ["P0.dp*.tp*:handshake-reply:1500", "D0.dp*.tp*:handshake-request:700",
                      "D0.dp*.tp*:release,lease:1000@0.5"],
            "seed": 7,
        }})
        + ["--requests", "64", "--concurrency", "32", "--prefill-tp", "2", "--decode-tp", "2"],
        True,
        expect_decode_min={"requests_checked": 64},
        expect_log="injected message fault",
        note="pdkv: every handshake request and reply held back (0.7 s, 1.5 s) and half of "
        "decode's releases and leases (1 s): every request finishes, every block comes back",
    ),
    Case(
        "pdkv-lose-releases",
        _pdkv("1P_TP2:1D_TP2", 26424, 26474, {
            **_FAST, "defer_timeout": 3,
            "pdkv_message_faults": {"lose": ["D0.dp*.tp*:release"]},
        })
        + _KILL_RUN
        + ["--drain-timeout", "20"],
        True,
        expect_decode_min={"requests_checked": 64},
        expect_log="injected message fault",
        note="pdkv: every release decode sends is lost; the reads are done, so every request "
        "finishes, and prefill's reaper (defer_timeout 3 s) frees every block",
    ),
    Case(
        "pdkv-chunked",
        _pdkv("1P_TP2:1D_TP2", 26430, 26480)
        + ["--requests", "128", "--concurrency", "128", "--prefill-tp", "2", "--decode-tp", "2"]
        + ["--chunked-prefill", "--max-num-batched-tokens", "128"]
        + ["--prompt-lens", "200,300,511,700,1000,1500"],
        True,
        expect_decode_min={"requests_checked": 128},
        note="pdkv: chunked prefill, a step budget of 128 tokens (vLLM wants at least "
        "max_num_seqs), prompts of 2 to 12 chunks; prefill stages a request's blocks after "
        "each chunk, decode reads them all",
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
    kill = verdict.get("kill")
    if case.expect_kill is not None:
        if kill is None or kill["side"] != case.expect_kill:
            why.append(f"expected {case.expect_kill} killed, got {kill and kill['side']}")
        elif len(kill["processes"]) < case.expect_killed_processes:
            why.append(f"killed {len(kill['processes'])} processes, expected >= {case.expect_killed_processes}")
        elif not kill["failed_excused"] and not (verdict["decode"].get("requests_rolled_back") or 0):
            # A kill shows as requests failed for it, or, under vLLM's recompute policy, as
            # requests decode recomputed because their KV could not be read.
            why.append("the kill failed no request and decode recomputed none: it hit nothing in flight")
    if case.expect_answered_finish and kill is not None:
        outcome = kill["answered_before_kill_outcome"]
        if outcome["failed_excused"] or outcome["failed_not_excused"]:
            why.append(f"requests answered before the kill did not all finish: {outcome}")
    if case.expect_log is not None and case.expect_log not in proc.stderr:
        why.append(f"expected the log to say {case.expect_log!r}")
    if case.expect_why is not None and not any(case.expect_why in w for w in verdict.get("why", [])):
        why.append(f"expected the verdict to say {case.expect_why!r}, it says {verdict.get('why')}")
    summary = {
        side: {
            k: verdict[side].get(k)
            for k in (
                "requests_finished",
                "requests_failed",
                "requests_failed_excused",
                "bytes_verified",
                "requests_checked",
                "requests_readded",
                "requests_rolled_back",
                "mismatched_bytes",
                "blocks_returned",
                "blocks",
                "load_failed_bytes",
                "steps",
                "error",
            )
        }
        for side in ("prefill", "decode")
    }
    if kill is not None:
        kill = {
            k: kill[k]
            for k in (
                "side",
                "at_s",
                "prefill_answers_at_kill",
                "in_flight",
                "answered_before_kill",
                "answered_before_kill_outcome",
                "failed_excused",
                "failed_not_excused",
            )
        } | {"processes": [f"{p['pid']} {p['title'][:40]}" for p in kill["processes"]]}
    return {
        "name": case.name,
        "note": case.note,
        "passed": not why,
        "why": "; ".join(why) or None,
        "ok": verdict["ok"],
        "verdict_why": verdict.get("why"),
        "kill": kill,
        "run_s": verdict.get("run_s"),
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
