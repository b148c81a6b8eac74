"""Calibration files (versioned JSON, validated with pydantic) and the fits that make them.

Two kinds of profiling rows feed ``fit``:

* operator rows ``(op, flops, bytes, seconds)``: one operator timed alone (the A100 data);
  each operator's ``OpCoeffs`` is fitted on its own rows;
* iteration rows ``(BatchShape, seconds)``: a whole forward pass of a known batch composition
  (what ``orthrus-real calibrate`` measures); group efficiencies and the CPU-side overheads are
  fitted so that the summed operator times match.

Both minimise relative error (scipy ``least_squares`` over log-parameters) and report MAPE.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orthrus_sim import read_structured
from orthrus_sim.costmodel.coefficients import Coefficients, OpCoeffs, default_ops
from orthrus_sim.costmodel.cost import CostModel
from orthrus_sim.costmodel.factors import CostFactors
from orthrus_sim.costmodel.hardware import Hardware
from orthrus_sim.costmodel.operators import ATTENTION_OPS, ELEMENTWISE_OPS, LINEAR_OPS, OPERATORS
from orthrus_sim.costmodel.shape import BatchShape

SCHEMA = "orthrus.calibration/1"


class OpCoeffsModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    compute_eff: float = Field(gt=0)
    memory_eff: float = Field(gt=0)
    sharpness: float = Field(default=4.0, ge=1.0)
    overhead_s: float = Field(default=0.0, ge=0)
    floor_s: float = Field(default=0.0, ge=0)
    cache_gain: float = Field(default=1.0, ge=1.0)


class CoefficientsModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ops: dict[str, OpCoeffsModel]
    iteration_overhead_s: float = Field(ge=0)
    per_seq_overhead_s: float = Field(ge=0)


class SourceModel(BaseModel):
    description: str
    files: list[str] = []
    license: str | None = None
    measured: list[str] = Field(default_factory=list, description="operators fitted to data")
    assumed: list[str] = Field(default_factory=list, description="operators left at roofline")
    derived_from: str | None = Field(default=None, description=(
        "derived, not fitted: the fitted card (same die) whose efficiencies this card takes with "
        "its own spec sheet; fit_error is that fit's"))


class FitErrorModel(BaseModel):
    operator_mape: dict[str, float] = {}
    iteration_mape: float | None = None
    points: int = 0
    detail: dict[str, float] = {}


class CostFactorsModel(BaseModel):
    """``CostFactors`` (orthrus_sim/costmodel/factors.py; docs/fitting.md): neutral by default."""
    model_config = ConfigDict(extra="forbid")
    embedding_scale: float = Field(default=1.0, gt=0)
    prefill_scale: float = Field(default=1.0, gt=0)
    decode_scale: float = Field(default=1.0, gt=0)
    overlap: float = Field(default=1.0, ge=0)
    embedding_overhead_s: float = Field(default=0.0, ge=0)
    generation_overhead_s: float = Field(default=0.0, ge=0)
    adapter_scale: float = Field(default=1.0, gt=0)
    kv_scale: float = Field(default=1.0, gt=0)
    stock_embedding_scale: float = Field(default=1.0, gt=0)
    stock_embedding_padding: float = Field(default=0.0, ge=0, le=1)
    stock_embedding_overhead_s: float = Field(default=0.0, ge=0)


class EnvironmentModel(BaseModel):
    """Where the calibration's measurements were made (``orthrus_sim.costmodel.machine``)."""
    model_config = ConfigDict(extra="forbid")
    machine: str | None = Field(default=None, description="CPU model name, or the GPU's name "
                                "(None: not recorded; the flags are compared alone)")
    cpu_flags: list[str] = Field(default_factory=list, description="the CPU's vector/matrix "
                                 "flags that decide kernel speed (avx2, avx512f, avx512_bf16, amx)")
    gpu: str | None = None
    dtype: str | None = None
    engine: str | None = None
    engine_version: str | None = None
    threads: int | None = None
    colocated: int | None = Field(default=None, ge=1, description="engines serving on the "
                                  "machine while it was measured, this one included "
                                  "(calibrate --colocated N; None or 1: alone)")
    neighbour_devices: list[str] = Field(default_factory=list, description="where the other "
                                         "engines ran (their --devices entries)")
    neighbour_iterations: list[int] = Field(default_factory=list, description="forward passes "
                                            "each neighbour ran during the grid")
    served_iterations: list[int] = Field(default_factory=list, description="with --colocated: "
                                         "each replica's iterations of the serving load the "
                                         "cluster of them all ran behind its gateway (rows of "
                                         "the fit)")
    serving_scale: float | None = Field(default=None, gt=0, description="with a served load: "
                                        "its iterations' time over what the grid's own fit "
                                        "priced the same batches; the grid was fitted at "
                                        "that speed")


class FactorParameterModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: float
    prior: float
    bounds: tuple[float, float]
    status: Literal["fitted", "undetermined", "fixed"]
    sensitivity: float = Field(description="largest relative change of a measured metric when "
                               "the parameter moves across its bounds (the rest at the fit)")
    standard_error: float | None = Field(default=None, description="fitted ones: from the "
                                         "Jacobian and the residuals' scatter or the stated "
                                         "spread, whichever is larger")


class ResidualModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    configuration: str
    at: list[str] = Field(default_factory=list, description="the scenario overrides it was "
                          "measured under")
    metric: str
    measured: float
    simulated: float | None
    residual: float | None = Field(description="simulated / measured - 1")


class CandidateModel(BaseModel):
    """A metric the fit could have been given (a measured configuration's, not measured)."""
    model_config = ConfigDict(extra="forbid")
    configuration: str
    at: list[str] = Field(default_factory=list)
    metric: str
    kind: str | None = None  # one kind's server of a split
    value: float | None = Field(description="simulated at the fit")


class RangeEndModel(BaseModel):
    """One end of a parameter's range: every factor, with that one moved as far as the
    measurements allow and the fitted ones refitted (``orthrus_sim.questions.ranges``)."""
    model_config = ConfigDict(extra="forbid")
    parameter: str
    side: Literal["low", "high"]
    factors: dict[str, float]
    growth: float = Field(description="growth of the sum of squared log residuals over the fit's")
    at_bound: bool = Field(description="the parameter's bound stopped it, not the measurements")
    then: str | None = Field(default=None, description="a fitted parameter this end hides, then "
                             "moved too ('embedding_scale low'): the far corner of a trade")
    candidates: list[float | None] = Field(default_factory=list, description="the candidate "
                                           "measurements simulated at this end")

    @property
    def moved_too(self) -> str | None:
        """The fitted parameter a trade's corner moved as well (``then``'s name), if any."""
        return self.then.split()[0] if self.then else None


class FactorFitModel(BaseModel):
    """How ``orthrus-sim fit`` arrived at the factors: what it was fitted to, and how well."""
    model_config = ConfigDict(extra="forbid")
    scenario: str
    measured: list[str]
    prior: str | None = Field(default=None, description="the calibration the factors scale")
    parameters: dict[str, FactorParameterModel]
    residuals: list[ResidualModel]
    rms_residual: float
    evaluations: int
    spread: float = Field(default=0.1, description="the measurements' stated relative spread")
    misses: list[ResidualModel] = Field(default_factory=list, description="metrics the fit is "
                                        "further from than the spread")
    tried: list[str] = Field(default_factory=list, description="what the fit tried on a miss")
    range_ends: list[RangeEndModel] = Field(default_factory=list)
    candidates: list[CandidateModel] = Field(default_factory=list)


class CalibrationFile(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    schema_: Literal["orthrus.calibration/1"] = Field(alias="schema")
    hardware: str
    model: str
    coefficients: CoefficientsModel
    source: SourceModel
    fit_error: FitErrorModel
    created: str = ""
    environment: EnvironmentModel | None = None
    factors: CostFactorsModel | None = None
    factor_fit: FactorFitModel | None = None

    def cost_factors(self) -> CostFactors | None:
        """The fitted cost factors, or None (a calibration without them: neutral)."""
        return CostFactors(**self.factors.model_dump()) if self.factors else None

    def to_coefficients(self) -> Coefficients:
        ops = default_ops()
        for name, c in self.coefficients.ops.items():
            if name not in OPERATORS:
                raise ValueError(f"calibration: coefficients.ops has unknown operator {name!r}; "
                                 f"known: {', '.join(OPERATORS)}")
            ops[name] = OpCoeffs(**c.model_dump())
        return Coefficients(ops=ops,
                            iteration_overhead_s=self.coefficients.iteration_overhead_s,
                            per_seq_overhead_s=self.coefficients.per_seq_overhead_s)


def coefficients_model(coeffs: Coefficients) -> CoefficientsModel:
    return CoefficientsModel(
        ops={k: OpCoeffsModel(**vars(v)) for k, v in coeffs.ops.items()},
        iteration_overhead_s=coeffs.iteration_overhead_s,
        per_seq_overhead_s=coeffs.per_seq_overhead_s,
    )


def _format_errors(path: str, exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        parts.append(f"{loc}: {err['msg']}")
    return f"calibration file {path}: " + "; ".join(parts)


def load_calibration(path: str | Path) -> CalibrationFile:
    raw = read_structured(path, "calibration file")
    try:
        cal = CalibrationFile.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(_format_errors(str(path), exc)) from None
    cal.to_coefficients()  # unknown operator names fail here, with the file named
    return cal


def save_calibration(cal: CalibrationFile, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    doc = cal.model_dump(by_alias=True)
    for key in OPTIONAL_SECTIONS:  # absent rather than null: older readers see the same file
        if doc.get(key) is None:
            doc.pop(key, None)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


OPTIONAL_SECTIONS = ("environment", "factors", "factor_fit")


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    return float(np.mean(np.abs(p / m - 1.0)))


# ----- operator fit ------------------------------------------------------------------------
@dataclass(frozen=True)
class OperatorSample:
    op: str
    flops: float
    bytes: float
    seconds: float


LAUNCH_S = 5e-6  # the most a kernel's launch adds to a matmul's time (fit_operator)


def fit_operator(samples: Sequence[OperatorSample], hardware: Hardware,
                 start: OpCoeffs | None = None, elementwise: bool = False) -> tuple[OpCoeffs, float]:
    """Fit one operator's efficiencies, ridge sharpness and fixed overhead; an ``elementwise``
    one's shortest time (``floor_s``: one wave of thread blocks) and, where the hardware lists a
    cache, its gain while the bytes fit it too. A matmul's small-token time is its weights
    streaming, which those two would stand in for (a floor at the weights' streaming time fits
    one model's shapes and not another's), so a linear operator keeps the four parameters.
    Relative errors, a robust loss, a few starting points (the smooth max has local minima), the
    lowest MAPE kept; returns it too."""
    if not samples:
        raise ValueError("fit: no samples")
    start = start or OpCoeffs()
    flops = np.array([s.flops for s in samples])
    bytes_ = np.array([s.bytes for s in samples])
    y = np.array([s.seconds for s in samples])
    if np.any(y <= 0):
        raise ValueError("fit: measured seconds must be positive")
    has_compute = bool(np.any(flops > 0))
    cache = hardware.cache_bytes if elementwise else 0.0
    low = float(y.min())
    # a matmul's fixed cost is its launch: a larger "overhead" would stand in for the weights'
    # streaming at this model's shapes (and misprice another model's)
    most = low if elementwise else min(low, LAUNCH_S)

    def unpack(x):
        return OpCoeffs(compute_eff=math.exp(x[0]), memory_eff=math.exp(x[1]),
                        sharpness=1.0 + math.exp(x[2]), overhead_s=most * 0.5 * (1 + math.tanh(x[3])),
                        floor_s=low * math.exp(x[4]) if elementwise else 0.0,
                        cache_gain=1.0 + math.exp(x[5]) if cache > 0 else 1.0)

    def predict(c: OpCoeffs) -> np.ndarray:
        return np.array([c.time(f, b, hardware.peak_flops, hardware.mem_bw, cache)
                         for f, b in zip(flops, bytes_)])

    from scipy.optimize import least_squares  # only fits need scipy: a simulation starts faster

    # no efficiency above the spec sheet's peak, the floor at most the shortest measured time
    # (it is what the smallest launch takes), a cache at most 4x the memory's bandwidth (an L2's)
    lo, hi = [-8, -8, -3, -6, -12, -6], [0.0 if has_compute else 0.1, 3, 4, 6, 0.0, math.log(3)]
    best: tuple[float, OpCoeffs] | None = None
    for sharpness in (start.sharpness, 1.5, 3.0) if elementwise else (start.sharpness,):
        for floor in (0.5, 1e-3) if elementwise else (0.5,):
            x0 = [math.log(start.compute_eff), math.log(start.memory_eff),
                  math.log(max(sharpness - 1.0, 0.1)), -2.0, math.log(floor), -3.0]
            res = least_squares(lambda x: predict(unpack(x)) / y - 1.0, x0, bounds=(lo, hi),
                                loss="soft_l1", f_scale=0.02)
            fitted = unpack(res.x)
            if not has_compute:
                fitted = replace(fitted, compute_eff=start.compute_eff)
            err = mape(predict(fitted), y)
            if best is None or err < best[0]:
                best = (err, fitted)
    return best[1], best[0]


# ----- whole-iteration fit -----------------------------------------------------------------
GROUPS = {
    "linear": LINEAR_OPS,
    "attention": ATTENTION_OPS,
    "elementwise": ELEMENTWISE_OPS,
    "lora": ("lora",),
}


def _scaled(base: Coefficients, x: np.ndarray) -> Coefficients:
    ops = dict(base.ops)
    for i, names in enumerate(GROUPS.values()):
        ce, me = math.exp(x[2 * i]), math.exp(x[2 * i + 1])
        for n in names:
            c = ops[n]
            ops[n] = replace(c, compute_eff=c.compute_eff * ce, memory_eff=c.memory_eff * me)
    k = 2 * len(GROUPS)
    return Coefficients(ops=ops, iteration_overhead_s=math.exp(x[k]),
                        per_seq_overhead_s=math.exp(x[k + 1]))


def fit_iterations(cost: CostModel, samples: Sequence[tuple[BatchShape, float]],
                   holdout_every: int = 5) -> tuple[Coefficients, dict[str, float]]:
    """Fit group efficiencies and overheads to whole-iteration timings.

    Every ``holdout_every``-th sample is held out; the returned errors are MAPE on the fitted
    and on the held-out rows.
    """
    if len(samples) < 4:
        raise ValueError("fit: need at least 4 iteration samples")
    train = [s for i, s in enumerate(samples) if holdout_every <= 1 or i % holdout_every]
    held = [s for i, s in enumerate(samples) if holdout_every > 1 and not i % holdout_every]
    base = cost.coefficients

    def predict(coeffs: Coefficients, rows) -> np.ndarray:
        model = CostModel(cost.hardware, cost.model, coeffs, cost.lora)
        return np.array([model.shape_time(shape) for shape, _ in rows])

    y = np.array([t for _, t in train])
    x0 = np.zeros(2 * len(GROUPS) + 2)
    x0[-2] = math.log(max(base.iteration_overhead_s, 1e-6))
    x0[-1] = math.log(max(base.per_seq_overhead_s, 1e-8))
    lo = np.full_like(x0, -6.0)
    hi = np.full_like(x0, 3.0)
    lo[-2:], hi[-2:] = math.log(1e-7), math.log(1.0)
    from scipy.optimize import least_squares

    res = least_squares(lambda x: predict(_scaled(base, x), train) / y - 1.0, x0,
                        bounds=(lo, hi))
    fitted = _scaled(base, res.x)
    errors = {"train_mape": mape(predict(fitted, train), y), "train_points": float(len(train))}
    if held:
        errors["holdout_mape"] = mape(predict(fitted, held), [t for _, t in held])
        errors["holdout_points"] = float(len(held))
    return fitted, errors
