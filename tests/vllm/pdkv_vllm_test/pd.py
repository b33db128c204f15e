"""The P/D driver: a prefill engine and a decode engine, each vLLM's own AsyncLLM with its engine
core in its own process, a proxy that routes every request through both, and a verdict on every
KV byte and every KV block, printed as one JSON object.

Run from tests/vllm (see README.md):
    PYTHONPATH=. python -m pdkv_vllm_test.pd --example-connector --requests 32

Exit status: 0 when every request finished with the expected tokens, no KV byte differed from
the known pattern, and both engines got every KV block back into vLLM's pool; 1 otherwise;
2 on a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

# Set before vLLM is imported: no Hub access, the CPU test platform, engine cores forked from
# this process (so they inherit the utility installed by `install_block_report`).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM logs to stdout by default; stdout carries the JSON verdict.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

DEFAULT_PROMPT_LENS = "5,16,17,31,32,33,47,64,65,100,127,130"
EXAMPLE_CONNECTOR = "ExampleConnector"


# -- the proxy hook -------------------------------------------------------------------------


class ProxyHook:
    """What a P/D router adds to each leg; subclass it for a connector that needs more.

    The default is vLLM's disaggregated-serving convention (its toy proxies and NIXL's):
    ask prefill to keep the KV for a remote decode, then hand decode whatever prefill returned.
    """

    def prefill_params(self, request_id: str) -> dict[str, Any] | None:
        return {"do_remote_decode": True, "do_remote_prefill": False}

    def decode_params(
        self, request_id: str, prefill_returned: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        return prefill_returned


def load_hook(spec: str | None) -> ProxyHook:
    """`module:attr` names a ProxyHook subclass or factory; none gives the default hook."""
    if not spec:
        return ProxyHook()
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)()


# -- the model and the engines ----------------------------------------------------------------


def write_model(folder: str, args: argparse.Namespace) -> None:
    """A Llama config and nothing else: the stand-in worker never loads weights."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.head_size * args.num_heads,
        "intermediate_size": 128,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "num_hidden_layers": args.num_layers,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_model_len,
        "torch_dtype": "float16",
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def install_block_report() -> None:
    """Adds one read-only utility to vLLM's EngineCore: the block pool's counts.

    The engine core process is forked from this one, so it inherits the method; the driver
    calls it with `engine_core.call_utility_async`, vLLM's own client-to-core utility path.
    """
    from vllm.v1.engine.core import EngineCore

    def pdkv_test_kv_blocks(self: EngineCore) -> dict[str, int]:
        pool = self.scheduler.kv_cache_manager.block_pool
        return {
            "num_gpu_blocks": pool.num_gpu_blocks,
            # Block 0 is vLLM's null block, never handed out and never free.
            "usable": pool.num_gpu_blocks - 1,
            "free": pool.get_num_free_blocks(),
            "scheduler_requests": len(self.scheduler.requests),
        }

    EngineCore.pdkv_test_kv_blocks = pdkv_test_kv_blocks


def make_engine(args: argparse.Namespace, side: str, kv_config: dict[str, Any] | None, tp: int):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    additional: dict[str, Any] = {"pdkv_test": {"side": side}}
    if side == "prefill" and args.corrupt:
        additional["pdkv_test"]["corrupt"] = args.corrupt
    engine_args = AsyncEngineArgs(
        model=args.model_dir,
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else "uni",
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        enable_prefix_caching=args.prefix_caching,
        enable_chunked_prefill=args.chunked_prefill,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(args.concurrency, 1),
        kv_transfer_config=kv_config,
        additional_config=additional,
        load_format="dummy",
        seed=0,
        disable_log_stats=True,
        async_scheduling=args.async_scheduling,
    )
    return AsyncLLM.from_engine_args(engine_args)


# -- one request through the proxy ----------------------------------------------------------


@dataclass
class Tally:
    finished: int = 0
    failed: int = 0
    # Failed requests the injected fault (`--kill`) explains; the verdict forgives only these.
    failed_excused: int = 0


@dataclass
class Run:
    args: argparse.Namespace
    hook: ProxyHook
    prefill: Any
    decode: Any
    tallies: dict[str, Tally] = field(
        default_factory=lambda: {"prefill": Tally(), "decode": Tally()}
    )
    failures: list[dict[str, Any]] = field(default_factory=list)
    # Every failure, for the verdict; `failures` keeps the first 50 for the JSON.
    all_failures: list[dict[str, Any]] = field(default_factory=list)
    t_up: float = 0.0
    # Requests in each leg right now, for the kill record.
    in_flight: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    # What `--kill` did, once it did it.
    kill: dict[str, Any] | None = None
    # Client request id -> whether its prefill answered before the kill.
    answered_before_kill: dict[str, bool] = field(default_factory=dict)

    def fail(self, side: str, request_id: str, reason: str, kind: str) -> None:
        """`kind`: `exception` (the leg raised), `error` (vLLM finished it with
        finish_reason error, as it does when a connector cannot load its KV) or `output`
        (finished with wrong tokens: never excused)."""
        excuse = self.excuse(side, request_id, kind)
        self.tallies[side].failed += 1
        if excuse:
            self.tallies[side].failed_excused += 1
        record = {
            "side": side,
            "request_id": request_id,
            "reason": reason,
            "kind": kind,
            "at_s": round(time.monotonic() - self.t_up, 3),
            "after_kill": self.kill is not None,
            "excused": excuse,
        }
        self.all_failures.append(record)
        if len(self.failures) < 50:
            self.failures.append(record)

    def excuse(self, side: str, request_id: str, kind: str) -> str | None:
        """Why the injected fault explains this failure, or None when it does not.

        Only failures after the kill, and only of the kinds the kill causes: a leg on the
        killed engine raising (vLLM's EngineDeadError), or, with prefill killed, decode
        failing a request (finish_reason error) whose KV was on the dead prefill. A wrong
        output is never excused; the decode side's figures are checked against these
        excuses once the run is over (`check_excuses`).
        """
        if self.kill is None or kind == "output":
            return None
        killed = self.kill["side"]
        if side == killed and kind == "exception":
            return f"sent to or running on the killed {killed} engine"
        if killed == "prefill" and side == "decode" and kind == "error":
            return "its KV was on the killed prefill engine: decode could not load it"
        return None

    def check_excuses(self, decode: dict[str, Any]) -> None:
        """A decode failure excused as a KV load failure must be one the decode workers saw
        vLLM told of (`invalid_block_ids` covering its loaded blocks); otherwise it is not
        explained by the fault and stops being excused."""
        seen = {r.rsplit("-d-", 1)[0] for r in decode.get("load_failed_requests", [])}
        for record in self.all_failures:
            if record["excused"] and record["kind"] == "error":
                if record["request_id"] not in seen:
                    record["excused"] = None
                    record["reason"] += " (no load error was reported for it)"
                    self.tallies["decode"].failed_excused -= 1


async def final_output(engine: Any, prompt: list[int], params: Any, request_id: str) -> Any:
    last = None
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        last = output
    return last


def expected_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    """The stand-in sampler's output: each token is the previous one plus one, mod vocab."""
    return [(prompt[-1] + 1 + i) % vocab for i in range(n)]


def engine_processes(engine: Any) -> list[dict[str, Any]]:
    """The processes of one engine: its engine core, from vLLM's client objects
    (`AsyncLLM.engine_core.resources.engine_manager.processes`, the processes vLLM itself
    started and monitors), and every process below it (for TP > 1, the `MultiprocExecutor`
    workers), by psutil. Each with the title vLLM gave it (`VLLM::EngineCore`,
    `VLLM::Worker_TP0`, ...)."""
    import psutil

    found = []
    for core in engine.engine_core.resources.engine_manager.processes:
        proc = psutil.Process(core.pid)
        for p in [proc, *proc.children(recursive=True)]:
            try:
                title = " ".join(p.cmdline()).strip() or p.name()
            except psutil.Error:
                title = "?"
            found.append({"pid": p.pid, "title": title, "parent": p.ppid()})
    return found


def do_kill(run: Run) -> None:
    """SIGKILLs every process of the named engine at once, and records when and what."""
    side = run.args.kill["side"]
    engine = run.prefill if side == "prefill" else run.decode
    procs = engine_processes(engine)
    run.kill = {
        "side": side,
        "after_prefill_answers": run.args.kill["after"],
        "at_s": round(time.monotonic() - run.t_up, 3),
        "prefill_answers_at_kill": run.tallies["prefill"].finished,
        "in_flight": {
            "prefill_leg": run.in_flight["prefill"],
            "decode_leg": run.in_flight["decode"],
        },
        "processes": procs,
        "how": "engine core pid from AsyncLLM.engine_core.resources.engine_manager.processes, "
        "its workers by psutil.Process(core).children(recursive=True); SIGKILL to each",
    }
    for p in procs:
        try:
            os.kill(p["pid"], signal.SIGKILL)
        except ProcessLookupError:
            p["already_gone"] = True
    print(f"pdkv-test: killed {side}: {procs}", file=sys.stderr)


async def one_request(run: Run, request_id: str, prompt: list[int], sem: asyncio.Semaphore):
    async with sem:
        await proxy(run, request_id, prompt)


async def leg(run: Run, side: str, prompt: list[int], params: Any, request_id: str) -> Any:
    engine = run.prefill if side == "prefill" else run.decode
    run.in_flight[side] += 1
    try:
        return await final_output(engine, prompt, params, request_id)
    finally:
        run.in_flight[side] -= 1


async def proxy(run: Run, request_id: str, prompt: list[int]):
    from vllm import SamplingParams

    args = run.args
    # Leg 1: prefill computes the prompt's KV and one token, and keeps the KV for decode.
    params = SamplingParams(
        max_tokens=1,
        ignore_eos=True,
        detokenize=False,
        extra_args={"kv_transfer_params": run.hook.prefill_params(request_id)},
    )
    try:
        out = await leg(run, "prefill", prompt, params, f"{request_id}-p")
    except Exception as e:  # noqa: BLE001 - any engine error fails the request, not the run
        run.fail("prefill", request_id, f"{type(e).__name__}: {e}", "exception")
        return
    got = list(out.outputs[0].token_ids) if out is not None else None
    if out is None or not out.finished or got != expected_tokens(prompt, 1, args.vocab_size):
        reason = out.outputs[0].finish_reason if out is not None else None
        run.fail(
            "prefill",
            request_id,
            f"unexpected prefill output {got} (finish_reason {reason})",
            "error" if reason == "error" else "output",
        )
        return
    run.tallies["prefill"].finished += 1
    run.answered_before_kill[request_id] = run.kill is None
    if args.kill and run.kill is None and run.tallies["prefill"].finished >= args.kill["after"]:
        do_kill(run)

    # Leg 2: decode gets the prompt again with what prefill returned.
    params = SamplingParams(
        max_tokens=args.max_tokens,
        ignore_eos=True,
        detokenize=False,
        extra_args={
            "kv_transfer_params": run.hook.decode_params(request_id, out.kv_transfer_params)
        },
    )
    try:
        out = await leg(run, "decode", prompt, params, f"{request_id}-d")
    except Exception as e:  # noqa: BLE001
        run.fail("decode", request_id, f"{type(e).__name__}: {e}", "exception")
        return
    got = list(out.outputs[0].token_ids) if out is not None else None
    want = expected_tokens(prompt, args.max_tokens, args.vocab_size)
    if out is None or not out.finished or got != want:
        reason = out.outputs[0].finish_reason if out is not None else None
        run.fail(
            "decode",
            request_id,
            f"decode output {got}, expected {want} (finish_reason {reason})",
            # vLLM finishes a request it cannot load (kv_load_failure_policy "fail") with
            # finish_reason "error".
            "error" if reason == "error" else "output",
        )
        return
    run.tallies["decode"].finished += 1


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    """Distinct prompts (the first token encodes the index) of the given lengths, cycled."""
    rng = random.Random(args.seed)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    prompts = []
    for i in range(args.requests):
        n = lens[i % len(lens)]
        # Tokens from 3 up: 0-2 are the config's special ids.
        head = [3 + (i % (args.vocab_size - 3))]
        prompts.append(head + [rng.randrange(3, args.vocab_size) for _ in range(n - 1)])
    return prompts


# -- the verdict ----------------------------------------------------------------------------


async def side_report(engine: Any, tally: Tally, args: argparse.Namespace) -> dict[str, Any]:
    side: dict[str, Any] = {
        "requests_finished": tally.finished,
        "requests_failed": tally.failed,
        "requests_failed_excused": tally.failed_excused,
    }
    try:
        workers = await asyncio.wait_for(engine.collective_rpc("pdkv_test_report"), 30)
        # Connectors may free blocks a few steps after the last output (and vLLM defers a
        # free while a step that may still write the blocks is in flight): wait for the pool.
        deadline = time.monotonic() + args.drain_timeout
        while True:
            blocks = await asyncio.wait_for(
                engine.engine_core.call_utility_async("pdkv_test_kv_blocks"), 30
            )
            if blocks["free"] == blocks["usable"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        # A second opinion from vLLM's own API, no utility of ours: resetting the prefix
        # cache succeeds only when every block but the null block is free.
        side["vllm_reset_prefix_cache"] = await asyncio.wait_for(
            engine.reset_prefix_cache(), 30
        )
    except Exception as e:  # noqa: BLE001 - a dead engine is a verdict, not a crash
        side["error"] = f"{type(e).__name__}: {e}"
        side["blocks_returned"] = False
        side["mismatched_bytes"] = 0
        side["bytes_verified"] = 0
        return side
    mismatches = [m for w in workers for m in w["mismatches"]]
    side.update(
        {
            # Summed over TP ranks: each rank checks the heads it holds.
            "bytes_verified": sum(w["bytes_verified"] for w in workers),
            "requests_checked": max((w["requests_checked"] for w in workers), default=0),
            "tokens_checked": max((w["tokens_checked"] for w in workers), default=0),
            "requests_readded": max((w["requests_readded"] for w in workers), default=0),
            "requests_rolled_back": max((w["requests_rolled_back"] for w in workers), default=0),
            "mismatched_bytes": sum(w["mismatched_bytes"] for w in workers),
            "mismatches": mismatches[:20],
            "corrupted": [c for w in workers for c in w["corrupted"]],
            # Requests whose loaded blocks vLLM was told failed to load (any rank), and the
            # bytes found in those blocks (not counted above: vLLM fails or recomputes them).
            "load_failed_requests": sorted(
                {r for w in workers for r in w["load_failed_requests"]}
            ),
            "load_failed_bytes": sum(w["load_failed_bytes"] for w in workers),
            "load_failed_mismatched_bytes": sum(
                w["load_failed_mismatched_bytes"] for w in workers
            ),
            "blocks": blocks,
            "blocks_returned": blocks["free"] == blocks["usable"]
            and side["vllm_reset_prefix_cache"],
            "steps": max((w["steps"] for w in workers), default=0),
            "tp_ranks": len(workers),
            "engine": {
                k: workers[0][k] for k in ("async_scheduling", "chunked_prefill", "kv_cache_layout")
            },
        }
    )
    return side


async def drive(args: argparse.Namespace, kv: dict[str, Any]) -> dict[str, Any]:
    install_block_report()
    t0 = time.monotonic()
    if args.kill:
        # One after the other: an engine core forked while the other engine's thread is
        # forking its own would inherit the write end of that engine core's sentinel pipe
        # (multiprocessing's liveness signal), and vLLM's monitor would never see it die.
        prefill = make_engine(args, "prefill", kv["prefill"], args.prefill_tp)
        decode = make_engine(args, "decode", kv["decode"], args.decode_tp)
    else:
        # Both engines start at once: most of a start-up is one process importing and
        # initialising.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pf = pool.submit(make_engine, args, "prefill", kv["prefill"], args.prefill_tp)
            df = pool.submit(make_engine, args, "decode", kv["decode"], args.decode_tp)
            prefill, decode = pf.result(), df.result()
            pf = df = None
    t_up = time.monotonic()
    run = Run(args=args, hook=load_hook(args.proxy_hook), prefill=prefill, decode=decode)
    run.t_up = t_up
    error = None
    try:
        sem = asyncio.Semaphore(args.concurrency)
        prompts = make_prompts(args)
        tasks = [
            asyncio.ensure_future(one_request(run, f"req-{i}", p, sem))
            for i, p in enumerate(prompts)
        ]
        _, pending = await asyncio.wait(tasks, timeout=args.timeout)
        if pending:
            error = f"{len(pending)} requests still in flight after {args.timeout} s"
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        t_run = time.monotonic()
        sides = {
            "prefill": await side_report(prefill, run.tallies["prefill"], args),
            "decode": await side_report(decode, run.tallies["decode"], args),
        }
    finally:
        for engine in (prefill, decode):
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001, S110 - shutting down a dead engine may raise
                pass
        # Drop the last references now: AsyncLLM.__del__ at interpreter exit finds its
        # module globals gone and prints a TypeError.
        run.prefill = run.decode = prefill = decode = engine = None
    run.check_excuses(sides["decode"])
    why = verdict(run, sides, error)
    return {
        "ok": not why,
        "why": why,
        "error": error,
        "kill": kill_report(run),
        "config": {
            "requests": args.requests,
            "prompt_lens": args.prompt_lens,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "prefill_tp": args.prefill_tp,
            "decode_tp": args.decode_tp,
            "block_size": args.block_size,
            "num_kv_heads": args.num_kv_heads,
            "async_scheduling": args.async_scheduling,
            "chunked_prefill": args.chunked_prefill,
            "kv_transfer_config": kv,
            "corrupt": args.corrupt,
            "kill": args.kill,
        },
        "prefill": sides["prefill"],
        "decode": sides["decode"],
        "failures": run.failures,
        "startup_s": round(t_up - t0, 2),
        "run_s": round(t_run - t_up, 2),
        "wall_s": round(time.monotonic() - t0, 2),
    }


def verdict(run: Run, sides: dict[str, dict[str, Any]], error: str | None) -> list[str]:
    """Why the run fails; empty when it passes.

    Without `--kill`: every request finished on both legs with the expected tokens, no byte
    differed, both pools got every block back and some bytes crossed. With `--kill`: the
    killed engine's report is not asked for (it is dead); every failure must be excused by
    the kill; the surviving engine must have no wrong byte and every block back.
    """
    args = run.args
    killed = args.kill["side"] if args.kill else None
    why = []
    if error is not None:
        why.append(error)
    if killed and run.kill is None:
        why.append(f"the kill never happened (fewer than {args.kill['after']} prefill answers)")
    for name, side in sides.items():
        if name == killed:
            continue
        if "error" in side:
            why.append(f"{name} engine: {side['error']}")
            continue
        if side["mismatched_bytes"]:
            why.append(f"{name}: {side['mismatched_bytes']} KV bytes wrong")
        if not side["blocks_returned"]:
            blocks = side.get("blocks") or {}
            why.append(
                f"{name} blocks not returned: {blocks.get('free')} of {blocks.get('usable')} "
                f"free, {blocks.get('scheduler_requests')} requests still held by the scheduler"
            )
    unexcused = [f for f in run.all_failures if not f["excused"]]
    if unexcused:
        first = unexcused[0]
        why.append(
            f"{len(unexcused)} failed requests not explained by an injected fault "
            f"(first: {first['request_id']} on {first['side']}: {first['reason']})"
        )
    if not killed and sides["decode"]["requests_finished"] != args.requests:
        why.append(f"{sides['decode']['requests_finished']} of {args.requests} finished on decode")
    # A run in which no byte crossed is no evidence.
    if killed != "decode" and not sides["decode"].get("bytes_verified"):
        why.append("no KV byte crossed")
    return why


def kill_report(run: Run) -> dict[str, Any] | None:
    """The kill, and what became of the requests whose prefill answered before it."""
    if run.kill is None:
        return None
    before = [r for r, b in run.answered_before_kill.items() if b]
    failed = {f["request_id"]: f for f in run.all_failures if f["side"] == "decode"}
    outcome = {"finished": 0, "failed_excused": 0, "failed_not_excused": 0}
    for request_id in before:
        f = failed.get(request_id)
        if f is None:
            outcome["finished"] += 1
        elif f["excused"]:
            outcome["failed_excused"] += 1
        else:
            outcome["failed_not_excused"] += 1
    return {
        **run.kill,
        "answered_before_kill": len(before),
        "answered_before_kill_outcome": outcome,
        "failed_excused": sum(1 for f in run.all_failures if f["excused"]),
        "failed_not_excused": sum(1 for f in run.all_failures if not f["excused"]),
    }


def parse_kill(text: str) -> dict[str, Any]:
    """`prefill:N` or `decode:N`: SIGKILL that engine once N prefill legs have answered."""
    side, _, n = text.partition(":")
    if side not in ("prefill", "decode") or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError("expected prefill:N or decode:N, N >= 1")
    return {"side": side, "after": int(n)}


def parse_corrupt(text: str) -> dict[str, Any]:
    """`request:layer:position:byte[:K|V]`: `4:1:5:3` flips byte 3 of K at position 5 of layer 1
    of request req-4, on the prefill side, right after the stand-in forward wrote it."""
    parts = text.split(":")
    if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] not in ("K", "V")):
        raise argparse.ArgumentTypeError("expected request:layer:position:byte[:K|V]")
    try:
        request, layer, position, byte = (int(x) for x in parts[:4])
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a number: {e}") from e
    return {
        "request_prefix": f"req-{request}-",
        "layer": layer,
        "position": position,
        "byte": byte,
        "kv": parts[4] if len(parts) == 5 else "K",
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-lens", default=DEFAULT_PROMPT_LENS, help="comma list, cycled")
    p.add_argument("--max-tokens", type=int, default=8, help="decode output tokens")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--kv-transfer-config-prefill", help="JSON; {tmpdir} is a fresh folder")
    p.add_argument("--kv-transfer-config-decode", help="JSON; {tmpdir} is a fresh folder")
    p.add_argument(
        "--example-connector",
        action="store_true",
        help="vLLM's ExampleConnector: kv_producer / kv_consumer on a shared tmp folder",
    )
    p.add_argument("--proxy-hook", help="module:ProxyHookSubclass")
    p.add_argument(
        "--leak",
        action="store_true",
        help="with --example-connector: prefill never returns one request's blocks",
    )
    p.add_argument(
        "--trace", help="with --example-connector: log every connector hook call to this file"
    )
    p.add_argument("--corrupt", type=parse_corrupt, help="prefill flips request:layer:position:byte[:K|V]")
    p.add_argument(
        "--kill",
        type=parse_kill,
        help="prefill:N or decode:N: SIGKILL that engine's processes (engine core and workers) "
        "once N requests have had their prefill answer",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="off by default, so that what decode checks is exactly what the connector loaded",
    )
    p.add_argument(
        "--chunked-prefill",
        action=argparse.BooleanOptionalAction,
        help="default: vLLM's (on), but off with --example-connector, which cannot chunk",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="default: vLLM's (on when the executor supports it)",
    )
    p.add_argument("--drain-timeout", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=300.0, help="for all requests, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-tmp", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="pdkv-vllm-")
    args.model_dir = os.path.join(tmp, "model")
    write_model(args.model_dir, args)
    if args.example_connector:
        if args.chunked_prefill is None:
            # ExampleConnector saves only the first chunk's blocks (see README.md).
            args.chunked_prefill = False
        storage = os.path.join(tmp, "kv")
        os.makedirs(storage)
        kv = {
            side: {
                "kv_connector": EXAMPLE_CONNECTOR,
                "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": storage},
            }
            for side, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        }
        if args.leak:
            # The prefill side holds one request's blocks for ever (tracing.py).
            kv["prefill"]["kv_connector"] = "LeakingExampleConnector"
            kv["prefill"]["kv_connector_module_path"] = "pdkv_vllm_test.tracing"
        if args.trace:
            # The same connector, every hook logged (tracing.py).
            for side, config in kv.items():
                if config["kv_connector"] != EXAMPLE_CONNECTOR:
                    continue
                config["kv_connector"] = "TracingExampleConnector"
                config["kv_connector_module_path"] = "pdkv_vllm_test.tracing"
                config["kv_connector_extra_config"]["trace_path"] = os.path.abspath(args.trace)
                config["kv_connector_extra_config"]["trace_side"] = side
    else:
        if not (args.kv_transfer_config_prefill and args.kv_transfer_config_decode):
            print("give --example-connector or both --kv-transfer-config-*", file=sys.stderr)
            return 2
        kv = {
            side: json.loads(text.replace("{tmpdir}", tmp))
            for side, text in (
                ("prefill", args.kv_transfer_config_prefill),
                ("decode", args.kv_transfer_config_decode),
            )
        }
    try:
        result = asyncio.run(drive(args, kv))
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
