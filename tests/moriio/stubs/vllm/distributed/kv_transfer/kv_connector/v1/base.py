# Stands in for vLLM's KV connector base module (v1/base.py, imports torch and the v1 engine).
# MoRIIO's classes derive from KVConnectorBase_V1, SupportsHMA and KVConnectorMetadata; the
# harness calls MoRIIOConnectorWorker's methods on plain objects and builds no connector, so the
# bases only have to exist. Nothing the harness runs calls a base-class method.
from _pdkv_stub import module_getattr


class KVConnectorBase_V1:
    pass


class SupportsHMA:
    pass


class KVConnectorMetadata:
    pass


__getattr__ = module_getattr("vllm.distributed.kv_transfer.kv_connector.v1.base")
