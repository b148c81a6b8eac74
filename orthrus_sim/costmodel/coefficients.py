"""Efficiency coefficients: what calibration fits and the roofline applies."""

from __future__ import annotations

from dataclasses import dataclass, field

from orthrus_sim.costmodel.operators import ATTENTION_OPS, LINEAR_OPS, OPERATORS


@dataclass(frozen=True)
class OpCoeffs:
    """One operator's roofline parameters.

    Time = smooth_max(FLOPs / (peak * compute_eff), bytes / (bandwidth * memory_eff), floor_s)
    + overhead_s, where smooth_max(a, ...) = (a^p + ...)^(1/p) with p = ``sharpness``: the
    largest of the terms, rounded off near the ridge the way measured kernels are (p -> infinity
    is the strict roofline). ``floor_s`` is the kernel's shortest time whatever its work (one
    wave of thread blocks, launch-bound: an element-wise kernel's time is flat over small token
    counts, then grows). ``cache_gain`` multiplies the bandwidth while the operator's bytes fit
    the device's last-level cache (``cache_bytes``, the spec sheet's L2): a microbenchmark that
    repeats one kernel finds its small working sets there. Both are neutral by default (0 and 1).
    """

    compute_eff: float = 0.7
    memory_eff: float = 0.85
    sharpness: float = 4.0
    overhead_s: float = 0.0
    floor_s: float = 0.0
    cache_gain: float = 1.0

    def time(self, flops: float, bytes_: float, peak: float, bw: float,
             cache_bytes: float = 0.0) -> float:
        c, m = flops / (peak * self.compute_eff), bytes_ / (bw * self.memory_eff)
        if self.cache_gain != 1.0 and cache_bytes > 0.0 and bytes_ > 0.0:
            m *= 1.0 - cached_share(bytes_, cache_bytes) * (1.0 - 1.0 / self.cache_gain)
        if self.floor_s > 0.0:
            return _roofline3(c, m, self.floor_s, self.sharpness, self.overhead_s)
        return _roofline(c, m, self.sharpness, self.overhead_s)

    def times(self, work: list[tuple[float, float]], peak: float, bw: float,
              cache_bytes: float = 0.0) -> list[float]:
        """``time`` of each (FLOPs, bytes) pair: the same floats, without a call per pair."""
        if self.floor_s > 0.0 or (self.cache_gain != 1.0 and cache_bytes > 0.0):
            return [self.time(f, b, peak, bw, cache_bytes) for f, b in work]
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


CACHE_EDGE = 8.0  # how sharply a working set stops fitting the cache: a logistic in log bytes


def cached_share(bytes_: float, cache_bytes: float) -> float:
    """The share of an operator's traffic served from the cache: 1 well inside it, 0 well past
    it, a half at its size."""
    return 1.0 / (1.0 + (bytes_ / cache_bytes) ** CACHE_EDGE)


def _roofline(c: float, m: float, p: float, overhead: float) -> float:
    """smooth_max(compute seconds, memory seconds) + overhead (see ``OpCoeffs``)."""
    if c <= 0.0 or m <= 0.0:
        return max(c, m) + (overhead if (c or m) else 0.0)
    hi = max(c, m)
    return hi * ((c / hi) ** p + (m / hi) ** p) ** (1.0 / p) + overhead


def _roofline3(c: float, m: float, floor: float, p: float, overhead: float) -> float:
    """smooth_max(compute, memory, floor) + overhead, for an operator with a shortest time."""
    if c <= 0.0 and m <= 0.0:
        return 0.0
    hi = max(c, m, floor)
    return hi * ((c / hi) ** p + (m / hi) ** p + (floor / hi) ** p) ** (1.0 / p) + overhead


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
