"""Which library multiplies the engine's fp32 projections on a CPU: MKL or oneDNN.

PyTorch sends an fp32 ``F.linear`` on a CPU to MKL. On this project's AVX2-only AMD EPYC
machines oneDNN (``torch.ops.mkldnn._linear_pointwise``, the library vLLM's CPU backend runs its
linear layers with) is faster for every projection of the `small` model: 1.1-1.2x at 2048 rows
(an embedding chunk) and 1.3-2.3x at 64 rows (a decode step, the LM head most), measured in one
run (docs/engine.md). Whether that holds on another CPU (AVX-512, Intel) was not measured here,
so the default (``auto``) measures both libraries once per process on a projection of the
model's size, for few rows and for many, and takes oneDNN only where it is at least
``MARGIN`` faster; ``mkl`` or ``onednn`` (``--cpu-gemm``, ``ORTHRUS_CPU_GEMM``) fix the
choice. bf16 and CUDA are left to ``F.linear`` (PyTorch already runs a CPU bf16 matmul through
oneDNN).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("orthrus")
CPU_GEMMS = ("auto", "mkl", "onednn")
NARROW_ROWS = 256  # up to this many rows a step is "few rows" (decodes); above, a chunk
SPLIT_COLS = 1024  # MKL with few rows: a wide weight multiplied in blocks of this many outputs
MARGIN = 1.05  # oneDNN must be this much faster than MKL to be taken (else: PyTorch's own path)
PROBE_ROWS = (64, 512)  # few rows (a decode step), many (a chunk)
PROBE_REPEATS = 5


def mkl_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (MKL); with few rows and a wide weight (the fused gate/up projection, the
    LM head), one matmul per block of 1024 output columns: MKL's fp32 GEMM at 64 rows took 12.3
    ms for the 4096-wide gate/up of the `small` model on an AVX2 CPU against 2 x 2.9 ms for its
    halves, and 76 against 49 ms for the 32000-wide LM head."""
    if x.shape[0] > NARROW_ROWS or w.shape[0] < 2 * SPLIT_COLS:
        return F.linear(x, w, b)
    out = torch.cat([F.linear(x, part) for part in w.split(SPLIT_COLS)], -1)
    return out if b is None else out + b


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` by oneDNN's fp32 inner product (plain weights: nothing re-laid out)."""
    if x.shape[0] == 0:
        return F.linear(x, w, b)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


LIBRARIES: dict[str, Callable] = {"mkl": mkl_linear, "onednn": onednn_linear}


@dataclass(frozen=True)
class CpuGemm:
    """The library for few-row steps (decodes) and for many-row steps (chunks), and why."""

    few: str
    many: str
    why: str

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.is_cuda:
            return F.linear(x, w, b)
        return LIBRARIES[self.few if x.shape[0] <= NARROW_ROWS else self.many](x, w, b)

    def describe(self) -> str:
        return f"fp32 projections: {self.few} for <= {NARROW_ROWS} rows, {self.many} above ({self.why})"


PLAIN = CpuGemm("mkl", "mkl", "MKL, as PyTorch runs fp32")  # bf16 and CUDA: F.linear throughout
_probed: dict[tuple, tuple[str, str, str]] = {}


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def check_setting(setting: str | None, name: str = "--cpu-gemm") -> None:
    if setting is not None and setting not in CPU_GEMMS:
        raise ValueError(f"{name} must be one of {', '.join(CPU_GEMMS)}, got {setting!r}")


def choose_cpu_gemm(setting: str | None, hidden: int, width: int) -> CpuGemm:
    """``setting`` (auto, mkl, onednn; default: ``ORTHRUS_CPU_GEMM`` or auto) for an fp32
    engine on a CPU whose widest projection maps ``hidden`` inputs to ``width`` outputs."""
    check_setting(setting)
    if not setting:
        setting = os.environ.get("ORTHRUS_CPU_GEMM") or "auto"
        check_setting(setting, "ORTHRUS_CPU_GEMM")
    if setting != "auto":
        if setting == "onednn" and not onednn_available():
            raise ValueError("--cpu-gemm onednn: this torch build has no oneDNN (mkldnn)")
        return CpuGemm(setting, setting, "as asked")
    if not onednn_available():
        return CpuGemm("mkl", "mkl", "this torch has no oneDNN")
    # the probe's shape: the model's, kept within sizes where the timing means something
    # (a tiny test model's microsecond GEMMs would be noise) and that take well under a second
    k, n = min(max(hidden, 512), 4096), min(max(width, 2048), 4096)
    key = (k, n, torch.get_num_threads())
    if key not in _probed:
        _probed[key] = probe(k, n)
        log.info("CPU fp32 GEMM: %s", _probed[key][2])
    few, many, why = _probed[key]
    return CpuGemm(few, many, why)


def probe(k: int, n: int) -> tuple[str, str, str]:
    """Time MKL and oneDNN on a (rows, k) x (k, n) projection for few rows and for many,
    alternated, median of ``PROBE_REPEATS``; oneDNN where it is ``MARGIN`` faster."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    picks, notes = [], []
    for rows in PROBE_ROWS:
        x = torch.randn(rows, k, generator=gen)
        times: dict[str, list[float]] = {name: [] for name in LIBRARIES}
        for fn in LIBRARIES.values():
            fn(x, w)  # warm-up: first calls allocate and JIT
        for _ in range(PROBE_REPEATS):
            for name, fn in LIBRARIES.items():
                start = time.perf_counter()
                fn(x, w)
                times[name].append(time.perf_counter() - start)
        mkl, onednn = (statistics.median(times[name]) for name in ("mkl", "onednn"))
        picks.append("onednn" if mkl >= MARGIN * onednn else "mkl")
        notes.append(f"{rows}x{k}x{n}: mkl {mkl * 1e3:.2f} ms, onednn {onednn * 1e3:.2f} ms")
    return picks[0], picks[1], "measured: " + "; ".join(notes)
