"""Streaming summaries for long runs: mean and percentiles in bounded memory.

``Quantiles`` keeps the values exactly up to ``exact`` of them (percentiles as numpy's linear
interpolation gives them), then folds them into a log-bucketed sketch: every value ``x > 0``
falls in bucket ``ceil(log(x) / log(gamma))`` with ``gamma = (1 + alpha) / (1 - alpha)``, so a
percentile read from the sketch is within a relative error ``alpha`` of the exact one (the
DDSketch bound); memory is one counter per bucket (a few thousand cover nanoseconds to hours).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

EXACT = 100_000
ALPHA = 0.005


class Quantiles:
    __slots__ = ("_exact_cap", "_values", "_buckets", "_zeros", "_count", "_sum", "_log_gamma",
                 "_gamma")

    def __init__(self, exact: int = EXACT, alpha: float = ALPHA) -> None:
        self._exact_cap = exact
        self._values: list[float] | None = []
        self._buckets: Counter[int] = Counter()
        self._zeros = 0
        self._count = 0
        self._sum = 0.0
        self._gamma = (1 + alpha) / (1 - alpha)
        self._log_gamma = math.log(self._gamma)

    @property
    def count(self) -> int:
        return self._count

    @property
    def exact(self) -> bool:
        return self._values is not None

    def add(self, x: float) -> None:
        self._count += 1
        self._sum += x
        values = self._values
        if values is not None:
            values.append(x)
            if len(values) > self._exact_cap:
                self._values = None
                for v in values:
                    self._bucket(v)
            return
        self._bucket(x)

    def _bucket(self, x: float) -> None:
        if x <= 0.0:
            self._zeros += 1
        else:
            self._buckets[math.ceil(math.log(x) / self._log_gamma)] += 1

    def percentile(self, q: float) -> float | None:
        if self._count == 0:
            return None
        if self._values is not None:
            return exact_percentiles(self._values)(q)
        rank = q / 100.0 * (self._count - 1)
        seen = self._zeros
        if rank < seen:
            return 0.0
        for k in sorted(self._buckets):
            seen += self._buckets[k]
            if seen > rank:
                return 2.0 * self._gamma**k / (self._gamma + 1.0)
        return 2.0 * self._gamma ** max(self._buckets) / (self._gamma + 1.0)

    def summary(self) -> dict[str, float | int | None]:
        mean = self._sum / self._count if self._count else None
        if self._values is not None and self._count:  # the array made once for every percentile
            return summarize(self._count, mean, exact_percentiles(self._values))
        return summarize(self._count, mean, self.percentile)


PERCENTILES = {"p50": 50, "p95": 95, "p99": 99}


def summarize(count: int, mean: float | None,
              percentile: Callable[[float], float | None]) -> dict[str, float | int | None]:
    """The one shape of a summary in results: mean, p50/p95/p99 (``percentile(q)``, q in
    0-100) and count; None figures when there is nothing to summarise."""
    if count == 0:
        return {"mean": None, **dict.fromkeys(PERCENTILES), "count": 0}
    out: dict[str, float | int | None] = {"mean": mean}
    for name, q in PERCENTILES.items():
        out[name] = percentile(q)
    out["count"] = count
    return out


def exact_percentiles(values: Sequence[float]) -> Callable[[float], float]:
    """``percentile(q)`` of ``values``, exact (numpy's linear interpolation), their array
    made once."""
    arr = np.asarray(values, dtype=float)
    return lambda q: float(np.percentile(arr, q))


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """The summary of a list of values (exact: numpy's linear interpolation)."""
    arr = np.asarray(values, dtype=float)
    return summarize(int(arr.size), float(arr.mean()) if arr.size else None,
                     exact_percentiles(arr))
