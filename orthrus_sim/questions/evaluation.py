"""The space a fit moves in, and the simulations it moves through: the fitted cost factors
(their bounds and scales), the measured runs simulated at candidate factors (cached, in one
process pool) with their log residuals, and the finite-difference Jacobian. Shared by the fit
(``orthrus_sim.questions.fit``) and the prediction ranges (``orthrus_sim.questions.ranges``)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from orthrus_sim.costmodel import save_calibration
from orthrus_sim.costmodel.calibration import (
    CalibrationFile,
    CostFactorsModel,
    FitErrorModel,
    SourceModel,
    coefficients_model,
)
from orthrus_sim.costmodel.coefficients import Coefficients
from orthrus_sim.costmodel.factors import CostFactors
from orthrus_sim.experiment.measured import ITERATION_RATE, MeasuredRun, iteration_rate
from orthrus_sim.experiment.results import _get
from orthrus_sim.experiment.scenario import (
    Scenario,
    apply_overrides,
    parse_scenario,
    scenario_dump,
)
from orthrus_sim.questions.run import Task, process_pool, run_task


@dataclass(frozen=True)
class Parameter:
    """One fitted factor: its bounds, and how the optimiser moves it. ``log``: in log space
    (scales); else in steps of ``unit`` (the change whose effect decides whether the
    measurements determine it)."""

    name: str
    low: float
    high: float
    log: bool
    unit: float
    tolerance: float  # largest standard error (in z) of a parameter the measurements pin
    meaning: str

    def to_z(self, value: float) -> float:
        return math.log(value) if self.log else value / self.unit

    def from_z(self, z: float) -> float:
        return math.exp(z) if self.log else z * self.unit

    @property
    def z_bounds(self) -> tuple[float, float]:
        return self.to_z(self.low), self.to_z(self.high)


PARAMETERS = (
    Parameter("embedding_scale", 0.05, 20.0, True, 1.0, 0.05,
              "x the device time of embedding (pooling-path) chunks"),
    Parameter("prefill_scale", 0.05, 20.0, True, 1.0, 0.05,
              "x the device time of generation prefill chunks"),
    Parameter("decode_scale", 0.05, 20.0, True, 1.0, 0.05, "x the device time of decodes"),
    Parameter("overlap", 0.0, 2.0, False, 1.0, 0.2,
              "share of the roofline's co-batching saving a mixed iteration realises "
              "(0: parts add up, 1: the calibration's roofline)"),
    Parameter("embedding_overhead_s", 0.0, 0.5, False, 0.01, 0.2,
              "seconds per embedding request in the server, outside the forward pass"),
    Parameter("generation_overhead_s", 0.0, 0.5, False, 0.01, 0.2,
              "seconds per generation request in the server, outside the forward pass"),
)
BY_NAME = {p.name: p for p in PARAMETERS}
STEP = 0.15  # finite-difference step, in z (15 % of a scale, 1.5 ms of an overhead)
MISSING = math.log(1e-2)  # residual when the simulation produces no value for a measured metric



Case = tuple[tuple[str, ...], str]  # (scenario overrides, configuration): one simulation


def _case_metrics(task: Task) -> dict:
    """One simulation's metrics (a worker's task: only the metrics travel back)."""
    return run_task(task).metrics


class Simulations:
    """The cases (a configuration under scenario overrides) simulated at given cost factors:
    cached by factors, every case of every new factor set one task, in one process pool kept
    for the caller's block (``with``), so a fit pays the workers' start once."""

    def __init__(self, scenario: Scenario, prior: CalibrationFile | None, cases: list[Case],
                 workers: int, tmp: Path) -> None:
        base = scenario_dump(scenario)
        self.raws: dict[tuple[str, ...], dict] = {}
        for overrides in dict.fromkeys(ov for ov, _ in cases):
            configs = list(dict.fromkeys(cfg for ov, cfg in cases if ov == overrides))
            where = "fit scenario" + (f" at {', '.join(overrides)}" if overrides else "")
            raw = apply_overrides(base, list(overrides), "scenario_overrides")
            # every measured configuration must fit the scenario under its overrides
            self.raws[overrides] = scenario_dump(parse_scenario(raw | {"configurations": configs},
                                                                where))
        self.cases = list(dict.fromkeys(cases))
        self.prior = prior
        self.scenario = scenario
        self.workers = workers
        self.tmp = tmp
        self.cache: dict[tuple, dict[Case, dict]] = {}
        self._pool = None

    def __enter__(self) -> Simulations:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def calibration(self, factors: CostFactors) -> CalibrationFile:
        """The prior (its coefficients, hardware, environment) with ``factors``."""
        base = self.prior or default_calibration(self.scenario)
        return base.model_copy(update={"factors": CostFactorsModel(**factors.as_dict())})

    def simulate(self, batch: list[CostFactors]) -> list[dict[Case, dict]]:
        """``{case: metrics}`` at each of the factors."""
        tasks: list[tuple[tuple, Case, Task]] = []
        for f in batch:
            key = tuple(f.as_dict().values())
            if key in self.cache or any(k == key for k, _, _ in tasks):
                continue
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            path = self.tmp / f"cal-{digest}.json"
            save_calibration(self.calibration(f), path)
            for ov, cfg in self.cases:
                raw = self.raws[ov] | {"calibration": str(path), "configurations": [cfg]}
                tasks.append((key, (ov, cfg), Task(raw, cfg, f"{digest} {cfg}")))
        if tasks:
            done: dict[tuple, dict[Case, dict]] = {}
            for (key, case, _), metrics in zip(tasks, self._run([t for _, _, t in tasks])):
                done.setdefault(key, {})[case] = metrics
            self.cache.update(done)
        return [self.cache[tuple(f.as_dict().values())] for f in batch]

    def _run(self, tasks: list[Task]) -> list[dict]:
        try:
            if self.workers <= 1 or len(tasks) == 1:
                return [_case_metrics(t) for t in tasks]
            if self._pool is None:
                self._pool = process_pool(self.workers)
            return [f.result() for f in [self._pool.submit(_case_metrics, t) for t in tasks]]
        except Exception as exc:
            raise RuntimeError(f"fit: a simulation failed: {type(exc).__name__}: {exc}") from exc


class Evaluator(Simulations):
    """The measured runs simulated at given factors, each under its own scenario overrides, and
    their residuals (log ratios simulated / measured)."""

    def __init__(self, scenario: Scenario, prior: CalibrationFile | None, runs: list[MeasuredRun],
                 workers: int, tmp: Path) -> None:
        super().__init__(scenario, prior, [(r.overrides, r.configuration) for r in runs],
                         workers, tmp)
        self.runs = runs
        self.targets = [((r.overrides, r.configuration), m, v)
                        for r in runs for m, v in r.metrics.items()]
        self.kinds = [r.kind for r in runs for _ in r.metrics]

    def simulated(self, sims: dict[Case, dict]) -> list[float | None]:
        return [metric_value(sims[case], metric, kind)
                for (case, metric, _), kind in zip(self.targets, self.kinds)]

    def residuals(self, sims: dict[Case, dict]) -> np.ndarray:
        out = []
        for (_, _, measured), s in zip(self.targets, self.simulated(sims)):
            out.append(math.log(s / measured) if s else MISSING)
        return np.array(out)


def metric_value(metrics: dict, path: str, kind: str | None) -> float | None:
    """A simulated metric; the busy share of one kind's server of a split is that of the
    replicas of that role."""
    if path == ITERATION_RATE:
        return iteration_rate(metrics, kind)
    if path == "utilization.busy" and kind is not None:
        rows = [g["busy"] for g in metrics["utilization"].get("per_gpu", []) if g["role"] == kind]
        if rows:
            return sum(rows) / len(rows)
    return _get(metrics, path)


def default_calibration(scenario: Scenario) -> CalibrationFile:
    """The roofline's defaults as a calibration (a scenario without one)."""
    return CalibrationFile(
        schema="orthrus.calibration/1", hardware=scenario.hardware, model=scenario.model,
        coefficients=coefficients_model(Coefficients()),
        source=SourceModel(description="roofline defaults (no profiling)", assumed=["all operators"]),
        fit_error=FitErrorModel())


def factors_at(base: CostFactors, names: list[str], z: np.ndarray) -> CostFactors:
    """``base`` with ``names`` set from their z values, each clipped to its bounds (a step
    that ends on a bound can land a rounding error beyond it)."""
    return replace(base, **{n: min(max(BY_NAME[n].from_z(float(v)), BY_NAME[n].low),
                                   BY_NAME[n].high) for n, v in zip(names, z)})


def difference_steps(names: list[str], z: np.ndarray) -> np.ndarray:
    """Forward steps, backward where a step would leave the bounds."""
    out = np.full(len(names), STEP)
    for i, n in enumerate(names):
        if z[i] + STEP > BY_NAME[n].z_bounds[1]:
            out[i] = -STEP
    return out


def jacobian(ev: Evaluator, base: CostFactors, names: list[str], z: np.ndarray) -> np.ndarray:
    return jacobians(ev, [base], names, [z])[0][1]


def jacobians(ev: Evaluator, bases: list[CostFactors], names: list[str],
              zs: list[np.ndarray] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(residuals, forward-difference Jacobian of ``names``) at each base with ``names`` set
    from its z (default: its own values), every point simulated in one batch."""
    if zs is None:
        points = list(bases)
        zs = [np.array([BY_NAME[n].to_z(getattr(b, n)) for n in names]) for b in bases]
    else:
        points = [factors_at(b, names, z) for b, z in zip(bases, zs)]
    k = len(names)
    steps = [difference_steps(names, z) for z in zs]
    points += [factors_at(b, names, z + np.eye(k)[i] * st[i])
               for b, z, st in zip(bases, zs, steps) for i in range(k)]
    res = [ev.residuals(s) for s in ev.simulate(points)]
    n = len(bases)
    out = []
    for j in range(n):
        cols = [(res[n + j * k + i] - res[j]) / steps[j][i] for i in range(k)]
        out.append((res[j], np.column_stack(cols) if cols else np.zeros((len(res[j]), 0))))
    return out
