"""A CPU platform for tests: lets vLLM 0.34 build its config, engine core and workers on a host
without a GPU, using gloo for every process group and the stand-in worker from worker.py.

vLLM finds it through the `vllm.platform_plugins` entry point declared in the
`pdkv_vllm_test-0.0.0.dist-info` folder next to this package, so putting `tests/vllm` on
PYTHONPATH is all it takes. vLLM's own CpuPlatform is not used: it needs the CPU build of vLLM
(`torch.ops._C` CPU kernels, triton-cpu), which the CUDA wheel does not contain.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

import torch
from vllm.platforms.interface import Platform, PlatformEnum

WORKER_CLS = "pdkv_vllm_test.worker.StandInWorker"


def register() -> str | None:
    """Entry point called by vLLM in every process when it resolves its platform.

    PDKV_VLLM_TEST_PLATFORM=0 switches the plugin off, so the dist-info folder can stay on
    PYTHONPATH for a process that wants vLLM's own detection.
    """
    if os.environ.get("PDKV_VLLM_TEST_PLATFORM", "1") == "0":
        return None
    _shorten_shm_spin()
    return "pdkv_vllm_test.platform.PdkvTestCpuPlatform"


# How long a reader of vLLM's shared-memory message queues spins (sched_yield in a loop) after
# each message before it parks on the queue's notify socket; vLLM spins for 1 s.
SHM_SPIN_S = float(os.environ.get("PDKV_VLLM_TEST_SHM_SPIN_S", "0.002"))


def _shorten_shm_spin() -> None:
    """Shortens vLLM's busy-wait on its shared-memory queues to `SHM_SPIN_S`.

    vLLM's queue readers (every worker, on the engine core's broadcasts; the engine core, on
    the workers' answers) spin for a second after each message, which costs nothing on a GPU
    host with a core per process. A P/D pair with TP 2 is eight such processes on CI's two
    cores: under load the spinning workers took both CPUs (perf: their time is sched_yield and
    the loop around it) and every other process of the deployment, the kernel's own workers
    included ("workqueue lockup ... stuck for 31s"), waited 30 to 60 s at a time. That is
    longer than the connector's timeouts, so requests failed for the host's sake, not the
    protocol's. Nothing of the connector's path changes: a reader that stops spinning waits on
    the notify socket vLLM already has for exactly that.
    """
    name = "vllm.distributed.device_communicators.shm_broadcast"
    if name in sys.modules:
        _patch_spin(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        # Importing the module here would be circular (register() runs while vllm.distributed
        # is half imported), so the patch waits for vLLM's own import of it.
        sys.meta_path.insert(0, _AfterImport(name, _patch_spin))


def _patch_spin(module) -> None:
    cls = module.SpinCondition
    if getattr(cls, "_pdkv_spin_s", None) is not None:
        return
    original = cls.__init__

    def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1):
        original(self, is_reader, context, notify_address, min(busy_loop_s, SHM_SPIN_S))

    cls.__init__ = __init__
    cls._pdkv_spin_s = SHM_SPIN_S


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once the module `name` has been imported, by whoever imports it."""

    def __init__(self, name: str, then):
        self._name, self._then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self._then

        def exec_then(module):
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then
        return spec


class PdkvTestCpuPlatform(Platform):
    """An out-of-tree platform whose device is the host CPU and whose collectives use gloo."""

    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    simple_compile_backend: str = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        """The backend whose declarations (KV cache layouts, shape) the stand-in layers take.

        It is never run. FLASH_ATTN, what a CUDA deployment selects, is the default;
        PDKV_VLLM_TEST_ATTN_BACKEND names another member of vLLM's AttentionBackendEnum.
        """
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        name = os.environ.get("PDKV_VLLM_TEST_ATTN_BACKEND", "FLASH_ATTN")
        return AttentionBackendEnum[name].get_path()

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "pdkv-test-cpu"

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return f"pdkv-test-cpu-{device_id}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return 0.0

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        return None

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def uses_standalone_cpu_model_runner(cls) -> bool:
        # vLLM's Worker refuses to start without Triton unless the platform runs the
        # "standalone" CPU model runner; the stand-in runner needs neither Triton nor CUDA.
        return True

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("LoRA is not supported by the pdkv test platform")

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode
        from vllm.config.compilation import CUDAGraphMode

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_CLS
        parallel_config.disable_custom_all_reduce = True

        # Nothing is compiled and no graph is captured: the stand-in forward is plain torch.
        compilation_config = vllm_config.compilation_config
        compilation_config.mode = CompilationMode.NONE
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        compilation_config.cudagraph_capture_sizes = []

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        # The base communicator runs every collective through torch.distributed on the
        # group's own backend, here gloo.
        return (
            "vllm.distributed.device_communicators.base_device_communicator."
            "DeviceCommunicatorBase"
        )

    def get_global_graph_pool(self):
        return None

    @classmethod
    def stateless_init_device_torch_dist_pg(cls, *args, **kwargs):
        raise NotImplementedError("stateless process groups are not used by the harness")

    def __repr__(self) -> str:
        return "PdkvTestCpuPlatform()"

