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


def mkl_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               split: bool = True) -> torch.Tensor:
    """``F.linear`` (MKL); where ``split`` (the fused QKV and gate/up projections, the LM head),
    with few rows and a wide weight, one matmul per block of 1024 output columns: MKL's fp32
    GEMM at 64 rows took 12.3 ms for the 4096-wide gate/up of the `small` model on an AVX2 CPU
    against 2 x 2.9 ms for its halves, and 76 against 49 ms for the 32000-wide LM head."""
    if not split or x.shape[0] > NARROW_ROWS or w.shape[0] < 2 * SPLIT_COLS:
        return F.linear(x, w, b)
    out = torch.cat([F.linear(x, part) for part in w.split(SPLIT_COLS)], -1)
    return out if b is None else out + b


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                  split: bool = True) -> torch.Tensor:
    """``x @ w.T + b`` by oneDNN's fp32 inner product (plain weights: nothing re-laid out).
    Never split: column blocks made oneDNN slower at every row count (docs/engine.md)."""
    if x.shape[0] == 0:
        return F.linear(x, w, b)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


Linear = Callable[..., torch.Tensor]  # (x, w, b=None, split=True) -> x @ w.T + b
LIBRARIES: dict[str, Linear] = {"mkl": mkl_linear, "onednn": onednn_linear}


@dataclass(frozen=True)
class CpuGemm:
    """The library for few-row steps (decodes) and for many-row steps (chunks), and why."""

    few: str
    many: str
    why: str

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               split: bool = True) -> torch.Tensor:
        """``x @ w.T + b`` by the library chosen for ``x``'s row count; bf16 and CUDA by
        ``F.linear``. ``split``: MKL may split a wide weight (the projections it was measured
        on: fused QKV, gate/up, LM head; not O and down)."""
        if x.dtype != torch.float32 or x.is_cuda:
            return F.linear(x, w, b)
        return LIBRARIES[self.few if x.shape[0] <= NARROW_ROWS else self.many](x, w, b, split)

    def describe(self) -> str:
        return f"fp32 projections: {self.few} for <= {NARROW_ROWS} rows, {self.many} above ({self.why})"


# the engine before this choice: MKL, wide weights split for few rows; bf16 and CUDA: F.linear
PLAIN = CpuGemm("mkl", "mkl", "the engine's MKL path")
_probed: dict[tuple, CpuGemm] = {}


def onednn_available() -> bool:
    """This torch build has oneDNN and its fp32 inner product op (every x86 wheel does)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def check_setting(setting: str | None, name: str = "--cpu-gemm") -> None:
    """A clear error naming ``name`` for a setting that is none of ``CPU_GEMMS``."""
    if setting is not None and setting not in CPU_GEMMS:
        raise ValueError(f"{name} must be one of {', '.join(CPU_GEMMS)}, got {setting!r}")


def resolve_setting(option: str | None) -> str:
    """The setting asked for: ``option`` (``--cpu-gemm``), else ``ORTHRUS_CPU_GEMM``, else
    auto; whichever is given is checked, and an error names it."""
    check_setting(option)
    if option:
        return option
    setting = os.environ.get("ORTHRUS_CPU_GEMM") or "auto"
    check_setting(setting, "ORTHRUS_CPU_GEMM")
    return setting


def choose_cpu_gemm(setting: str, hidden: int, width: int) -> CpuGemm:
    """``setting`` (auto, mkl, onednn: ``resolve_setting``'s) for an fp32 engine on a CPU whose
    gate/up projection maps ``hidden`` inputs to ``width`` outputs. Each process measures for
    itself (on its own CPUs and threads); replicas or a calibration that must agree with a
    server are given the same ``--cpu-gemm`` or ``ORTHRUS_CPU_GEMM``."""
    if setting != "auto":
        if setting == "onednn" and not onednn_available():
            raise ValueError("--cpu-gemm onednn: this torch build has no oneDNN (mkldnn)")
        return CpuGemm(setting, setting, "as asked")
    if not onednn_available():
        return CpuGemm("mkl", "mkl", "this torch has no oneDNN")
    # the probe's shape: the model's, kept within sizes where the timing means something (a
    # tiny test model's microsecond GEMMs would be noise) and short (at the 4096 x 4096 cap
    # about 2 s on a 2-core AVX2 CPU, once per process; the `small` model's ~0.3 s)
    k, n = min(max(hidden, 512), 4096), min(max(width, 2048), 4096)
    key = (k, n, torch.get_num_threads())
    if key not in _probed:
        _probed[key] = CpuGemm(*probe(k, n))
        log.info("CPU fp32 GEMM: %s", _probed[key].why)
    return _probed[key]


def probe(k: int, n: int, clock: Callable[[], float] = time.perf_counter) -> tuple[str, str, str]:
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
                start = clock()
                fn(x, w)
                times[name].append(clock() - start)
        mkl, onednn = (statistics.median(times[name]) for name in ("mkl", "onednn"))
        picks.append("onednn" if mkl >= MARGIN * onednn else "mkl")  # a tie: PyTorch's library
        notes.append(f"{rows}x{k}x{n}: mkl {mkl * 1e3:.2f} ms, onednn {onednn * 1e3:.2f} ms")
    return picks[0], picks[1], "measured: " + "; ".join(notes)
