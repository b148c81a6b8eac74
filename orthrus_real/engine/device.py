"""Which device the engine runs on, and in which dtype.

bf16 (and fp16) run only where the device computes them fast: a CUDA GPU, or a CPU with bf16
instructions (AVX-512 BF16 or AMX). On a CPU without them (AVX2 only, as some of this project's
machines are) a bf16 matmul is ~60x slower than fp32, so a bf16 model is run in fp32 there, with
one log line; ``--dtype`` overrides.
"""

from __future__ import annotations

import logging

import torch

from orthrus_real.engine.model_files import DTYPES
from orthrus_sim.costmodel.machine import cpu_flags

log = logging.getLogger("orthrus")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16() -> bool:
    return any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)


def choose_device(requested: str | None) -> torch.device:
    """``requested`` (cpu, cuda, cuda:N), or CUDA when this torch and machine have it."""
    if requested in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {requested!r}") from None
    if device.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise ValueError(f"--device {requested}: this torch ({torch.__version__}) is a CPU-only "
                             "build; use --device cpu, or install a CUDA build of torch")
        if not torch.cuda.is_available():
            raise ValueError(f"--device {requested}: no CUDA device is visible to this process")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {requested}: only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible")
    elif device.type != "cpu":
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {requested!r}")
    return device


def choose_dtype(device: torch.device, requested: str | None, model_dtype: torch.dtype
                 ) -> tuple[torch.dtype, str]:
    """The dtype to run in, and why (for the startup log)."""
    if requested:
        if requested not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
        return DTYPES[requested], "as asked (--dtype)"
    if model_dtype == torch.float32:
        return model_dtype, "the model's"
    if device.type == "cuda":
        if model_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return torch.float16, "this GPU has no bf16: fp16 instead of the model's bf16"
        return model_dtype, "the model's"
    if model_dtype == torch.bfloat16 and cpu_has_bf16():
        return model_dtype, "the model's (this CPU has bf16 instructions)"
    name = str(model_dtype).removeprefix("torch.")
    reason = (f"the model is {name} but this CPU has no bf16 instructions "
              f"({' or '.join(BF16_CPU_FLAGS)}): fp32 runs far faster here; --dtype {name} forces it"
              if model_dtype == torch.bfloat16 else
              f"the model is {name}, which CPUs compute slowly: fp32 instead")
    log.info("dtype: float32 (%s)", reason)
    return torch.float32, reason


def engine_environment(engine, backend: str, threads: int | None = None) -> dict:
    """Where and how ``engine`` runs, as a calibration records it (``EnvironmentModel``).
    ``threads``: those the engine was given; torch's thread count is per thread (OpenMP), so
    this thread's count is only the fallback for an engine stepped here."""
    from orthrus_sim.costmodel.machine import this_machine

    device = getattr(engine, "device", None)
    gpu = None
    if device is not None and torch.device(device).type == "cuda":
        gpu = torch.cuda.get_device_name(torch.device(device))
    elif device is None and backend == "vllm" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    if backend == "vllm":
        import vllm

        version = f"vllm {vllm.__version__}"
    else:
        version = f"torch {torch.__version__}"
        gemm = getattr(engine, "gemm", None)
        if gemm is not None:  # which library ran the fp32 projections (cpu_gemm.py)
            version += f", fp32 projections {gemm.few}/{gemm.many}"
    return {**this_machine(gpu), "dtype": str(engine.cfg.dtype).removeprefix("torch."),
            "engine": backend, "engine_version": version,
            "threads": threads or torch.get_num_threads()}


def environment_check(calibration_path: str, model_dir: str | None = None,
                      device: str | None = None, threads: int | None = None,
                      colocated: int | None = None) -> str | None:
    """One line when the calibration was measured on another machine, in another dtype than a
    model in ``model_dir`` runs in here, with other engine ``threads`` than the engine it
    will predict, or beside another number of engines than ``colocated`` (those that will
    share this machine; ``orthrus_sim.costmodel.machine.environment_warning``)."""
    from pathlib import Path

    from orthrus_real.engine.model_files import read_config
    from orthrus_sim.costmodel import load_calibration
    from orthrus_sim.costmodel.machine import environment_warning, this_machine

    cal = load_calibration(calibration_path)
    dev = choose_device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    dtype = None
    if model_dir is not None:
        chosen, _ = choose_dtype(dev, None, read_config(model_dir).dtype)
        dtype = str(chosen).removeprefix("torch.")
    return environment_warning(cal.environment, this_machine(gpu), dtype,
                               Path(calibration_path).name, threads, colocated)


def parse_cpus(text: str | None, option: str = "--cpus") -> set[int] | None:
    """``0``, ``0,1`` or ``0-3`` -> CPU numbers this process may use (None: unset); an error
    names the option and the CPUs there are."""
    if not text:
        return None
    import os

    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected CPU numbers such as 0 or 0,1 or 0-3") from None
    allowed = set(range(os.cpu_count() or 1))  # a parent's own pinning does not bind its children
    if not cpus or not cpus <= allowed:
        raise ValueError(f"{option} {text!r}: this machine has CPUs {sorted(allowed)}")
    return cpus


def pin_process(cpus: set[int] | None) -> None:
    """Run this process (and the threads it starts from now on) on ``cpus`` only: the bench
    client and the engine apart, so neither takes the other's cores."""
    if cpus:
        import os

        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            raise ValueError(f"cannot run on CPUs {sorted(cpus)}: {exc}") from None


CPU_HEAP_BYTES = 1 << 30  # freed blocks up to this size stay in the heap for reuse
_heap_tuned: str | None = None


def keep_large_cpu_buffers() -> str:
    """Serve large tensors from glibc's heap instead of fresh ``mmap``s, so that a step's
    buffers are reused, not page-faulted in again every step. glibc maps every allocation
    above 32 MB on its own and unmaps it on free; a decode step of 64 streams at 256 tokens
    gathers 34 MB per layer, and the fresh mapping made that gather 4x slower (13.7 against
    3.4 ms; docs/engine.md). Raises the mmap and trim thresholds to 1 GiB once per process
    (``ORTHRUS_CPU_HEAP=0`` leaves glibc as it is). Returns what was done, for ``describe``."""
    global _heap_tuned
    if _heap_tuned is not None:
        return _heap_tuned
    import ctypes
    import ctypes.util
    import os

    if os.environ.get("ORTHRUS_CPU_HEAP", "1") == "0":
        _heap_tuned = "glibc defaults (ORTHRUS_CPU_HEAP=0)"
        return _heap_tuned
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _heap_tuned = "allocator defaults (no glibc mallopt here)"
        return _heap_tuned
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    ok = mallopt(m_mmap_threshold, CPU_HEAP_BYTES) == 1 and mallopt(m_trim_threshold,
                                                                   CPU_HEAP_BYTES) == 1
    _heap_tuned = (f"large buffers kept in the heap (glibc mmap/trim thresholds "
                   f"{CPU_HEAP_BYTES >> 20} MiB)" if ok else "glibc defaults (mallopt refused)")
    if not ok:
        log.info("CPU heap: glibc refused the larger mmap threshold; large tensors are mapped "
                 "afresh at every step")
    return _heap_tuned
