"""`vllm serve` with pdkv's connector on each side, behind pdkv's proxy (`python -m pdkv.proxy`),
on loopback: completions go client -> proxy -> prefill server -> proxy -> decode server, as in a
deployment. Each server is vLLM's own OpenAI server with the stand-in worker (the platform plugin
of this folder), so every KV byte decode loaded is checked against what prefill's forward wrote;
the figures come from the servers' workers (vLLM's dev-mode `/collective_rpc`), and each server's
`/reset_prefix_cache` must succeed at the end, which vLLM allows only when no block is held.

    cd tests/vllm && PYTHONPATH=. python -m pdkv_vllm_test.serve [--prefill-tp 2 --decode-tp 2]

Either side can instead run vLLM's own MoRIIO connector (`--prefill-connector moriio` or
`--decode-connector moriio`, READ mode), with only MoRI's data plane replaced by the stub in
`mori_stub/` (pdkv's TCP read protocol) and `msgpack`, which MoRIIO imports and vLLM does not
require, from `$PDKV_MORIIO_EXTRAS` (`cargo xtask vllm-test` installs it there). Both are on the
MoRIIO server's `PYTHONPATH` only.

Prints one JSON object; exits 0 only when every completion has the expected tokens, some KV
crossed, no byte differed and both servers hold no block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from pdkv_vllm_test import pd
from pdkv_vllm_test.pdkv_hook import kv_transfer_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_base(role: str, port: int) -> int:
    """Where rank (0, 0) of each side serves its Prometheus metrics."""
    return port + (200 if role == "kv_producer" else 300)


# Each side's handshake listeners start at the kv port (prefill) or 20 above it (decode), its
# notify listeners 100 higher: MoRIIO binds both kinds on both sides.
SIDE_PORT_OFFSET = {"prefill": 0, "decode": 20}
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kv_config(role: str, deployment: str, port: int, metrics_port: int) -> str:
    extra = {"metrics_port": metrics_port}
    return json.dumps(kv_transfer_config(role, deployment, port, extra=extra))


def moriio_config(role: str, port: int, http_port: int) -> str:
    """vLLM's MoRIIO connector in READ mode on loopback. No `proxy_ip`: the router is pdkv's
    proxy, which passes each side's `kv_transfer_params` as MoRIIO's own proxy does. `defer_timeout`
    is longer than the drain wait, so a release MoRIIO's prefill never got shows as blocks held."""
    return json.dumps({
        "kv_connector": "MoRIIOConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "host_ip": "127.0.0.1", "handshake_port": port, "notify_port": port + 100,
            "http_port": http_port, "read_mode": "true", "backend": "rdma",
            "transfer_timeout": 30, "defer_timeout": 120, "recv_abort_timeout": 60,
        },
    })


def moriio_env() -> dict[str, str]:
    """The MoRIIO server's additions to the environment: the `mori` stub and `msgpack`."""
    extras = os.environ.get("PDKV_MORIIO_EXTRAS")
    if not extras or not os.path.isdir(os.path.join(extras, "msgpack")):
        raise RuntimeError(
            "vLLM's MoRIIO imports msgpack, which vLLM does not require: set PDKV_MORIIO_EXTRAS to a "
            "folder holding it (`cargo xtask vllm-test` installs one beside the venv and sets it)"
        )
    path = [TESTS_DIR, os.path.join(TESTS_DIR, "mori_stub"), extras, os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}


def serve(args, model_dir: str, side: str, tp: int, http_port: int, deployment: str, log) -> subprocess.Popen:
    role = "kv_producer" if side == "prefill" else "kv_consumer"
    connector = args.prefill_connector if side == "prefill" else args.decode_connector
    port = args.kv_port + SIDE_PORT_OFFSET[side]
    if connector == "moriio":
        kv, env = moriio_config(role, port, http_port), moriio_env()
        if args.mori_stub_flip:
            env["MORI_STUB_FLIP"] = args.mori_stub_flip
    else:
        kv, env = kv_config(role, deployment, port, metrics_base(role, args.kv_port)), {}
    argv = [
        os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model_dir,
        "--host", "127.0.0.1", "--port", str(http_port),
        "--skip-tokenizer-init", "--load-format", "dummy",
        "--tensor-parallel-size", str(tp),
        "--max-model-len", str(args.max_model_len), "--block-size", "16",
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
        "--max-num-seqs", str(max(args.concurrency, 1)),
        "--additional-config", json.dumps({"pdkv_test": {"side": side}}),
        "--kv-transfer-config", kv,
        "--disable-log-stats",
    ]
    if args.prefix_caching is not None:
        argv.append("--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), **env}
    return subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)


async def wait_healthy(session, url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode} before it was healthy")
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} was not healthy within {timeout_s:.0f} s")


async def run(args) -> dict[str, Any]:
    from aiohttp import ClientSession, ClientTimeout

    model_dir = tempfile.mkdtemp(prefix="pdkv-serve-model-")
    model_args = pd.parser().parse_args([])
    model_args.requests = args.requests
    pd.write_model(model_dir, model_args)
    deployment = f"1P_TP{args.prefill_tp}:1D_TP{args.decode_tp}"
    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    logs = tempfile.mkdtemp(prefix="pdkv-serve-logs-")
    procs: dict[str, subprocess.Popen] = {}
    result: dict[str, Any] = {"deployment": deployment, "logs": logs,
                              "connectors": {"prefill": args.prefill_connector, "decode": args.decode_connector}}
    started = time.monotonic()
    try:
        procs["prefill"] = serve(args, model_dir, "prefill", args.prefill_tp, p_port, deployment,
                                 open(os.path.join(logs, "prefill.log"), "w"))
        procs["decode"] = serve(args, model_dir, "decode", args.decode_tp, d_port, deployment,
                                open(os.path.join(logs, "decode.log"), "w"))
        procs["proxy"] = subprocess.Popen(
            [sys.executable, "-m", "pdkv.proxy", "--prefill", f"http://127.0.0.1:{p_port}",
             "--decode", f"http://127.0.0.1:{d_port}", "--port", str(proxy_port),
             "--log-level", os.environ.get("PDKV_LOG", "info")],
            stdout=open(os.path.join(logs, "proxy.log"), "w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        async with ClientSession(timeout=ClientTimeout(total=args.timeout)) as session:
            for name, port in (("prefill", p_port), ("decode", d_port), ("proxy", proxy_port)):
                await wait_healthy(session, f"http://127.0.0.1:{port}", procs[name], args.startup_timeout)
            result["startup_s"] = round(time.monotonic() - started, 1)
            prompts = pd.make_prompts(model_args)[: args.requests]
            while len(prompts) < args.requests:
                prompts += pd.make_prompts(model_args)[: args.requests - len(prompts)]
            sem = asyncio.Semaphore(args.concurrency)
            failures: list[str] = []

            async def one(i: int, prompt: list[int]) -> None:
                body = {"model": model_dir, "prompt": prompt, "max_tokens": args.max_tokens,
                        "temperature": 0, "return_token_ids": True}
                async with sem:
                    async with session.post(f"http://127.0.0.1:{proxy_port}/v1/completions", json=body) as r:
                        text = await r.text()
                if r.status != 200:
                    failures.append(f"request {i}: {r.status} {text[:500]}")
                    return
                tokens = json.loads(text)["choices"][0].get("token_ids")
                expected = pd.expected_tokens(prompt, args.max_tokens, model_args.vocab_size)
                if tokens != expected:
                    failures.append(f"request {i}: tokens {tokens}, expected {expected}")

            t0 = time.monotonic()
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            result["run_s"] = round(time.monotonic() - t0, 2)
            result["requests"] = len(prompts)
            result["failures"] = failures[:10]
            result["failed"] = len(failures)
            for side, port in (("prefill", p_port), ("decode", d_port)):
                base = f"http://127.0.0.1:{port}"
                async with session.post(base + "/collective_rpc", json={"method": "pdkv_test_report"}) as r:
                    reports = (await r.json())["results"]
                # Blocks of finished transfers may come back a step or two late.
                reset = False
                deadline = time.monotonic() + args.drain_timeout
                while not reset and time.monotonic() < deadline:
                    async with session.post(base + "/reset_prefix_cache") as r:
                        reset = bool((await r.json()).get("success"))
                    if not reset:
                        await asyncio.sleep(0.5)
                # Every pdkv rank's Prometheus endpoint, scraped as Prometheus would.
                role = "kv_producer" if side == "prefill" else "kv_consumer"
                tp = args.prefill_tp if side == "prefill" else args.decode_tp
                pdkv_side = (args.prefill_connector if side == "prefill" else args.decode_connector) == "pdkv"
                scraped: dict[str, float] = {}
                by_nic: dict[str, float] = {}
                for rank in range(tp if pdkv_side else 0):
                    url = f"http://127.0.0.1:{metrics_base(role, args.kv_port) + rank}/metrics"
                    async with session.get(url) as r:
                        for line in (await r.text()).splitlines():
                            if line.startswith("pdkv_") and "_bucket" not in line:
                                name = line.split("{")[0]
                                value = float(line.rsplit(" ", 1)[1])
                                scraped[name] = scraped.get(name, 0) + value
                                nic = re.search(r'nic="([^"]*)"', line)
                                if name == "pdkv_read_bytes_total" and nic:
                                    by_nic[nic.group(1)] = by_nic.get(nic.group(1), 0) + value
                result[side] = {
                    "metrics": {k: v for k, v in scraped.items() if v},
                    "read_bytes_by_nic": by_nic,
                    "bytes_verified": sum(x["bytes_verified"] for x in reports),
                    "mismatched_bytes": sum(x["mismatched_bytes"] for x in reports),
                    "mismatches": [m for x in reports for m in x["mismatches"]][:5],
                    "kv_cache_layout": reports[0]["kv_cache_layout"],
                    "requests_checked": max(x["requests_checked"] for x in reports),
                    "tp_ranks": len(reports),
                    "no_block_held": reset,
                }
                stub = [x["mori_stub"] for x in reports if "mori_stub" in x]
                if stub:
                    result[side]["mori_stub"] = {k: sum(x[k] for x in stub) for k in stub[0]}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["ok"] = verdict(args, result)
    return result


def verdict(args, result: dict[str, Any]) -> bool:
    """Every completion right, KV crossed and checked, both pools whole; each side's counters
    agree with what crossed: a pdkv side's Prometheus endpoints, a MoRIIO side's data plane."""
    dec, pre = result.get("decode", {}), result.get("prefill", {})
    metrics = {s: result.get(s, {}).get("metrics", {}) for s in ("prefill", "decode")}
    ok = (
        result.get("failed", 1) == 0
        and dec.get("bytes_verified", 0) > 0
        and dec.get("mismatched_bytes", 1) == 0
        and all(result.get(s, {}).get("no_block_held") for s in ("prefill", "decode"))
    )
    if args.decode_connector == "pdkv":
        read = metrics["decode"].get("pdkv_read_bytes_total", 0)
        ok = ok and (
            # The endpoints count what crossed: every request read.
            metrics["decode"].get("pdkv_requests_received_total", 0) >= args.requests * args.decode_tp
            and read > 0
            # Every byte read is counted on the NIC it crossed.
            and sum(dec.get("read_bytes_by_nic", {}).values()) == read
        )
        if args.prefill_connector == "moriio":
            ok = ok and pre.get("mori_stub", {}).get("bytes_served") == read
    else:
        ok = ok and dec.get("mori_stub", {}).get("bytes_read", 0) > 0 and dec["mori_stub"].get("failures", 1) == 0
    if args.prefill_connector == "pdkv":
        # Every transfer finished: released by decode's ranks, whichever connector they run.
        ok = ok and metrics["prefill"].get("pdkv_transfers_finished_total", 0) >= args.requests
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdkv_vllm_test.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--prefill-connector", choices=("pdkv", "moriio"), default="pdkv")
    parser.add_argument("--decode-connector", choices=("pdkv", "moriio"), default="pdkv")
    parser.add_argument("--mori-stub-flip", metavar="N", help="negative control: the MoRIIO side's "
                        "data plane flips the first byte of its N-th range (MORI_STUB_FLIP)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    parser.add_argument("--kv-port", type=int, default=0, help="handshake port base (notify: +100); 0 picks one")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--drain-timeout", type=float, default=10.0)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="vLLM's prefix caching on both servers (default: vLLM's default, on)")
    args = parser.parse_args(argv)
    if args.kv_port == 0:
        args.kv_port = 27000 + os.getpid() % 2000
    try:
        result = asyncio.run(run(args))
    except Exception as e:  # The verdict still comes out as JSON.
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result, indent=1))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
