# Stands in for vllm.v1.attention.selector, part of vLLM's v1 engine, which imports torch. MoRIIO takes class names
# from it for annotations, isinstance checks against KV cache specs, and the attention backend
# lookup of the worker's constructor; the harness builds no worker and no KV cache, and every
# name here raises when used (see _pdkv_stub.py).
from _pdkv_stub import module_getattr

__getattr__ = module_getattr("vllm.v1.attention.selector")
