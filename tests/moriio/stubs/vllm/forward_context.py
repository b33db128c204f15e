# Stands in for vllm.forward_context (ForwardContext, an annotation in moriio_connector.py), which
# imports torch. The harness runs no forward pass; the placeholder raises if used.
from _pdkv_stub import module_getattr

__getattr__ = module_getattr("vllm.forward_context")
