"""The stand-in worker: vLLM 0.34's own Worker with the model runner's forward pass and sampling
replaced, so that the engine core, the scheduler and the KV connector hooks run for real on CPU.

What stays vLLM's (called, not copied):
- `vllm.v1.worker.gpu_worker.Worker`: the class the executor drives (`execute_model`,
  `sample_tokens`, `initialize_from_config` with `ensure_kv_transfer_initialized`, the handshake
  metadata, `shutdown`); `init_worker_distributed_environment` (gloo world and TP groups).
- `vllm.v1.worker.utils.allocate_kv_cache`: the KV cache in vLLM's real layout, one
  `[blocks, kv_heads, block_size, K|V bytes]` view per layer on one backing buffer.
- `vllm.v1.worker.gpu.kv_connector.get_kv_connector` / `ActiveKVConnector`: the adapter the
  GPU model runner uses (`register_kv_caches`, `handle_preemptions`, `bind_connector_metadata`,
  `start_load_kv`, `wait_for_save`, `get_transfer_results`, stats, `clear_connector_metadata`).
- `vllm.forward_context.set_forward_context` and the per-layer hooks
  `vllm.model_executor.layers.attention.kv_transfer_utils.maybe_transfer_kv_layer`
  (`wait_for_layer_load` before a layer, `save_kv_layer` after it).

What is replaced, because vLLM's model runner and attention kernels cannot run on a CPU-only
host with the CUDA wheel (Triton and `torch.ops._C` kernels are missing):
- the model runner (`StandInModelRunner`): request bookkeeping from the `SchedulerOutput`
  (the same fields vLLM's runners read), slot mapping from block ids, and the order of the
  connector calls copied from `vllm.v1.worker.cpu.standalone_model_runner`;
- the attention layers (`StandInAttention`): objects registered in the static forward context
  with a `kv_cache` a connector can read and write, as vLLM's `Attention` layers are;
- the forward pass: per layer it checks the slots a connector loaded, then writes the known
  bytes of `kvpattern.py` for every scheduled token;
- sampling: the next token is `(last token + 1) % vocab_size`.
"""

from __future__ import annotations

import dataclasses
import mmap
import time
from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.kv_transfer_utils import (
    maybe_transfer_kv_layer,
)
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.gpu.kv_connector import NO_OP_KV_CONNECTOR, get_kv_connector
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import allocate_kv_cache
from vllm.v1.worker.worker_base import CompilationTimes

from pdkv_vllm_test import kvpattern

logger = init_logger(__name__)


def _page_aligned(size: int) -> torch.Tensor:
    """The KV cache's backing buffer, starting on a page and padded to whole pages, as device
    memory is and as vLLM pads it on ROCm for MoRIIO: MoRIIO registers the whole backing as one
    memory region through a view that starts at the page boundary below the first layer, which
    on a CPU tensor (64 bytes past a page) is a negative storage offset torch refuses."""
    pages = mmap.mmap(-1, max(-(-size // mmap.PAGESIZE), 1) * mmap.PAGESIZE)
    return torch.frombuffer(pages, dtype=torch.int8)

# The harness's options reach every worker through `additional_config["pdkv_test"]`.
CONFIG_KEY = "pdkv_test"
DEFAULT_KV_CACHE_BYTES = 64 << 20


class StandInAttention:
    """What a connector sees of an attention layer: its name and its bound `kv_cache`."""

    def __init__(self, layer_name: str, layer_index: int) -> None:
        self.layer_name = layer_name
        self.layer_index = layer_index
        self.kv_cache = torch.tensor([])

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache


@dataclasses.dataclass
class StandInAttentionMetadata:
    """Per-layer metadata; connectors that do not read backend fields only need it not None."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_actual_tokens: int


@dataclasses.dataclass
class RequestState:
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed_tokens: int


@dataclasses.dataclass
class StepState:
    req_ids: list[str]
    num_scheduled: list[int]
    finished_req_ids: set[str]
    # The checks of this step, per (request, block): judged once vLLM knows which blocks the
    # connector failed to load (`invalid_block_ids`, reported after the forward).
    checked: dict[tuple[str, int], kvpattern.CheckResult] = dataclasses.field(
        default_factory=dict
    )


# The runner of this process; the per-layer stand-in attention is a module function so that
# vLLM's `maybe_transfer_kv_layer` can wrap it exactly as it wraps the attention op.
_RUNNER: StandInModelRunner | None = None


@maybe_transfer_kv_layer
def stand_in_attention(layer_name: str) -> None:
    """One layer's forward: check loaded KV, write the scheduled tokens' KV, maybe corrupt."""
    assert _RUNNER is not None
    _RUNNER.layer_forward(layer_name)


class StandInModelRunner:
    """Replaces vLLM's GPU/CPU model runner (see the module docstring for what it keeps)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.device = device
        self.is_pooling_model = False
        self.block_size = self.cache_config.block_size
        self.vocab_size = self.model_config.get_vocab_size()
        self.num_layers = self.model_config.get_num_layers(vllm_config.parallel_config)
        self.dtype = self.model_config.dtype
        self.tp_rank = get_tensor_model_parallel_rank()
        self.geometry = kvpattern.Geometry.for_rank(
            total_kv_heads=self.model_config.get_total_num_kv_heads(),
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            tp_rank=self.tp_rank,
            head_size=self.model_config.get_head_size(),
            dtype_size=torch.tensor([], dtype=self.dtype).element_size(),
        )
        options = (vllm_config.additional_config or {}).get(CONFIG_KEY, {})
        self.corrupt: dict[str, Any] | None = options.get("corrupt")
        self.corrupted: list[dict[str, Any]] = []
        self.layers: dict[str, StandInAttention] = {}
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.kv_connector = NO_OP_KV_CONNECTOR
        self.step: StepState | None = None
        self.batch: dict[str, Any] | None = None
        self.result = kvpattern.CheckResult()
        # Loaded positions in blocks the connector reported it could not load: vLLM fails or
        # recomputes those requests, so their bytes are not the connector's answer.
        self.load_failed = kvpattern.CheckResult()
        self.load_failed_requests: set[str] = set()
        self.requests_checked = 0
        self.requests_readded = 0
        self.requests_rolled_back = 0
        self.seen: set[str] = set()
        self.tokens_checked = 0
        self.tokens_written = 0
        self.steps = 0

    # -- set-up, as vLLM's runners do it -------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Registers one stand-in attention layer per model layer under vLLM's layer names."""
        global _RUNNER
        context = self.vllm_config.compilation_config.static_forward_context
        for index in range(self.num_layers):
            name = f"model.layers.{index}.self_attn.attn"
            layer = StandInAttention(name, index)
            context[name] = layer
            self.layers[name] = layer
        self.model_memory_usage = 0
        _RUNNER = self

    def get_model(self) -> None:
        return None

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=len(self.geometry.global_heads),
            head_size=self.model_config.get_head_size(),
            dtype=self.dtype,
        )
        return {name: spec for name in self.layers}

    def update_max_model_len(self, max_model_len: int) -> None:
        return None

    def initialize_kv_cache(
        self, kv_cache_config: KVCacheConfig, *args: Any, **kwargs: Any
    ) -> None:
        assert len(kv_cache_config.kv_cache_groups) == 1, "one full-attention group"
        self.kv_cache_config = kv_cache_config
        self.kv_caches = allocate_kv_cache(
            kv_cache_config,
            self.device,
            self.cache_config.get_resolved_kv_cache_layout(),
            allocate=_page_aligned,
        )
        for name, cache in self.kv_caches.items():
            self.layers[name].bind_kv_cache(cache)
        self.kv_connector = get_kv_connector(self.vllm_config, self.kv_caches)

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    # -- one step --------------------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Applies the scheduler's view; returns the ids vLLM sent in full this step.

        Those are new requests, or requests again after a preemption: every position before
        their first scheduled token was computed outside this step, and is checked.
        """
        gone = set(scheduler_output.finished_req_ids)
        gone |= scheduler_output.preempted_req_ids or set()
        for req_id in gone:
            self.requests.pop(req_id, None)
        added = []
        for new in scheduler_output.scheduled_new_reqs:
            # A request vLLM sends again in full was preempted (or is a streaming update).
            if new.req_id in self.seen:
                self.requests_readded += 1
            self.seen.add(new.req_id)
            self.requests[new.req_id] = RequestState(
                token_ids=list(new.prefill_token_ids),
                prompt_len=len(new.prompt_token_ids or []),
                block_ids=list(new.block_ids[0]),
                num_computed_tokens=new.num_computed_tokens,
            )
            added.append(new.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, num_computed, new_block_ids, num_output in zip(
            cached.req_ids,
            cached.num_computed_tokens,
            cached.new_block_ids,
            cached.num_output_tokens,
        ):
            state = self.requests[req_id]
            if num_computed < state.num_computed_tokens:
                # vLLM went back (it recomputes KV a connector failed to load, and drops the
                # token sampled on top of it): forget the tokens it dropped too.
                self.requests_rolled_back += 1
                del state.token_ids[max(state.prompt_len + num_output, num_computed + 1) :]
            state.num_computed_tokens = num_computed
            if new_block_ids is not None:
                state.block_ids.extend(new_block_ids[0])
        return added

    def _slots(self, state: RequestState, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end, dtype=torch.int64)
        blocks = torch.tensor(state.block_ids, dtype=torch.int64)
        return blocks[positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )

    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: Any = None
    ) -> ModelRunnerOutput | None:
        added = self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # vLLM's runners still run the connector for steps that only move KV.
            return self.kv_connector.no_forward(scheduler_output)
        self.steps += 1

        req_ids = list(scheduler_output.num_scheduled_tokens)
        num_scheduled = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        writes = []
        for req_id, n in zip(req_ids, num_scheduled):
            state = self.requests[req_id]
            start = state.num_computed_tokens
            writes.append(
                (
                    req_id,
                    self._slots(state, start, start + n),
                    torch.tensor(state.token_ids[start : start + n], dtype=torch.int64),
                    torch.arange(start, start + n, dtype=torch.int64),
                )
            )
        # On a request's first step here, every position before its first scheduled token
        # was computed elsewhere (loaded by the connector): check all of them.
        checks = []
        for req_id in added:
            state = self.requests[req_id]
            n = state.num_computed_tokens
            if n > 0:
                self.requests_checked += 1
                self.tokens_checked += n
                # One check per block, so that a block vLLM is told failed to load can be
                # set apart from the others after the forward.
                for start in range(0, n, self.block_size):
                    end = min(n, start + self.block_size)
                    checks.append(
                        (
                            req_id,
                            state.block_ids[start // self.block_size],
                            self._slots(state, start, end),
                            torch.tensor(state.token_ids[start:end], dtype=torch.int64),
                            torch.arange(start, end, dtype=torch.int64),
                        )
                    )
        self.batch = {"writes": writes, "checks": checks, "checked": {}}

        slot_mapping = torch.cat([w[1] for w in writes])
        query_start_loc = torch.tensor([0, *torch.tensor(num_scheduled).cumsum(0).tolist()])
        seq_lens = torch.tensor(
            [self.requests[r].num_computed_tokens + n for r, n in zip(req_ids, num_scheduled)]
        )
        metadata = StandInAttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            num_actual_tokens=int(slot_mapping.numel()),
        )
        attn_metadata = {name: metadata for name in self.layers}
        input_batch = SimpleNamespace(
            req_ids=req_ids,
            idx_mapping=torch.arange(len(req_ids), dtype=torch.int32),
            num_tokens=int(slot_mapping.numel()),
        )
        # The order of vLLM's StandaloneCPUModelRunner.execute_model: pre_forward inside the
        # forward context, then the model (whose attention layers carry the per-layer
        # hooks), then finish_forward outside it.
        with set_forward_context(
            attn_metadata,
            self.vllm_config,
            num_tokens=int(slot_mapping.numel()),
            slot_mapping={name: slot_mapping for name in self.layers},
        ):
            self.kv_connector.pre_forward(scheduler_output, input_batch)
            for name in self.layers:
                stand_in_attention(name)
        self.kv_connector.finish_forward()
        checked = self.batch["checked"]
        self.batch = None
        self.step = StepState(
            req_ids=req_ids,
            num_scheduled=num_scheduled,
            finished_req_ids=scheduler_output.finished_req_ids,
            checked=checked,
        )
        return None

    def layer_forward(self, layer_name: str) -> None:
        assert self.batch is not None
        layer = self.layers[layer_name]
        cache = layer.kv_cache
        for req_id, block, slots, tokens, positions in self.batch["checks"]:
            kvpattern.check(
                cache,
                slots,
                self.block_size,
                tokens,
                positions,
                layer.layer_index,
                self.geometry,
                req_id,
                self.batch["checked"].setdefault((req_id, block), kvpattern.CheckResult()),
            )
        for req_id, slots, tokens, positions in self.batch["writes"]:
            kvpattern.write(
                cache, slots, self.block_size, tokens, positions, layer.layer_index, self.geometry
            )
            self.tokens_written += int(slots.numel())
            self._maybe_corrupt(req_id, slots, positions, layer)

    def _maybe_corrupt(
        self,
        req_id: str,
        slots: torch.Tensor,
        positions: torch.Tensor,
        layer: StandInAttention,
    ) -> None:
        """The injected bug: flip one byte of one layer of one request, once, after the write."""
        spec = self.corrupt
        if spec is None or self.corrupted or layer.layer_index != spec["layer"]:
            return
        if not req_id.startswith(spec["request_prefix"]):
            return
        hits = (positions == spec["position"]).nonzero()
        if hits.numel() == 0:
            return
        slot = int(slots[int(hits[0])])
        offset = spec["byte"]
        head, within = divmod(offset, self.geometry.head_bytes)
        if head not in self.geometry.global_heads:
            return
        head_slot = self.geometry.global_heads.index(head)
        column = within + (self.geometry.head_bytes if spec.get("kv", "K") == "V" else 0)
        cache = kvpattern.as_bytes(layer.kv_cache)
        cache[slot // self.block_size, head_slot, slot % self.block_size, column] ^= 0xFF
        self.corrupted.append(
            {
                "request_id": req_id,
                "layer": layer.layer_index,
                "position": spec["position"],
                "kv": spec.get("kv", "K"),
                "byte_offset": offset,
                "tp_rank": self.tp_rank,
            }
        )

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput | None:
        step, self.step = self.step, None
        if step is None:
            return None
        sampled: list[list[int]] = []
        for req_id, n in zip(step.req_ids, step.num_scheduled):
            state = self.requests[req_id]
            state.num_computed_tokens += n
            if state.num_computed_tokens >= len(state.token_ids):
                # Deterministic sampling: the same on every rank and every engine.
                token = (state.token_ids[-1] + 1) % self.vocab_size
                state.token_ids.append(token)
                sampled.append([token])
            else:
                # A chunk of a prefill: nothing is sampled yet.
                sampled.append([])
        output = ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=sampled)
        output.kv_connector_output = self.kv_connector.post_forward(step.finished_req_ids)
        connector_output = output.kv_connector_output
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        for (req_id, block), result in step.checked.items():
            if block in invalid:
                self.load_failed_requests.add(req_id)
                kvpattern.merge(self.load_failed, result)
            else:
                kvpattern.merge(self.result, result)
        return output

    def report(self) -> dict[str, Any]:
        return {
            "tp_rank": self.tp_rank,
            "steps": self.steps,
            "tokens_written": self.tokens_written,
            "requests_checked": self.requests_checked,
            "requests_readded": self.requests_readded,
            "requests_rolled_back": self.requests_rolled_back,
            "tokens_checked": self.tokens_checked,
            "bytes_verified": self.result.bytes_verified,
            "mismatched_bytes": self.result.mismatched_bytes,
            "mismatches": [dataclasses.asdict(m) for m in self.result.mismatches],
            "corrupted": self.corrupted,
            "load_failed_requests": sorted(self.load_failed_requests),
            "load_failed_bytes": self.load_failed.bytes_verified,
            "load_failed_mismatched_bytes": self.load_failed.mismatched_bytes,
            "requests_alive": len(self.requests),
            # As the engine resolved them, not as the driver asked.
            "async_scheduling": self.vllm_config.scheduler_config.async_scheduling,
            "chunked_prefill": self.vllm_config.scheduler_config.enable_chunked_prefill,
            "kv_cache_layout": str(self.cache_config.get_resolved_kv_cache_layout()),
        }


class StandInWorker(Worker):
    """vLLM's Worker on the CPU with the stand-in model runner; everything else is inherited."""

    def init_device(self) -> None:
        # vLLM's Worker.init_device knows only CUDA; this is its CPU branch: the device,
        # then the distributed environment (gloo, from the platform), then the runner.
        self.device = torch.device("cpu")
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            "gloo",
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = StandInModelRunner(self.vllm_config, self.device)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        self.model_runner.load_model()

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        # What vLLM's Worker does for `current_platform.is_cpu()`: no memory pool.
        return nullcontext()

    def determine_available_memory(self) -> int:
        return self.cache_config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def pdkv_test_report(self) -> dict[str, Any]:
        """Reached from the driver through `collective_rpc("pdkv_test_report")`."""
        import sys

        report = self.model_runner.report()
        report["rank"] = self.rank
        report["time"] = time.time()
        # A MoRIIO side's data plane (the test's `mori` stub): what it read and served.
        stub = sys.modules.get("mori.io")
        if stub is not None and hasattr(stub, "STATS"):
            report["mori_stub"] = dict(stub.STATS)
        return report
