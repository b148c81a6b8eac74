"""When an open-loop pool's requests arrive: Poisson, gamma, and the two bursty processes.

``mmpp``: a Markov-modulated Poisson process with two states, on (``rate`` arrivals per second)
and off (``off_rate``), each lasting an exponential time of mean ``on_s`` / ``off_s``. Pools
naming the same ``correlate`` group share one on/off sequence (drawn from the seed and the
group's name: both kinds burst together); a pool without one has its own (the kinds burst
independently). ``diurnal``: a Poisson process whose rate follows a curve of period
``period_s`` with mean ``rate``: a sine of relative ``amplitude`` shifted by ``phase_s``, or a
piecewise-constant ``profile`` (levels over equal slices of the period, scaled to mean 1),
drawn by thinning. Every process is seeded: the same seed, the same arrivals.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np


def mean_rate(pool: Any) -> float:
    """The long-run arrivals per second of an open-loop or trace pool (before
    ``rate_scale``)."""
    if pool.process == "mmpp":
        return (pool.rate * pool.on_s + pool.off_rate * pool.off_s) / (pool.on_s + pool.off_s)
    if pool.process == "trace":
        return pool.replay().rate
    return pool.rate


def kind_rates(pool: Any, generation_share: float) -> dict[str, float]:
    """A pool's long-run arrivals per second by kind (before ``rate_scale``): a mixed trace's
    by its rows' own kinds in the window (its replay sends each row's), a mixed synthetic
    pool's by its generation share (the workload's where the pool gives none)."""
    rate = mean_rate(pool)
    if pool.kind != "mixed":
        return {pool.kind: rate}
    if pool.process == "trace":
        rows = pool.replay().rows
        share = sum(r["kind"] == "generation" for r in rows) / len(rows) if rows else 0.0
    else:
        share = generation_share if pool.generation_share is None else pool.generation_share
    return {"generation": rate * share, "embedding": rate * (1 - share)}


class Modulation:
    """An on/off sequence: exponential sojourns from a generator of its own, the first state
    drawn from the stationary split (on with probability ``on_s / (on_s + off_s)``)."""

    def __init__(self, on_s: float, off_s: float, rng: np.random.Generator) -> None:
        self.on_s, self.off_s, self.rng = on_s, off_s, rng
        self.on = bool(rng.random() < on_s / (on_s + off_s))
        self.until = self._sojourn()

    def _sojourn(self) -> float:
        return float(self.rng.exponential(self.on_s if self.on else self.off_s))

    def advance(self) -> None:
        """Into the next state."""
        self.on = not self.on
        self.until += self._sojourn()


def _mmpp(pool: Any, rng: np.random.Generator, modulation: Modulation, start: float,
          scale: float) -> Iterator[float]:
    t = start
    while modulation.until <= t:
        modulation.advance()
    while True:
        rate = (pool.rate if modulation.on else pool.off_rate) * scale
        gap = float(rng.exponential(1.0 / rate)) if rate > 0 else math.inf
        if t + gap < modulation.until:
            t += gap
            yield t
        else:  # memoryless: the state ends first; draw again from its end
            t = modulation.until
            modulation.advance()


def diurnal_level(pool: Any, t: float) -> float:
    """The diurnal curve at ``t``, relative to its mean (mean 1 over a period)."""
    x = ((t - pool.phase_s) / pool.period_s) % 1.0
    if pool.profile:
        levels = pool.profile
        return levels[min(int(x * len(levels)), len(levels) - 1)] * len(levels) / sum(levels)
    return 1.0 + pool.amplitude * math.sin(2 * math.pi * x)


def _diurnal(pool: Any, rng: np.random.Generator, start: float, scale: float) -> Iterator[float]:
    if pool.profile:
        peak = max(pool.profile) * len(pool.profile) / sum(pool.profile)
    else:
        peak = 1.0 + pool.amplitude
    top = pool.rate * scale * peak
    t = start
    while True:
        t += float(rng.exponential(1.0 / top))
        if rng.random() * peak < diurnal_level(pool, t):
            yield t


def arrival_times(pool: Any, rng: np.random.Generator, start: float = 0.0,
                  scale: float = 1.0, modulation: Modulation | None = None) -> Iterator[float]:
    """The pool's arrival times after ``start``, at its rates times ``scale``; ``mmpp`` takes
    its on/off sequence (shared by a correlated group) as ``modulation``."""
    if pool.process == "mmpp":
        yield from _mmpp(pool, rng, modulation, start, scale)
        return
    if pool.process == "diurnal":
        yield from _diurnal(pool, rng, start, scale)
        return
    rate = pool.rate * scale
    shape = 1.0 / pool.cv**2
    t = start
    while True:
        if pool.process == "poisson":
            t += float(rng.exponential(1.0 / rate))
        else:
            t += float(rng.gamma(shape, 1.0 / (rate * shape)))
        yield t
