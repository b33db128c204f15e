# Stands in for numpy (`import numpy as np` in moriio_connector.py). MoRIIO uses numpy only in
# MoRIIOConnectorWorker.merge_contiguous_blocks (coalescing RDMA block offsets), which none of
# the harness's code paths reach: the read release is exercised with no local blocks, which
# returns before any offset is computed. Every name raises when used (see _pdkv_stub.py), so a
# path that did reach numpy would fail, not change an answer.
from _pdkv_stub import module_getattr

__getattr__ = module_getattr("numpy")
