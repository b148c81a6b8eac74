"""Token-length distributions a scenario can name (``dist: fixed | uniform | normal | ...``)."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from orthrus_sim import resolve_path


class _Dist(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: int = Field(default=1, ge=1, description="samples are clipped to [min, max]")
    max: int | None = Field(default=None, ge=1)

    def _clip(self, x: float) -> int:
        v = max(self.min, int(round(x)))
        return min(v, self.max) if self.max is not None else v

    def sample(self, rng: np.random.Generator) -> int:
        raise NotImplementedError

    def sampler(self) -> Callable[[np.random.Generator], int]:
        """``sample`` as a function (a workload draws once per request: a fixed length is a
        constant, not clipped again every time)."""
        return self.sample

    @property
    def mean(self) -> float:
        raise NotImplementedError


class Fixed(_Dist):
    dist: Literal["fixed"]
    value: int = Field(ge=1)

    def sample(self, rng):
        return self._clip(self.value)

    def sampler(self):
        value = self._clip(self.value)
        return lambda rng: value

    @property
    def mean(self):
        return float(self.value)


class Uniform(_Dist):
    dist: Literal["uniform"]
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _order(self):
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng):
        return self._clip(rng.integers(self.low, self.high + 1))

    @property
    def mean(self):
        return (self.low + self.high) / 2


class Normal(_Dist):
    dist: Literal["normal"]
    mean_: float = Field(alias="mean", gt=0)
    std: float = Field(ge=0)

    def sample(self, rng):
        return self._clip(rng.normal(self.mean_, self.std))

    @property
    def mean(self):
        return self.mean_


class LogNormal(_Dist):
    """Parameterised by the median and sigma of the log (heavy right tail)."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def sample(self, rng):
        return self._clip(rng.lognormal(np.log(self.median), self.sigma))

    @property
    def mean(self):
        return float(self.median * np.exp(self.sigma**2 / 2))


class Empirical(_Dist):
    """Lengths drawn uniformly from a file: one integer per line, a JSON list, or a CSV column."""

    dist: Literal["empirical"]
    path: str
    column: str | None = None
    _values: np.ndarray | None = None

    @field_validator("path")
    @classmethod
    def _resolve(cls, v, info: ValidationInfo):
        return str(resolve_path(v, info))

    @model_validator(mode="after")
    def _load(self):
        p = Path(self.path)
        text = p.read_text()
        if p.suffix == ".json":
            values = json.loads(text)
        elif p.suffix == ".csv":
            rows = list(csv.DictReader(text.splitlines()))
            if not rows or (self.column or "") not in rows[0]:
                raise ValueError(f"{self.path}: needs 'column' naming one of its CSV columns")
            values = [_number(r[self.column], self.path, i) for i, r in enumerate(rows, start=2)]
        else:
            values = [_number(x, self.path, i)
                      for i, x in enumerate(text.splitlines(), start=1) if x.strip()]
        arr = np.asarray(values, dtype=float)
        if arr.size == 0 or np.any(arr < 1):
            raise ValueError(f"{self.path}: needs at least one value, all >= 1")
        self._values = arr
        return self

    def sample(self, rng):
        return self._clip(self._values[rng.integers(len(self._values))])

    @property
    def mean(self):
        return float(self._values.mean())


def _number(text, path: str, line: int) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{path}, line {line}: {text!r} is not a number") from None


LengthDist = Annotated[Fixed | Uniform | Normal | LogNormal | Empirical, Field(discriminator="dist")]


def fixed(value: int) -> Fixed:
    return Fixed(dist="fixed", value=value)
