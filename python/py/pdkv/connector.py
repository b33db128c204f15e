"""``PdkvConnector``: pdkv's KV connector for vLLM (READ mode).

vLLM builds the connector once per role. In the scheduler process it drives the engine's node
(``pdkv._native.PrefillNode`` or ``DecodeNode``); in each worker process it runs the worker's
rank (``pdkv._native.Rank``: pdkv's prefill or decode driver on a thread, with its handshake and
notify listeners and its data plane). This file is wiring: it copies KV blocks between vLLM's
cache tensors and the rank's registered regions, and carries the nodes' messages where vLLM
carries connector data (scheduler to workers in the step's metadata, workers to scheduler in
their per-step metadata and their handshake metadata at start). Every routing, handshake, vote,
release, lease, fence and incarnation decision is made by pdkv's core behind ``pdkv._native``.

Configure it with ``--kv-transfer-config``::

    {"kv_connector": "PdkvConnector", "kv_connector_module_path": "pdkv.connector",
     "kv_role": "kv_producer" | "kv_consumer",
     "kv_connector_extra_config": {"host_ip": "10.0.0.5", "handshake_port": 6301,
                                   "notify_port": 61005, "deployment": "1P_TP2:1D_TP2"}}

``host_ip``, ``handshake_port``, ``notify_port``, ``defer_timeout`` and ``transfer_timeout``
(seconds) mean what they mean for vLLM's MoRIIO connector. pdkv's own keys: ``deployment``
(pdkv's notation of the P/D deployment; by default one prefill and one decode engine of this
engine's TP size), ``engine`` (``P0``, ``D0``, ...; by default the first of this role),
``transport`` (``tcp`` or ``rdma``), ``handshake_timeout`` (seconds), ``metrics_port`` (rank
(0, 0)'s Prometheus endpoint; rank (dp, tp) serves at ``+ dp * tp_size + tp``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from pdkv import _native

logger = logging.getLogger("pdkv.connector")


def _log_from_env() -> None:
    """``PDKV_LOG=debug|info|warning`` gives pdkv's logger a handler of its own with times and
    process ids (vLLM configures only its own loggers, so without it pdkv's warnings reach
    stderr bare and its debug lines nowhere)."""
    level = os.environ.get("PDKV_LOG")
    root = logging.getLogger("pdkv")
    if not level or root.handlers:
        return
    if level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"PDKV_LOG={level!r}: expected debug, info, warning or error")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d pid=%(process)d %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False


_log_from_env()

# How long a worker waits for its own rank's vote or step end before calling the step failed;
# the core's own timeouts (handshake, transfer) end a stuck request well before this.
_STEP_WAIT_MARGIN_S = 5.0


@dataclass
class PdkvMetadata(KVConnectorMetadata):
    """Scheduler to workers, once per step."""

    # (rank name, message bytes) from the prefill engine's node, in order.
    to_workers: list[tuple[str, bytes]] = field(default_factory=list)
    # Prefill: (transfer id, block ids) of requests computed this step, to stage after it.
    save: list[tuple[str, list[int]]] = field(default_factory=list)
    # Decode: the step every worker begins, and its requests: number -> (vLLM id, local blocks).
    step: tuple[int, bytes] | None = None
    requests: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    # Decode: blocks of requests whose kv_transfer_params could not be used; the workers report
    # them to vLLM as failed loads, so vLLM computes the prompt itself.
    refused: list[int] = field(default_factory=list)


@dataclass
class PdkvWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers to scheduler, once per step: what each rank said, in order."""

    messages: list[tuple[str, bytes]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PdkvWorkerMetadata)
        return PdkvWorkerMetadata(self.messages + other.messages)


@dataclass
class PdkvHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's rank at start: its name and its `Ready` (which names its incarnation)."""

    rank: str
    ready: bytes


def _config(vllm_config, role_char: str) -> dict[str, Any]:
    """The native module's engine configuration, from vLLM's and the extra config."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    parallel = vllm_config.parallel_config
    tp, dp = parallel.tensor_parallel_size, parallel.data_parallel_size
    own = f"DP{dp}TP{tp}" if dp > 1 else f"TP{tp}"
    deployment = extra.get("deployment") or f"1P_{own}:1D_{own}"
    model = vllm_config.model_config
    layers = model.get_num_layers(parallel)
    kv_heads = model.get_total_num_kv_heads()
    head_size = model.get_head_size()
    dtype = vllm_config.cache_config.cache_dtype
    torch_dtype = model.dtype if dtype in (None, "auto") else _cache_dtype(dtype)
    element = torch.tensor([], dtype=torch_dtype).element_size()
    use_mla = bool(getattr(model, "use_mla", False))
    per_token = (1 if use_mla else 2) * (1 if use_mla else kv_heads) * head_size * element
    timeouts = {
        "handshake_ms": int(float(extra.get("handshake_timeout", 10)) * 1000),
        "transfer_ms": int(float(extra.get("transfer_timeout", 30)) * 1000),
        "defer_ms": int(float(extra.get("defer_timeout", 60)) * 1000),
        "collective_ms": 600_000,
    }
    return {
        "deployment": deployment,
        "engine": extra.get("engine", f"{role_char}0"),
        "model": {
            "use_mla": use_mla,
            "kv_heads": 1 if use_mla else kv_heads,
            "layers": layers,
            "bytes_per_token_per_layer": per_token,
            "block_size_tokens": vllm_config.cache_config.block_size,
        },
        "host": extra.get("host_ip") or os.environ.get("VLLM_HOST_IP") or "127.0.0.1",
        "handshake_port": int(extra.get("handshake_port", 6301)),
        "notify_port": int(extra.get("notify_port", 61005)),
        "timeouts": timeouts,
        "transport": extra.get("transport", "tcp"),
        "rdma_devices": list(extra.get("rdma_devices", [])),
        "metrics_port": int(extra["metrics_port"]) if "metrics_port" in extra else None,
        # For hostile tests only: faults on the control messages the ranks send.
        "message_faults": extra.get("pdkv_message_faults", {}),
    }


def _cache_dtype(name: str) -> torch.dtype:
    known = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
             "float32": torch.float32, "fp8": torch.uint8, "fp8_e4m3": torch.uint8,
             "fp8_e5m2": torch.uint8}
    if name not in known:
        raise ValueError(f"pdkv: KV cache dtype {name!r} is not one pdkv knows the size of")
    return known[name]


def _role_char(vllm_config) -> str:
    role = vllm_config.kv_transfer_config.kv_role
    if role == "kv_producer":
        return "P"
    if role == "kv_consumer":
        return "D"
    raise ValueError(
        f"pdkv: kv_role {role!r}: an engine is either the prefill side (kv_producer) or the decode "
        "side (kv_consumer)"
    )


class PdkvConnector(KVConnectorBase_V1):
    """pdkv's connector: both roles, READ mode (decode reads prefill's KV)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._side = _role_char(vllm_config)
        self._config = _config(vllm_config, self._side)
        self._config_json = json.dumps(self._config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = (_PrefillScheduler if self._side == "P" else _DecodeScheduler)(
                self._config_json, vllm_config
            )
            self._worker = None
        else:
            self._scheduler = None
            self._worker = (_PrefillWorker if self._side == "P" else _DecodeWorker)(
                self._config_json, vllm_config
            )

    # ---- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.metadata(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.output(connector_output)

    def set_xfer_handshake_metadata(self, metadata) -> None:
        self._scheduler.handshakes(metadata)

    # ---- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def finish_forward(self) -> None:
        # The forward has written this step's KV: stage it now, before vLLM can hand the step's
        # output (and a finished request's kv_transfer_params) to anyone. wait_for_save may
        # come a step later under async scheduling, after a decode engine has started reading.
        self._worker.save(self._connector_metadata)

    def wait_for_save(self):
        return

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def get_finished(self, finished_req_ids: set[str]):
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def build_connector_worker_meta(self):
        return self._worker.worker_meta()

    def get_handshake_metadata(self):
        return self._worker.handshake_metadata()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()


# ---------------------------------------------------------------- scheduler side


class _PrefillScheduler:
    """The prefill engine's node: registers finished requests, frees what the engine frees."""

    def __init__(self, config_json: str, vllm_config):
        self._node = _native.PrefillNode(config_json)
        self._dp = vllm_config.parallel_config.data_parallel_rank or 0
        self._block_size = vllm_config.cache_config.block_size
        # vLLM id -> (transfer id, blocks so far) of requests prefilled for a remote decode.
        self._remote: dict[str, tuple[str, list[int]]] = {}

    def handshakes(self, metadata) -> None:
        for meta in metadata.values():
            if isinstance(meta, PdkvHandshakeMetadata):
                self._node.worker_message(meta.rank, meta.ready)

    def matched(self, request, num_computed_tokens):
        return 0, False

    def allocated(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            transfer_id = params.get("transfer_id")
            if not transfer_id:
                raise ValueError(
                    f"pdkv: request {request.request_id} asks for a remote decode without a "
                    "`transfer_id` in its kv_transfer_params (the router mints one per request)"
                )
            self._remote[request.request_id] = (transfer_id, [])

    def metadata(self, scheduler_output) -> PdkvMetadata:
        meta = PdkvMetadata(to_workers=[(rank, bytes(msg)) for rank, msg in self._node.to_workers()])
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._remote:
                transfer_id, blocks = self._remote[new.req_id]
                blocks[:] = list(new.block_ids[0])
                meta.save.append((transfer_id, list(blocks)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._remote:
                transfer_id, blocks = self._remote[req_id]
                if cached.new_block_ids[i] is not None:
                    blocks.extend(cached.new_block_ids[i][0])
                meta.save.append((transfer_id, list(blocks)))
        return meta

    def finished(self, request, block_ids):
        entry = self._remote.pop(request.request_id, None)
        params = request.kv_transfer_params
        if entry is None or not params:
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            # Aborted or stopped early: nobody will read it.
            return False, None
        blocks = list(block_ids[0]) if block_ids and isinstance(block_ids[0], list) else list(block_ids)
        # Only the prompt's blocks hold KV this engine computed. Under async scheduling vLLM may
        # already have given the request a block for its next token (a prompt that fills its
        # last block exactly), which was never staged for this transfer.
        blocks = blocks[: -(-request.num_prompt_tokens // self._block_size)]
        try:
            answer = self._node.finished(request.request_id, json.dumps(params), self._dp, blocks)
        except ValueError as e:
            logger.error("pdkv: request %s is not handed to decode: %s", request.request_id, e)
            return False, None
        logger.debug("pdkv: prefill answers %s for %s (%d blocks)", params.get("transfer_id"), request.request_id, len(blocks))
        return True, json.loads(answer)

    def output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PdkvWorkerMetadata):
            for rank, msg in meta.messages:
                self._node.worker_message(rank, msg)
        self._node.tick()
        for note in self._node.notes():
            logger.warning("pdkv: %s", note)
        freed = set(self._node.freed())
        if freed:
            logger.debug("pdkv: prefill frees %s", sorted(freed))
        # Blocks are freed when the engine says, never on a worker's word alone.
        connector_output.finished_sending = freed or None


class _DecodeScheduler:
    """The decode engine's requests whose KV is remote, read synchronously before the forward."""

    def __init__(self, config_json: str, vllm_config):
        self._node = _native.DecodeNode(config_json)
        self._loaded: set[str] = set()
        self._requests: dict[int, tuple[str, list[int]]] = {}
        self._refused: list[int] = []

    def handshakes(self, metadata) -> None:
        return

    def matched(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or request.request_id in self._loaded:
            return 0, False
        # The last prompt token is computed here, so the step samples the first output token;
        # the rest is read before the forward (the load is synchronous, as MoRIIO's READ mode).
        return max(request.num_prompt_tokens - num_computed_tokens - 1, 0), False

    def allocated(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or request.request_id in self._loaded:
            return
        self._loaded.add(request.request_id)
        blocks = list(blocks.get_block_ids()[0])
        try:
            number, local = self._node.request(json.dumps(params), blocks)
        except ValueError as e:
            # Bad params from the wire fail this request's load, never the engine: vLLM was told
            # the prompt's KV is external, so its blocks go back as failed loads and vLLM computes
            # them here.
            logger.error("pdkv: KV of %s cannot be asked for: %s", request.request_id, e)
            self._refused.extend(blocks)
            return
        self._requests[number] = (request.request_id, local)
        logger.debug("pdkv: decode request %d is %s (%s, %d blocks)", number, request.request_id, params.get("transfer_id"), len(local))

    def metadata(self, scheduler_output) -> PdkvMetadata:
        meta = PdkvMetadata()
        meta.refused, self._refused = self._refused, []
        step = self._node.step()
        if step is not None:
            meta.step = (step[0], bytes(step[1]))
            meta.requests, self._requests = self._requests, {}
            logger.debug("pdkv: decode step %d begins with requests %s", step[0], sorted(meta.requests))
        return meta

    def finished(self, request, block_ids):
        self._loaded.discard(request.request_id)
        return False, None

    def output(self, connector_output) -> None:
        return


# ---------------------------------------------------------------- worker side


def _block_view(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A view of a layer's KV cache with blocks first and every other dimension in the order
    of its memory (largest stride first), so that one block's entry holds that block's bytes as
    they lie in memory: the bytes a MoRIIO peer moves. vLLM's layouts put blocks or K/V first,
    and its 0.34 views are logical ``[B, H, N, C]`` over a physical ``[B, N, H, C]`` by default
    (`VLLM_KV_CACHE_LAYOUT`): copying the logical order instead, as pdkv did, agreed with MoRIIO
    only for one KV head per rank or the ``HND`` layout."""
    for dim in range(min(2, tensor.dim())):
        if tensor.shape[dim] == num_blocks:
            rest = sorted((d for d in range(tensor.dim()) if d != dim), key=lambda d: -tensor.stride(d))
            return tensor.permute([dim, *rest])
    raise ValueError(f"pdkv: a KV cache of shape {tuple(tensor.shape)} has no block dimension of {num_blocks}")


def _gather(view: torch.Tensor, blocks: list[int]) -> bytes:
    """The bytes of `blocks` of a `_block_view`, block after block."""
    index = torch.tensor(blocks, dtype=torch.long, device=view.device)
    return view.index_select(0, index).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _scatter(view: torch.Tensor, blocks: list[int], data: bytes) -> None:
    """Writes `_gather`'s bytes of `blocks` back into a `_block_view` (and so into the cache)."""
    index = torch.tensor(blocks, dtype=torch.long, device=view.device)
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(view.dtype)
    view.index_copy_(0, index, values.reshape(len(blocks), *view.shape[1:]).to(view.device))


class _Worker:
    """What both sides' workers share: the rank, and the copies between vLLM's cache and it."""

    def __init__(self, config_json: str, vllm_config):
        self._config_json = config_json
        self._vllm_config = vllm_config
        self._rank = None
        self._ready: bytes | None = None
        self._layers: list[torch.Tensor] = []
        self._block_views: list[torch.Tensor] = []
        self._meta: PdkvMetadata | None = None
        self._said: list[tuple[str, bytes]] = []

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        tensors = list(kv_caches.values())
        num_blocks = self._num_blocks(tensors)
        tp_group = get_tp_group()
        dp = self._vllm_config.parallel_config.data_parallel_rank or 0
        self._rank = _native.Rank(self._config_json, dp, tp_group.rank_in_group, num_blocks)
        self._layers = tensors
        self._block_views = [_block_view(t, num_blocks) for t in tensors]
        block_len = self._rank.block_len()
        got = tensors[0].element_size() * tensors[0].numel() // num_blocks
        if got != block_len:
            raise ValueError(
                f"pdkv: vLLM's KV blocks hold {got} bytes per layer on this rank, pdkv's model of the "
                f"served model gives {block_len}: the model configuration does not describe this cache"
            )
        while self._ready is None:
            for text, raw in self._rank.poll(30.0):
                said = json.loads(text)
                if "SetupFailed" in said:
                    raise RuntimeError(f"pdkv: {self._rank.name()} could not start: {said['SetupFailed']['error']}")
                if "Ready" in said:
                    self._ready = bytes(raw)
                    logger.info(
                        "pdkv: %s ready (%s); metrics at %s",
                        self._rank.name(),
                        said["Ready"].get("memory"),
                        self._rank.metrics_address() or "(no metrics_port)",
                    )
                else:
                    self._said.append((self._rank.name(), bytes(raw)))

    @staticmethod
    def _num_blocks(tensors: list[torch.Tensor]) -> int:
        if not tensors:
            raise ValueError("pdkv: vLLM registered no KV cache")
        first = tensors[0]
        # Blocks are the larger of the first two dimensions (the other is K/V's 2).
        return int(first.shape[1] if first.shape[0] == 2 and first.dim() > 2 else first.shape[0])

    def bind(self, meta) -> None:
        self._meta = meta if isinstance(meta, PdkvMetadata) else None
        if self._meta is None or self._rank is None:
            return
        name = self._rank.name()
        for rank, msg in self._meta.to_workers:
            if rank == name:
                self._rank.deliver(msg)

    def handshake_metadata(self):
        if self._rank is None or self._ready is None:
            return None
        return PdkvHandshakeMetadata(rank=self._rank.name(), ready=self._ready)

    def worker_meta(self):
        if self._rank is None:
            return None
        self._collect(0.0)
        said, self._said = self._said, []
        # Always an answer, empty or not: vLLM calls the scheduler side's update_connector_output
        # only for a step whose workers said something, and that call is where the prefill
        # engine's reaper runs. Saying nothing on idle steps left a TP1 prefill holding the
        # blocks of a dead decode forever (TP2 workers happened to always say something).
        return PdkvWorkerMetadata(said)

    def _collect(self, timeout_s: float) -> list[dict]:
        """What the rank said; kept for the scheduler, and returned for this worker to read."""
        out = []
        for text, raw in self._rank.poll(timeout_s):
            said = json.loads(text)
            out.append(said)
            logger.debug("pdkv: %s said %.300s", self._rank.name(), text)
            kind = next(iter(said)) if isinstance(said, dict) else said
            if kind in ("Finished", "Leased", "Refused", "LeaseCapped", "ProtocolError", "Problem"):
                self._said.append((self._rank.name(), bytes(raw)))
            if kind == "Problem":
                logger.warning("pdkv: %s: %s", self._rank.name(), said["Problem"])
            if kind == "MessageFault":
                logger.warning("pdkv: %s: injected message fault: %s", self._rank.name(), said["MessageFault"])
        return out

    def load(self, meta) -> None:
        return

    def save(self, meta) -> None:
        return

    def load_errors(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        if self._rank is not None:
            self._rank.shutdown(5.0)


class _PrefillWorker(_Worker):
    """A prefill rank: stages each remote-decode request's blocks after the forward wrote them."""

    def save(self, meta) -> None:
        if not isinstance(meta, PdkvMetadata) or self._rank is None:
            return
        for transfer_id, blocks in meta.save:
            if not blocks:
                continue
            try:
                began = time.monotonic()
                for layer in range(len(self._layers)):
                    self._rank.stage(layer, blocks, _gather(self._block_views[layer], blocks))
                self._rank.staged_transfer(transfer_id, blocks, 10.0)
                logger.debug("pdkv: %s staged %s (%d blocks) in %.1f ms", self._rank.name(), transfer_id, len(blocks), (time.monotonic() - began) * 1e3)
            except (RuntimeError, ValueError) as e:
                # Its blocks stay fenced: decode's reads of it are refused and fail the request
                # there, and the engine's reaper frees the blocks.
                logger.error("pdkv: %s: cannot stage %s: %s", self._rank.name(), transfer_id, e)


class _Inbox:
    """What a decode rank said that its worker may still wait for: votes and request outcomes.

    Everything else the rank says (reads verified, dials, step ends, heartbeats) is logged and
    forwarded by `_collect` and never held, and what a finished step could have wanted is
    forgotten with it, so the inbox holds at most one step's worth. Holding every message grew
    it by a read per layer per request for the life of the server, and every wait scanned it.
    """

    KINDS = ("Vote", "Received", "RecvFailed")

    def __init__(self) -> None:
        self._held: list[dict] = []
        # The last step forgotten and the highest request number it or an earlier one had:
        # the decode node numbers requests in order and a step takes every request numbered
        # since the previous one, so nothing at or below these can be waited for again.
        self._last_step = -1
        self._last_request = -1

    def __len__(self) -> int:
        return len(self._held)

    def _live(self, s: dict) -> bool:
        kind, body = next(iter(s.items()))
        if kind == "Vote":
            return body["step"] > self._last_step
        return body["request"] > self._last_request

    def add(self, said: list) -> None:
        self._held.extend(
            s for s in said if isinstance(s, dict) and next(iter(s), None) in self.KINDS and self._live(s)
        )

    def take(self, wanted) -> dict | None:
        """The oldest held message `wanted` accepts, removed; None when none is held."""
        for i, s in enumerate(self._held):
            if wanted(s):
                return self._held.pop(i)
        return None

    def forget_step(self, step: int, requests) -> None:
        """Drops what step `step` (whose request numbers are `requests`) or an earlier one
        could have wanted, now or when it comes: a vote or an outcome after its wait gave up."""
        self._last_step = max(self._last_step, step)
        self._last_request = max(self._last_request, max(requests, default=-1))
        self._held = [s for s in self._held if self._live(s)]


class _DecodeWorker(_Worker):
    """A decode rank: the step's eager handshakes and the TP group's MIN vote, then the reads,
    landed in vLLM's blocks before the forward."""

    def __init__(self, config_json: str, vllm_config):
        super().__init__(config_json, vllm_config)
        self._errors: set[int] = set()
        self._inbox = _Inbox()
        timeouts = json.loads(config_json)["timeouts"]
        self._wait_s = (timeouts["handshake_ms"] + timeouts["transfer_ms"]) / 1000 + _STEP_WAIT_MARGIN_S

    def load(self, meta) -> None:
        if isinstance(meta, PdkvMetadata) and meta.refused:
            self._errors.update(meta.refused)
            meta.refused = []
        if not isinstance(meta, PdkvMetadata) or meta.step is None or self._rank is None:
            return
        step, begin = meta.step
        meta.step = None  # once per step: vLLM may call start_load_kv again after the forward
        # Nothing between here and the MIN may raise or return early: a worker that left would
        # leave its TP peers waiting in the all-reduce (the lazy-handshake hang in another form).
        vote = None
        began = time.monotonic()
        try:
            self._rank.deliver(begin)
            vote = self._await(lambda s: "Vote" in s and s["Vote"]["step"] == step, f"its vote for step {step}")
        except (RuntimeError, ValueError) as e:
            logger.error("pdkv: %s: step %d: %s", self._rank.name(), step, e)
        voted = time.monotonic()
        ok = self._min_over_tp(bool(vote and vote["Vote"]["ok"]))
        logger.debug(
            "pdkv: %s: step %d (requests %s) voted %s in %.1f ms, MIN %s after %.1f ms more",
            self._rank.name(), step, sorted(meta.requests), vote and vote["Vote"]["ok"],
            (voted - began) * 1e3, ok, (time.monotonic() - voted) * 1e3,
        )
        waiting = set(meta.requests)
        try:
            self._rank.vote_result(step, ok)
            while waiting:
                said = self._await(
                    lambda s: ("Received" in s and s["Received"]["request"] in waiting)
                    or ("RecvFailed" in s and s["RecvFailed"]["request"] in waiting),
                    f"{len(waiting)} requests of step {step}",
                )
                if said is None:
                    break
                logger.debug("pdkv: %s: step %d: %s after %.1f ms", self._rank.name(), step, next(iter(said)), (time.monotonic() - began) * 1e3)
                if "Received" in said:
                    number = said["Received"]["request"]
                    _, local = meta.requests[number]
                    for layer in range(len(self._layers)):
                        _scatter(self._block_views[layer], local, self._rank.unstage(layer, local))
                else:
                    number = said["RecvFailed"]["request"]
                    req_id, local = meta.requests[number]
                    logger.error("pdkv: KV of %s cannot be received: %s", req_id, said["RecvFailed"]["error"])
                    self._errors.update(local)
                waiting.discard(number)
        except (RuntimeError, ValueError) as e:
            logger.error("pdkv: %s: step %d: %s", self._rank.name(), step, e)
        # What did not arrive is reported to vLLM as blocks that failed to load.
        for number in waiting:
            req_id, local = meta.requests[number]
            logger.error("pdkv: KV of %s did not arrive in %.0f s", req_id, self._wait_s)
            self._errors.update(local)
        self._inbox.forget_step(step, meta.requests)

    def _await(self, wanted, what: str) -> dict | None:
        """The first thing the rank says that `wanted` accepts, or None after the wait."""
        deadline = time.monotonic() + self._wait_s
        while True:
            said = self._inbox.take(wanted)
            if said is not None:
                return said
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("pdkv: %s gave no answer for %s in %.0f s", self._rank.name(), what, self._wait_s)
                return None
            self._inbox.add(self._collect(min(left, 1.0)))

    @staticmethod
    def _min_over_tp(ok: bool) -> bool:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return ok
        vote = torch.tensor([1 if ok else 0], dtype=torch.int32)
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
        return bool(vote.item())

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
