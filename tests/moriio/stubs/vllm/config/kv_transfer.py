# Stands in for vllm.config.kv_transfer (vLLM 0.34 imports KVCacheAccess from it, which needs
# pydantic and the rest of vllm.config). MoRIIO uses the name only in its connector class's
# kv_cache_access, which the harness never calls; every name here raises when used.
from _pdkv_stub import module_getattr

__getattr__ = module_getattr("vllm.config.kv_transfer")
