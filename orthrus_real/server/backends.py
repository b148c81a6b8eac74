"""The executors ``serve``, ``calibrate`` and ``validate`` can run: ``torch`` (the PyTorch
reference engine, everywhere) and ``vllm`` (the vLLM plug-in; vLLM installed)."""

from __future__ import annotations

BACKENDS = ("torch", "vllm")


def make_engine(backend: str, model: str, adapter: str | None = None, policy: str = "ibs",
                scheduler=None, kv_cache_tokens: int = 32768, device: str | None = None,
                dtype: str | None = None, threads: int = 0,
                gpu_memory_utilization: float | None = None, calibration: str | None = None,
                engine_options: dict | None = None):
    """Build the engine; call it in the thread that will step it. ``engine_options`` (the
    PyTorch engine's ``attention``, ``cuda_graphs``, ``static_step``, ``cpu_gemm``): None leaves its
    defaults."""
    options = {k: v for k, v in (engine_options or {}).items() if v is not None}
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    if backend == "vllm":
        if options:
            raise ValueError(f"--{next(iter(options)).replace('_', '-')} applies to --backend "
                             "torch only (vLLM runs its own attention and graphs)")
        if device not in (None, "auto"):
            raise ValueError("--device does not apply to --backend vllm (vLLM picks its platform)")
        from orthrus_real.vllm_backend.engine import VllmEngine

        return VllmEngine(model, adapter_dir=adapter, policy=policy, scheduler=scheduler,
                          dtype=dtype, kv_cache_tokens=kv_cache_tokens,
                          gpu_memory_utilization=gpu_memory_utilization, calibration=calibration)
    if gpu_memory_utilization is not None:
        raise ValueError("gpu_memory_utilization applies to --backend vllm only")
    from orthrus_real.engine.torch_engine import Engine

    return Engine(model, adapter_dir=adapter, policy=policy, scheduler=scheduler, device=device,
                  dtype=dtype, kv_cache_tokens=kv_cache_tokens, calibration=calibration, **options)
