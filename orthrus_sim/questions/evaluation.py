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
from orthrus_sim.experiment.measured import (
    ITERATION_RATE,
    MeasuredRun,
    iteration_rate,
    measured_under,
)
from orthrus_sim.experiment.plan import dedicated_plans, plan_configuration
from orthrus_sim.experiment.results import _get
from orthrus_sim.experiment.scenario import (
    Scenario,
    is_replan,
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
    # the term every server pays that this stock embedding server's own term specialises
    specialises: str | None = None

    def to_z(self, value: float) -> float:
        return math.log(value) if self.log else value / self.unit

    def from_z(self, z: float) -> float:
        return math.exp(z) if self.log else z * self.unit

    @property
    def z_bounds(self) -> tuple[float, float]:
        return self.to_z(self.low), self.to_z(self.high)

    @property
    def kind(self) -> str | None:
        """The kind of request whose costs it carries (None: both, ``overlap``)."""
        if "embedding" in self.name:
            return "embedding"
        return None if self.name == "overlap" else "generation"

    def trades_with(self, overhead: Parameter) -> bool:
        """Whether this device-time term and ``overhead`` (a per-request overhead) can explain
        the same slow server: a scale or padding of the overhead's own kind."""
        return (overhead.name.endswith("_overhead_s") and not self.name.endswith("_overhead_s")
                and self.kind is not None and self.kind == overhead.kind)


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
    Parameter("adapter_scale", 0.2, 10.0, True, 1.0, 0.05,
              "x the device time of generation rows on a replica with the adapter loaded"),
    Parameter("kv_scale", 0.1, 2.0, True, 1.0, 0.05,
              "x the KV cache the memory model gives each replica"),
    Parameter("stock_embedding_scale", 0.05, 20.0, True, 1.0, 0.05,
              "x the device time of a stock embedding server's batches (a split's embedding "
              "GPU), on top of embedding_scale", "embedding_scale"),
    Parameter("stock_embedding_padding", 0.0, 1.0, False, 0.1, 1.0,
              "share of the padding to the longest input a stock embedding server's batch pays"),
    Parameter("stock_embedding_overhead_s", 0.0, 0.5, False, 0.01, 0.2,
              "seconds per embedding request in a stock embedding server's front end, on top "
              "of embedding_overhead_s", "embedding_overhead_s"),
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
    cached by factors, in one process pool kept for the caller's block (``with``), so a fit
    pays the workers' start once.

    A case is simulated at the factors as its replicas pay them (``CostFactors.seen_by``: a
    split without a stock embedding server does not see its terms, a configuration without
    the adapter loaded not ``adapter_scale``), so a factor set that differs from one simulated
    already only in terms a case does not pay reuses that case's run: a finite difference of
    ``adapter_scale`` simulates only the configurations that load the adapter. The longest
    tasks go first (each case's last run time), so the pool's workers end together."""

    def __init__(self, scenario: Scenario, prior: CalibrationFile | None, cases: list[Case],
                 workers: int, tmp: Path) -> None:
        base = scenario_dump(scenario)
        self.raws: dict[tuple[str, ...], dict] = {}
        for overrides in dict.fromkeys(ov for ov, _ in cases):
            configs = list(dict.fromkeys(cfg for ov, cfg in cases if ov == overrides))
            where = "fit scenario" + (f" at {', '.join(overrides)}" if overrides else "")
            raw = measured_under(base, overrides)
            # every measured configuration must fit the scenario under its overrides
            self.raws[overrides] = scenario_dump(parse_scenario(raw | {"configurations": configs},
                                                                where))
        self.cases = list(dict.fromkeys(cases))
        self._pays = {}  # case -> (stock, adapter): which of the arrangement's terms it pays
        for ov, cfg in self.cases:
            sc = parse_scenario(self.raws[ov], "fit scenario")
            # a re-planning split's GPUs run either role's server in turn
            plans = dedicated_plans(sc) if is_replan(cfg) else plan_configuration(sc, cfg)
            self._pays[ov, cfg] = (any(p.stock for p in plans),
                                   any(p.lora is not None for p in plans))
        self.prior = prior
        self.scenario = scenario
        self.workers = workers
        self.tmp = tmp
        self.cache: dict[tuple, dict[Case, dict]] = {}
        self._runs: dict[tuple[Case, tuple], dict] = {}  # (case, factors it pays) -> metrics
        self._seconds: dict[Case, float] = {}  # each case's last simulation, wall seconds
        self.simulations = 0  # simulations run (a factor set is one per case it changes)
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
        tasks: dict[tuple[Case, tuple], Task] = {}
        for f in batch:
            if _key(f) in self.cache:
                continue
            for case in self.cases:
                seen = f.seen_by(*self._pays[case])
                run = (case, _key(seen))
                if run in self._runs or run in tasks:
                    continue
                digest = hashlib.sha256(repr(run[1]).encode()).hexdigest()[:16]
                path = self.tmp / f"cal-{digest}.json"
                if not path.exists():
                    save_calibration(self.calibration(seen), path)
                ov, cfg = case
                raw = self.raws[ov] | {"calibration": str(path), "configurations": [cfg]}
                tasks[run] = Task(raw, cfg, f"{digest} {cfg}")
        if tasks:
            order = sorted(tasks, key=lambda run: -self._seconds.get(run[0], math.inf))
            for run, metrics in zip(order, self._run([tasks[r] for r in order])):
                self._runs[run] = metrics
                self._seconds[run[0]] = metrics.get("sim_wall_s") or 0.0
            self.simulations += len(tasks)
        for f in batch:
            self.cache.setdefault(_key(f), {case: self._runs[case, _key(f.seen_by(*self._pays[case]))]
                                            for case in self.cases})
        return [self.cache[_key(f)] for f in batch]

    def _run(self, tasks: list[Task]) -> list[dict]:
        try:
            if self.workers <= 1 or len(tasks) == 1:
                return [_case_metrics(t) for t in tasks]
            if self._pool is None:
                self._pool = process_pool(self.workers)
            return [f.result() for f in [self._pool.submit(_case_metrics, t) for t in tasks]]
        except Exception as exc:
            raise RuntimeError(f"fit: a simulation failed: {type(exc).__name__}: {exc}") from exc


def _key(factors: CostFactors) -> tuple:
    return tuple(factors.as_dict().values())


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
