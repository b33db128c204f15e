# Stands in for vLLM's ssm_conv_transfer_utils (Mamba/KDA conv-state splitting; imports torch and
# the model executor). Only hybrid models with recurrent state use it; the harness's paths never
# do, and every name raises when used.
from _pdkv_stub import module_getattr

__getattr__ = module_getattr("vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils")
