"""A CPU stand-in for AMD's ``mori`` package, for running vLLM's MoRIIO connector without ROCm.

Only ``mori.io`` exists, and its data plane is not MoRI's RDMA: it is pdkv's TCP read protocol
(backend-rdma/src/tcp/mod.rs), so that a MoRIIO engine using this stub and a pdkv engine can move
KV to each other. ``EngineDesc.pack()`` is pdkv's data-plane descriptor
(core/src/wire/data_plane.rs) and ``MemoryDesc.pack()`` is pdkv's 16-byte layer descriptor.

Put ``tests/vllm/mori_stub`` on the MoRIIO side's ``PYTHONPATH`` only. See ``mori.io``.
"""

__all__ = ["io"]
