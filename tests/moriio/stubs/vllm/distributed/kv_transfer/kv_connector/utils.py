# Stands in for vllm/distributed/kv_transfer/kv_connector/utils.py (imports torch, the platform
# layer and the model executor). MoRIIO takes from it the BlockIds type (annotations) and
# clip_ssm_state_blocks (hybrid Mamba models' block clipping, which the harness never reaches).
from _pdkv_stub import module_getattr

BlockIds = tuple
__getattr__ = module_getattr("vllm.distributed.kv_transfer.kv_connector.utils")
