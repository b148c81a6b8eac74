"""Efficiency coefficients: what calibration fits and the roofline applies."""

from __future__ import annotations

from dataclasses import dataclass, field

from orthrus_sim.costmodel.operators import ATTENTION_OPS, LINEAR_OPS, OPERATORS


@dataclass(frozen=True)
class OpCoeffs:
    """One operator's roofline parameters.

    Time = smooth_max(FLOPs / (peak * compute_eff), bytes / (bandwidth * memory_eff)) +
    overhead_s, where smooth_max(c, m) = (c^p + m^p)^(1/p) with p = ``sharpness``: the larger
    of the two, rounded off near the ridge point the way measured kernels are (p -> infinity
    is the strict roofline).
    """

    compute_eff: float = 0.7
    memory_eff: float = 0.85
    sharpness: float = 4.0
    overhead_s: float = 0.0

    def time(self, flops: float, bytes_: float, peak: float, bw: float) -> float:
        return _roofline(flops / (peak * self.compute_eff), bytes_ / (bw * self.memory_eff),
                         self.sharpness, self.overhead_s)

    def times(self, work: list[tuple[float, float]], peak: float, bw: float) -> list[float]:
        """``time`` of each (FLOPs, bytes) pair: the same floats, without a call per pair."""
        compute, memory = peak * self.compute_eff, bw * self.memory_eff
        p, overhead = self.sharpness, self.overhead_s
        root = 1.0 / p
        out = []
        append = out.append
        for f, b in work:  # _roofline, inlined: a decode run prices every step with it
            c, m = f / compute, b / memory
            if c <= 0.0 or m <= 0.0:
                append(_roofline(c, m, p, overhead))
                continue
            hi = c if c >= m else m
            append(hi * ((c / hi) ** p + (m / hi) ** p) ** root + overhead)
        return out


def _roofline(c: float, m: float, p: float, overhead: float) -> float:
    """smooth_max(compute seconds, memory seconds) + overhead (see ``OpCoeffs``)."""
    if c <= 0.0 or m <= 0.0:
        return max(c, m) + (overhead if (c or m) else 0.0)
    hi = max(c, m)
    return hi * ((c / hi) ** p + (m / hi) ** p) ** (1.0 / p) + overhead


def default_ops() -> dict[str, OpCoeffs]:
    """Uncalibrated roofline assumptions (documented in docs/costmodel.md)."""
    ops = {name: OpCoeffs() for name in OPERATORS}
    for name in LINEAR_OPS:
        ops[name] = OpCoeffs(compute_eff=0.7, memory_eff=0.85)
    for name in ATTENTION_OPS:
        ops[name] = OpCoeffs(compute_eff=0.5, memory_eff=0.7)
    # LoRA shrink/expand kernels (SGMV/BGMV) are small and launch-bound: low efficiency plus a
    # fixed cost per layer.
    ops["lora"] = OpCoeffs(compute_eff=0.3, memory_eff=0.5, overhead_s=5e-6)
    return ops


@dataclass(frozen=True)
class Coefficients:
    """Per-operator coefficients plus the CPU-side costs of an iteration.

    iteration_overhead_s: fixed per iteration (scheduling, input preparation, launch);
    per_seq_overhead_s: added per item in the batch (metadata, sampling bookkeeping).
    """

    ops: dict[str, OpCoeffs] = field(default_factory=default_ops)
    iteration_overhead_s: float = 2e-3
    per_seq_overhead_s: float = 10e-6
