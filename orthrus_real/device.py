"""Which device the engine runs on, and in which dtype.

bf16 (and fp16) run only where the device computes them fast: a CUDA GPU, or a CPU with bf16
instructions (AVX-512 BF16 or AMX). On a CPU without them (AVX2 only, as some of this project's
machines are) a bf16 matmul is ~60x slower than fp32, so a bf16 model is run in fp32 there, with
one log line; ``--dtype`` overrides.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from orthrus_real.model_files import DTYPES

log = logging.getLogger("orthrus")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


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
