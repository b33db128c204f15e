# Stands in for vllm.config (KVTransferConfig, VllmConfig), which imports torch and most of
# vLLM. MoRIIO names these classes in annotations only; the one function of it the harness runs,
# MoRIIOConfig.from_vllm_config, reads a config object's attributes, and the harness hands it a
# plain object with exactly those attributes (kv_transfer_config.kv_connector_extra_config and
# parallel_config's DP rank and sizes).
from _pdkv_stub import module_getattr, placeholder

KVTransferConfig = placeholder("vllm.config.KVTransferConfig")
VllmConfig = placeholder("vllm.config.VllmConfig")
__getattr__ = module_getattr("vllm.config")
