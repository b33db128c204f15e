"""What a router does for a pair of engines running pdkv's connector: mint the transfer id
each request's KV is known by on both legs (MoRIIO's routers mint ``tx-<uuid4 hex>`` too), and
hand decode the ``kv_transfer_params`` prefill answered with, unchanged."""

from __future__ import annotations

import uuid
from typing import Any

from pdkv_vllm_test.pd import ProxyHook


class PdkvHook(ProxyHook):
    def prefill_params(self, request_id: str) -> dict[str, Any] | None:
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": f"tx-{uuid.uuid4().hex}",
        }


def kv_transfer_config(
    role: str,
    deployment: str,
    port: int,
    notify_port: int | None = None,
    extra: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One side's `--kv-transfer-config` for pdkv's connector on loopback: handshake listeners
    from `port`, notify listeners from `notify_port` (by default `port + 100`), the deployment;
    `extra` adds keys to the extra config (timeouts, metrics), `top` to the config itself
    (vLLM's `kv_load_failure_policy`)."""
    return {
        "kv_connector": "PdkvConnector",
        "kv_connector_module_path": "pdkv.connector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "host_ip": "127.0.0.1",
            "handshake_port": port,
            "notify_port": port + 100 if notify_port is None else notify_port,
            "deployment": deployment,
            **(extra or {}),
        },
        **(top or {}),
    }


def pdkv_args(
    deployment: str,
    port: int,
    notify_port: int | None = None,
    extra: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
) -> list[str]:
    """The driver's arguments for a pair of engines with pdkv's connector, both sides configured
    by `kv_transfer_config`, and pdkv's router hook."""
    import json

    def config(role: str) -> str:
        return json.dumps(kv_transfer_config(role, deployment, port, notify_port, extra, top))

    return [
        "--kv-transfer-config-prefill", config("kv_producer"),
        "--kv-transfer-config-decode", config("kv_consumer"),
        "--proxy-hook", "pdkv_vllm_test.pdkv_hook:PdkvHook",
    ]
