# Stands in for PyTorch (`import torch`), which vLLM's MoRIIO modules import for tensor types,
# CUDA events and the TP group's vote. The harness runs only MoRIIO's routing, port, release and
# handshake code, which touches torch only in annotations (`torch.Tensor`, `torch.dtype`,
# `torch.cuda.Event`) evaluated at import. Every name here is a placeholder that raises when
# used (see _pdkv_stub.py), so a path that really needed torch fails instead of changing a result.
from _pdkv_stub import module_getattr

__getattr__ = module_getattr("torch")
