# Stands in for vllm.distributed.parallel_state, which needs torch.distributed and a process
# group. MoRIIO asks it for this worker's TP rank and TP world size (and, in code the harness
# does not run, the TP and world groups). The harness sets the rank and size it asks for with
# set_tp(rank, size) before calling MoRIIOConfig.from_vllm_config, exactly as vLLM's worker
# would report them; the group getters raise.
from _pdkv_stub import StubUsed

_tp_rank = 0
_tp_size = 1


def set_tp(rank, size):
    global _tp_rank, _tp_size
    _tp_rank, _tp_size = rank, size


def get_tensor_model_parallel_rank():
    return _tp_rank


def get_tensor_model_parallel_world_size():
    return _tp_size


def get_tp_group():
    raise StubUsed("get_tp_group is a pdkv stub: no TP process group in the harness")


def get_world_group():
    raise StubUsed("get_world_group is a pdkv stub: no process group in the harness")
