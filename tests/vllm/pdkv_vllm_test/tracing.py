"""Wrappers around vLLM's ExampleConnector for testing the harness itself.

`TracingExampleConnector` records which process calls which hook of `KVConnectorBase_V1`, in
what order, with what request ids, as JSON lines. It changes no behaviour; it exists to show
how vLLM 0.34 drives a connector. `LeakingExampleConnector` (at the end) breaks the block
contract on purpose. Load it with `kv_connector_module_path: "pdkv_vllm_test.tracing"`,
`kv_connector: "TracingExampleConnector"`, and `kv_connector_extra_config.trace_path`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

# Hooks called every layer or every step with nothing to say are counted, not written.
QUIET = {"has_connector_metadata", "_get_connector_metadata"}


def brief(x: Any, depth: int = 0) -> Any:
    """A short JSON-able description of a hook argument or result."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return f"tensor{list(x.shape)}:{str(x.dtype).removeprefix('torch.')}"
    if hasattr(x, "request_id") and hasattr(x, "num_computed_tokens"):
        return f"Request({x.request_id}, computed={x.num_computed_tokens})"
    name = type(x).__name__
    if name == "SchedulerOutput":
        return {
            "new": [r.req_id for r in x.scheduled_new_reqs],
            "cached": list(x.scheduled_cached_reqs.req_ids),
            "finished": sorted(x.finished_req_ids),
            "tokens": x.total_num_scheduled_tokens,
        }
    if name == "KVConnectorOutput":
        return {
            "finished_sending": sorted(x.finished_sending or ()),
            "finished_recving": sorted(x.finished_recving or ()),
        }
    if name == "KVCacheBlocks":
        return f"KVCacheBlocks({[len(g) for g in x.get_block_ids()]} blocks)"
    if depth < 2 and isinstance(x, (list, tuple, set, frozenset)):
        items = sorted(x, key=str) if isinstance(x, (set, frozenset)) else list(x)
        return [brief(i, depth + 1) for i in items[:8]] + (["..."] if len(items) > 8 else [])
    if depth < 2 and isinstance(x, dict):
        return {str(k): brief(v, depth + 1) for k, v in list(x.items())[:8]}
    return name


def _hook_names() -> list[str]:
    return sorted(
        n
        for n, v in vars(KVConnectorBase_V1).items()
        if callable(v) and not n.startswith("__") and n not in QUIET
    )


class TracingExampleConnector(ExampleConnector):
    """ExampleConnector with every base-class hook logged to `trace_path`."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._trace_path = extra.get("trace_path")
        self._trace_side = extra.get("trace_side", "?")
        self._trace_role = getattr(role, "name", str(role))
        super().__init__(vllm_config, role, kv_cache_config)

    def _trace(self, method: str, args: tuple, kwargs: dict, result: Any) -> None:
        if not self._trace_path:
            return
        record = {
            "pid": os.getpid(),
            "side": self._trace_side,
            "role": self._trace_role,
            "method": method,
            "args": [brief(a) for a in args],
            "kwargs": {k: brief(v) for k, v in kwargs.items()},
            "result": brief(result),
        }
        # One short write per line on an O_APPEND file: lines from the scheduler process
        # and every worker interleave whole.
        with open(self._trace_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _wrap(name: str):
    def method(self: TracingExampleConnector, *args: Any, **kwargs: Any) -> Any:
        result = getattr(super(TracingExampleConnector, self), name)(*args, **kwargs)
        self._trace(name, args, kwargs, result)
        return result

    functools.update_wrapper(method, getattr(KVConnectorBase_V1, name))
    return method


for _name in _hook_names():
    if isinstance(vars(KVConnectorBase_V1)[_name], (staticmethod, classmethod)):
        continue
    setattr(TracingExampleConnector, _name, _wrap(_name))


class LeakingExampleConnector(ExampleConnector):
    """A deliberately broken connector, to show the block check is not vacuous: the scheduler
    side asks vLLM to hold the blocks of the first finished request (`request_finished` returns
    True, the contract for "I am still sending") and no worker ever reports it in
    `finished_sending`, so those blocks never go back to the pool."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._leaked: str | None = None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        if self._leaked is None:
            self._leaked = request.request_id
            return True, None
        return super().request_finished(request, block_ids)
