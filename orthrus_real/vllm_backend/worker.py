"""Worker classes (vLLM's ``worker_cls``) that put ``PoolingRowsMixin`` into the model runner
the stock worker builds, on CPU and on GPU alike; on CPU also the segment LoRA ops
(``lora_cpu``)."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from orthrus_real.vllm_backend.runner import PoolingRowsMixin

_MIXED: dict[type, type] = {}


def install(runner) -> None:
    """Give ``runner`` the mixin by subclassing its class in place (its state is kept)."""
    cls = type(runner)
    if not issubclass(cls, PoolingRowsMixin):
        if cls not in _MIXED:
            _MIXED[cls] = type(f"Orthrus{cls.__name__}", (PoolingRowsMixin, cls), {})
        runner.__class__ = _MIXED[cls]
    runner._orthrus_init()


class OrthrusCPUWorker(CPUWorker):
    def init_device(self) -> None:
        from orthrus_real.vllm_backend import lora_cpu

        super().init_device()
        install(self.model_runner)
        lora_cpu.install()  # segment LoRA ops instead of per-token weight gathers


class OrthrusGPUWorker(Worker):
    def init_device(self) -> None:
        super().init_device()
        install(self.model_runner)


def worker_class() -> str:
    from vllm.platforms import current_platform

    name = "OrthrusCPUWorker" if current_platform.is_cpu() else "OrthrusGPUWorker"
    return f"{__name__}.{name}"
