"""How sure a prediction is: each cost factor moved as far as the fit's measurements allow
(the fitted ones refitted), a prediction's extremes over those moves, and the one extra
measurement that would narrow the widest range most (docs/fitting.md, "Prediction ranges").

A move is allowed while the sum of squared log residuals grows by no more than
``(Z * spread)^2``: for measurements with a relative spread ``spread`` that is a ``Z``-sigma
move of one parameter, the others refitted (a profile of the fit's misfit). A fitted
parameter's ends come from the fit's Jacobian (a linear profile; the fitted ones move with it
as the Jacobian says they would refit); a parameter the fit left undetermined is moved to its
bound, or halfway back while that grows the misfit too much, the fitted ones refitted
(``_Trials``); where the measurements stopped it, the fitted ones are moved on from there
(``_corners``: an overhead that binds frees the scale it hid). Every end is then simulated once,
which records its actual misfit growth and the measured configurations' other metrics there
(the candidates of ``suggest``).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from orthrus_sim.costmodel.calibration import CalibrationFile, CandidateModel, RangeEndModel
from orthrus_sim.costmodel.factors import CostFactors
from orthrus_sim.evaluation import (
    BY_NAME,
    Evaluator,
    Simulations,
    factors_at,
    jacobian,
    jacobians,
    metric_value,
)
from orthrus_sim.experiment.measured import ITERATION_RATE
from orthrus_sim.experiment.results import _get
from orthrus_sim.experiment.scenario import Scenario

Z = 2.0  # ends at a 2-sigma move of one parameter
SEEDS = 64  # other seeds a predicted configuration runs under at most: its spread and its mean
FIRST_SEEDS = 8  # ... at least (more while its mean's spread hides the parameters' part)
PRECISION = 0.01  # a mean's 2-sd spread (of its log) that needs no more seeds
BISECT = 3  # halvings towards an undetermined parameter's farthest allowed value
REFIT_STEPS = 2  # Gauss-Newton steps on a fresh Jacobian for a trial still past the budget
SHRINK = 1.5  # a simulated end this far above the allowed growth is pulled in once

PREDICTED = ("throughput_rps.embedding", "throughput_rps.generation", "latency_s.embedding.p50",
             "latency_s.generation.p50", "latency_s.ttft.p99", "latency_s.tpot.p99")
# what a bench of a measured configuration can report besides what was fitted (kind: that
# role's replicas of a split)
CANDIDATES = (("throughput_rps.embedding", None), ("throughput_rps.generation", None),
              ("latency_s.embedding.p50", None), ("latency_s.generation.p50", None),
              ("latency_s.ttft.p50", None), ("latency_s.tpot.p50", None),
              (ITERATION_RATE, "embedding"), (ITERATION_RATE, "generation"),
              (ITERATION_RATE, None), ("utilization.busy", "embedding"),
              ("utilization.busy", "generation"), ("utilization.busy", None))


def _ssr(r: np.ndarray) -> float:
    return float(r @ r)


def _bounds(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([BY_NAME[n].z_bounds[0] for n in names])
    hi = np.array([BY_NAME[n].z_bounds[1] for n in names])
    return lo, hi


def _along(z: np.ndarray, d: np.ndarray, names: list[str], length: float) -> tuple[float, bool]:
    """How far (up to ``length``) ``z`` may go along ``d`` inside the bounds; and whether a
    bound stopped it."""
    lo, hi = _bounds(names)
    room = math.inf
    for j, dj in enumerate(d):
        if dj > 1e-12:
            room = min(room, (hi[j] - z[j]) / dj)
        elif dj < -1e-12:
            room = min(room, (lo[j] - z[j]) / dj)
    room = max(room, 0.0)
    return (length, False) if length <= room else (room, True)


def _linear_end(jac: np.ndarray, at: CostFactors, fitted: list[str], name: str, side: str,
                budget: float) -> tuple[CostFactors, bool]:
    """A fitted parameter moved until the misfit grows by ``budget``, by the Jacobian: the
    others follow as they would refit (the least-squares coefficients of its column on theirs)."""
    i = fitted.index(name)
    col, others = jac[:, i], np.delete(jac, i, axis=1)
    coef = np.linalg.lstsq(others, col, rcond=None)[0] if others.shape[1] else np.zeros(0)
    norm = float(np.linalg.norm(col - others @ coef)) if others.shape[1] else float(np.linalg.norm(col))
    sign = -1.0 if side == "low" else 1.0
    d = np.insert(-coef * sign, i, sign)
    z = np.array([BY_NAME[n].to_z(getattr(at, n)) for n in fitted])
    length, bound = _along(z, d, fitted, math.sqrt(budget) / norm if norm > 1e-12 else math.inf)
    return factors_at(at, fitted, z + length * d), bound


class _Trials:
    """Factor sets with one parameter set to a value and the fitted ones refitted: one
    Gauss-Newton step on the fit's Jacobian, then, while the misfit still grows past the
    budget, up to ``REFIT_STEPS`` more on a Jacobian taken where each starts (a per-request
    overhead hides behind the device until it binds, so the fit's Jacobian cannot say how far
    a scale must give way to it). Simulated in batches; the best point of each kept."""

    def __init__(self, ev: Evaluator, at: CostFactors, fitted: list[str], jac: np.ndarray,
                 budget: float = math.inf, ssr0: float | None = None) -> None:
        self.ev, self.at, self.fitted, self.jac, self.budget = ev, at, fitted, jac, budget
        self.ssr0 = _ssr(ev.residuals(ev.simulate([at])[0])) if ssr0 is None else ssr0

    def _step(self, points: list[CostFactors], residuals: list[np.ndarray],
              jacs: list[np.ndarray]) -> list[CostFactors]:
        lo, hi = _bounds(self.fitted)
        out = []
        for f, r, jac in zip(points, residuals, jacs):
            z = np.array([BY_NAME[n].to_z(getattr(f, n)) for n in self.fitted])
            dz = -np.linalg.lstsq(jac, r, rcond=None)[0]
            out.append(factors_at(f, self.fitted, np.clip(z + dz, lo, hi)))
        return out

    def run(self, moves: list[tuple[str, float]]) -> list[tuple[CostFactors, float]]:
        """(factors, misfit growth) for each (parameter, value)."""
        first = [replace(self.at, **{n: v}) for n, v in moves]
        r1 = [self.ev.residuals(s) for s in self.ev.simulate(first)]
        best = [(f, _ssr(r)) for f, r in zip(first, r1)]
        if self.fitted:
            todo = list(range(len(first)))
            points = self._step(first, r1, [self.jac] * len(first))
            for step in range(REFIT_STEPS + 1):
                for i, f, s in zip(todo, points, self.ev.simulate(points)):
                    c = _ssr(self.ev.residuals(s))
                    if c < best[i][1]:
                        best[i] = (f, c)
                todo = [i for i in todo if best[i][1] - self.ssr0 > self.budget]
                if step == REFIT_STEPS or not todo:
                    break
                starts = [best[i][0] for i in todo]
                at_starts = jacobians(self.ev, starts, self.fitted)
                points = self._step(starts, [r for r, _ in at_starts], [j for _, j in at_starts])
        return [(f, c - self.ssr0) for f, c in best]


def _midpoint(name: str, near: float, far: float) -> float:
    """Halfway in the parameter's own scale (geometric for scales and for an overhead moving up
    from a few milliseconds)."""
    p = BY_NAME[name]
    if p.log:
        return math.sqrt(near * far)
    if p.name.endswith("_overhead_s") and far > near:
        return math.sqrt(max(near, 0.001) * far)
    return (near + far) / 2


def _refitted_ends(trials: _Trials, names: list[str], budget: float, say: Callable[[str], None],
                   halvings: int = BISECT) -> dict[tuple[str, str], tuple[CostFactors, bool]]:
    """Each parameter the fit left out moved to either bound, or as near it as the budget
    allows (halving the step ``halvings`` times), the fitted ones refitted."""
    at = trials.at
    todo = {}
    for name in names:
        p = BY_NAME[name]
        for side, bound in (("low", p.low), ("high", p.high)):
            todo[(name, side)] = (getattr(at, name), bound)
    out: dict[tuple[str, str], tuple[CostFactors, bool]] = {}
    keys = [k for k, (near, far) in todo.items() if near != far]
    for k, (near, far) in todo.items():
        if near == far:
            out[k] = (at, True)
    if not keys:
        return out
    say(f"moving {', '.join(dict.fromkeys(k[0] for k in keys))} to their bounds")
    accepted = {k: at for k in keys}
    for k, (f, growth) in zip(keys, trials.run([(k[0], todo[k][1]) for k in keys])):
        if growth <= budget:
            out[k] = (f, True)
    pending = [k for k in keys if k not in out]
    spans = {k: todo[k] for k in pending}
    for _ in range(halvings):
        if not pending:
            break
        mids = {k: _midpoint(k[0], *spans[k]) for k in pending}
        for k, (f, growth) in zip(pending, trials.run([(k[0], mids[k]) for k in pending])):
            near, far = spans[k]
            if growth <= budget:
                accepted[k], spans[k] = f, (mids[k], far)
            else:
                spans[k] = (near, mids[k])
    for k in pending:
        out[k] = (accepted[k], False)
    return out


def _corners(trials: _Trials, ends: dict[tuple[str, str], tuple[CostFactors, bool]],
             budget: float, say: Callable[[str], None]) -> dict[tuple, tuple[CostFactors, bool]]:
    """The far corners of trades. A per-request overhead explains a slow server as well as a
    device-time scale does: it grows, hidden behind the device, until it binds, and from
    there the scale may shrink with the overhead taking its place. So at each undetermined
    parameter's end that the measurements stopped (not a bound), every fitted one is moved to
    either bound as far as the budget allows, the other fitted ones and that parameter
    refitted (the bound, else halfway to it); keyed (parameter, side, "fitted side")."""
    fitted = trials.fitted
    out: dict[tuple, tuple[CostFactors, bool]] = {}
    for key, (f, bound) in ends.items():
        if bound or f == trials.at or not fitted:
            continue
        for name in fitted:
            refit = [n for n in fitted if n != name] + [key[0]]
            jac_f = jacobians(trials.ev, [f], refit)[0][1]  # the fit's has no column for it
            inner = _Trials(trials.ev, f, refit, jac_f, budget, trials.ssr0)
            for (_, side), (g, _bound) in _refitted_ends(inner, [name], budget, say, 1).items():
                if g != f:
                    out[(*key, f"{name} {side}")] = (g, _bound)
    return out


def _candidates(ev: Evaluator, point: dict) -> list[tuple[tuple, str, str | None]]:
    """The measured configurations' metrics the fit was not given, that the simulation has."""
    measured = {(case, metric, kind) for (case, metric, _), kind in zip(ev.targets, ev.kinds)}
    measured |= {(case, metric, None) for case, metric, _ in ev.targets}
    out = []
    for case in ev.cases:
        roles = {g.get("role") for g in (point[case].get("utilization") or {}).get("per_gpu", [])}
        for metric, kind in CANDIDATES:
            if (case, metric, kind) in measured or (kind is not None and kind not in roles):
                continue
            if metric_value(point[case], metric, kind):
                out.append((case, metric, kind))
    return out


def profile(ev: Evaluator, at: CostFactors, fitted: list[str], movable: list[str], spread: float,
            say: Callable[[str], None]) -> tuple[list[RangeEndModel], list[CandidateModel]]:
    """Both ends of every movable parameter (module docstring), each simulated on the measured
    configurations, and the candidate measurements with their values at the fit."""
    budget = (Z * spread) ** 2
    z = np.array([BY_NAME[n].to_z(getattr(at, n)) for n in fitted])
    jac = jacobian(ev, at, fitted, z) if fitted else np.zeros((len(ev.targets), 0))
    trials = _Trials(ev, at, fitted, jac, budget)
    raw = {(n, s): _linear_end(jac, at, fitted, n, s, budget)
           for n in fitted if n in movable for s in ("low", "high")}
    raw |= _refitted_ends(trials, [n for n in movable if n not in fitted], budget, say)
    keys: list[tuple] = [(n, s) for n in movable for s in ("low", "high")]
    corners = _corners(trials, {k: raw[k] for k in keys if k[0] not in fitted}, budget, say)
    raw |= corners
    keys += list(corners)
    sims = ev.simulate([raw[k][0] for k in keys])
    # a linear end the simulation finds much dearer than the Jacobian said is pulled in once
    again = [k for k, s in zip(keys, sims) if k[0] in fitted
             and _ssr(ev.residuals(s)) - trials.ssr0 > SHRINK * budget]
    if again:
        for k in again:
            f, bound = raw[k]
            growth = _ssr(ev.residuals(ev.simulate([f])[0])) - trials.ssr0
            zk = np.array([BY_NAME[n].to_z(getattr(f, n)) for n in fitted])
            raw[k] = (factors_at(at, fitted, z + (zk - z) * math.sqrt(budget / growth)), False)
        sims = ev.simulate([raw[k][0] for k in keys])
    point = ev.simulate([at])[0]
    cands = _candidates(ev, point)
    ends = []
    for k, s in zip(keys, sims):
        f, bound = raw[k]
        ends.append(RangeEndModel(
            parameter=k[0], side=k[1], then=k[2] if len(k) > 2 else None, factors=f.as_dict(),
            growth=max(0.0, _ssr(ev.residuals(s)) - trials.ssr0), at_bound=bound,
            candidates=[metric_value(s[case], metric, kind) for case, metric, kind in cands]))
    return ends, [CandidateModel(configuration=case[1], at=list(case[0]), metric=metric, kind=kind,
                                 value=metric_value(point[case], metric, kind))
                  for case, metric, kind in cands]


# ----- predictions ------------------------------------------------------------------------
@dataclass
class Range:
    """One predicted metric: the point and its extremes over the fit's parameter ends."""

    configuration: str
    metric: str
    point: float
    low: float
    high: float
    low_end: str | None  # "parameter low|high" that gives the low extreme (None: the point)
    high_end: str | None
    values: list[float | None] = field(default_factory=list)  # at each end, in the fit's order
    noise: float = 0.0  # the point's sampling spread: sd of its log over other seeds
    samples: int = 1  # the runs ``noise`` and ``mean`` come from (the point's among them)
    mean: float | None = None  # the expected value: the geometric mean over those runs

    @property
    def width(self) -> float:
        """The range's width relative to the point: where one run of the window lands."""
        return (self.high - self.low) / self.point if self.point else math.inf

    @property
    def mean_noise(self) -> float:
        """The sampling spread of ``mean``: the seeds' sd over the root of their number."""
        return self.noise / math.sqrt(self.samples)

    @property
    def parameter_extremes(self) -> tuple[float, float]:
        """The lowest and highest of the point and the ends' values (no sampling spread)."""
        values = [self.point] + [v for v in self.values if v is not None]
        return min(values), max(values)

    @property
    def mean_low(self) -> float | None:
        """The expected value's range: the parameters' extremes moved with ``mean`` (each end's
        ratio to the point under the same seed), widened by ``mean_noise``."""
        return self._mean_range()[0]

    @property
    def mean_high(self) -> float | None:
        return self._mean_range()[1]

    def _mean_range(self) -> tuple[float | None, float | None]:
        if self.mean is None or not self.point:
            return None, None
        low, high = self.parameter_extremes
        scale = self.mean / self.point
        return _widened(self.mean, low * scale, high * scale, self.mean_noise)

    @property
    def mean_width(self) -> float:
        """The expected value's range relative to ``mean`` (a range without seeds: ``width``)."""
        low, high = self._mean_range()
        if low is None or high is None:
            return self.width
        return (high - low) / self.mean if self.mean else math.inf

    @property
    def parameter_width(self) -> float:
        """The width of the parameters' extremes alone (no sampling spread) relative to the
        point: what a further measurement can narrow."""
        low, high = self.parameter_extremes
        return (high - low) / self.point if self.point else math.inf

    def as_dict(self) -> dict:
        return {"configuration": self.configuration, "metric": self.metric, "point": self.point,
                "low": self.low, "high": self.high, "low_end": self.low_end,
                "high_end": self.high_end, "relative_width": self.width,
                "parameter_width": self.parameter_width, "sampling_sd": self.noise,
                "runs": self.samples, "mean": self.mean, "mean_low": self.mean_low,
                "mean_high": self.mean_high, "mean_relative_width": self.mean_width,
                "mean_sampling_sd": self.mean_noise}


def predict(scenario: Scenario, calibration: CalibrationFile, configurations: list[str],
            workers: int = 1, metrics: tuple[str, ...] = PREDICTED,
            seeds: int = SEEDS) -> list[Range]:
    """Each configuration simulated at the calibration's factors and at every end of its fit's
    parameter ranges; per metric the point and the extremes (a calibration without a fit's
    ranges gives points only).

    A prediction is also one sample: other requests, another interleaving, a closed loop's
    completions counted in a finite window. So the point is simulated again under other seeds;
    the spread of its log there (``noise``, an sd) widens each side of the range, added in
    quadrature to the parameters' move at ``Z`` sigma (the two are independent). A measurement
    of the same window is such a sample too: a range without it covers the parameters'
    uncertainty and not the run's. ``low``..``high`` is where one run of the scenario's window
    lands; ``mean_low``..``mean_high`` is the expected value (what many runs, or a long one,
    average to; the geometric mean of the runs): the parameters' extremes moved with it,
    widened by that mean's own spread (``noise`` over the root of the runs' number), which more
    seeds narrow and no measurement does. So after ``FIRST_SEEDS`` other seeds a configuration
    runs under as many more (``seeds`` in all at most) as its metrics need for that spread to
    be at most half the parameters' move on either side, or ``PRECISION``."""
    ends = calibration.factor_fit.range_ends if calibration.factor_fit else []
    point = calibration.cost_factors() or CostFactors()
    batch = [point] + [CostFactors(**e.factors) for e in ends]
    cases = [((), c) for c in configurations]
    with tempfile.TemporaryDirectory(prefix="orthrus-predict-") as tmp:
        with Simulations(scenario, calibration, cases, workers, Path(tmp)) as sims:
            docs = sims.simulate(batch)
        first = min(FIRST_SEEDS, seeds)
        seed_docs = _seed_runs(scenario, calibration, point,
                               {c: range(1, first + 1) for c in configurations}, workers, Path(tmp))
        extremes = {(c, m): _extremes(ends, docs, ((), c), m) for c in configurations
                    for m in metrics}
        wanted = {c: _seeds_wanted(seed_docs[c], extremes, c, metrics) for c in configurations}
        more = _seed_runs(scenario, calibration, point,
                          {c: range(first + 1, min(n, seeds) + 1) for c, n in wanted.items()},
                          workers, Path(tmp))
    out = []
    for case in cases:
        c = case[1]
        for metric in metrics:
            if extremes[c, metric] is None:
                continue
            at, low, high, low_end, high_end, values = extremes[c, metric]
            seen = _values(at, seed_docs[c] + more[c], metric)
            noise = _log_sd(seen)
            mean = math.exp(sum(math.log(v) for v in seen) / len(seen))
            low, high = _widened(at, low, high, noise)
            out.append(Range(c, metric, at, low, high, low_end, high_end, values, noise,
                             len(seen), mean))
    return out


def _extremes(ends: list[RangeEndModel], docs: list[dict], case: tuple, metric: str):
    """(point, low, high, low end, high end, each end's value) of one metric over the ends'
    simulations (``docs[0]`` the point), or None where the point has no value."""
    at = _get(docs[0][case], metric)
    if not at:
        return None
    values = [_get(d[case], metric) for d in docs[1:]]
    low, high, low_end, high_end = at, at, None, None
    for e, v in zip(ends, values):
        if v is None:
            continue
        if v < low:
            low, low_end = v, end_label(e)
        if v > high:
            high, high_end = v, end_label(e)
    return at, low, high, low_end, high_end, values


def _seed_runs(scenario: Scenario, calibration: CalibrationFile, point: CostFactors,
               seeds: dict[str, range], workers: int, tmp: Path) -> dict[str, list[dict]]:
    """Each configuration's results at ``point`` under the scenario's seed + each of its
    ``seeds`` offsets."""
    cases = [((f"seed={scenario.seed + i}",), c) for c, offsets in seeds.items() for i in offsets]
    out: dict[str, list[dict]] = {c: [] for c in seeds}
    if not cases:
        return out
    with Simulations(scenario, calibration, cases, workers, tmp) as sims:
        docs = sims.simulate([point])[0]
    for case in cases:
        out[case[1]].append(docs[case])
    return out


def _values(at: float, runs: list[dict], metric: str) -> list[float]:
    """The point's value and each run's under other seeds (a run with none of the metric, a
    kind that finished nothing in the window, is left out: a log has no zero)."""
    return [at] + [v for doc in runs if (v := _get(doc, metric))]


def _seeds_wanted(runs: list[dict], extremes: dict, configuration: str,
                  metrics: tuple[str, ...]) -> int:
    """Other seeds ``configuration`` runs under: as many as its neediest metric wants."""
    return max((_seeds_needed(runs, m, extremes[configuration, m]) for m in metrics), default=0)


def _seeds_needed(runs: list[dict], metric: str, extremes) -> int:
    """Other seeds the mean of ``metric`` needs for its 2-sd spread to be at most half the
    parameters' smaller move (an end at 0 moves no bound), or ``PRECISION`` (``runs``: its runs
    so far, the point's excluded)."""
    if extremes is None:
        return 0
    at, low, high = extremes[:3]
    noise = _log_sd(_values(at, runs, metric))
    moves = [m for m in (math.log(at / low) if low > 0 else 0.0, math.log(high / at)) if m > 0]
    allowed = max(min(moves, default=0.0) / 2, PRECISION)
    return math.ceil((Z * noise / allowed) ** 2) - 1


def end_label(end: RangeEndModel) -> str:
    """'parameter side', and the fitted one it hid where that moved too."""
    return f"{end.parameter} {end.side}" + (f", {end.then}" if end.then else "")


def _widened(point: float, low: float, high: float, noise: float) -> tuple[float, float]:
    """The parameters' extremes with the sampling spread added in quadrature on each side."""
    if not noise or point <= 0:
        return low, high
    if low <= 0:  # an end with none of it: no spread widens nothing
        return low, point * math.exp(math.hypot(math.log(high / point), Z * noise))
    return (point * math.exp(-math.hypot(math.log(point / low), Z * noise)),
            point * math.exp(math.hypot(math.log(high / point), Z * noise)))


def _log_sd(values: list[float]) -> float:
    """The sample standard deviation of the values' logs (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    logs = [math.log(v) for v in values]
    mean = sum(logs) / len(logs)
    return math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))


@dataclass
class Suggestion:
    """A measurement the fit was not given, and how much of a range it would remove."""

    configuration: str
    at: list[str]
    metric: str
    kind: str | None
    value: float | None  # simulated at the fit
    removes: float  # share of the expected value's range it would remove

    def as_dict(self) -> dict:
        return {"configuration": self.configuration, "at": self.at, "metric": self.metric,
                "kind": self.kind, "value": self.value, "removes": self.removes}


@dataclass
class SamplingBound:
    """The widest range when most of it is the prediction's own sampling spread: no measurement
    of the fit's configurations narrows that part (``suggest`` ranks only what they can); a
    longer window narrows it, the spread of a count over a window going about as one over the
    square root of its length."""

    configuration: str
    metric: str
    width: float  # relative, the whole range
    parameter_width: float  # relative, the parameters' part
    sampling_sd: float
    duration_s: float | None  # the measurement window (None: the run goes to its last request)
    mean_width: float = 0.0  # relative, the expected value's range (its spread: more seeds)
    runs: int = 1  # the runs its mean is over

    @property
    def sampling_width(self) -> float:
        """The width the sampling spread alone gives (both sides at ``Z`` sd)."""
        return math.exp(Z * self.sampling_sd) - math.exp(-Z * self.sampling_sd)

    def as_dict(self) -> dict:
        return {"configuration": self.configuration, "metric": self.metric,
                "relative_width": self.width, "parameter_width": self.parameter_width,
                "sampling_sd": self.sampling_sd, "sampling_width": self.sampling_width,
                "duration_s": self.duration_s, "mean_relative_width": self.mean_width,
                "runs": self.runs}


def sampling_bound(ranges: list[Range], duration_s: float | None) -> SamplingBound | None:
    """``SamplingBound`` of the widest range (whole width) when its parameters' part is under
    half of it, else None."""
    widest = max((r for r in ranges if math.isfinite(r.width)), key=lambda r: r.width,
                 default=None)
    if widest is None or widest.width <= 0 or widest.parameter_width >= 0.5 * widest.width:
        return None
    return SamplingBound(widest.configuration, widest.metric, widest.width,
                         widest.parameter_width, widest.noise, duration_s, widest.mean_width,
                         widest.samples)


def _removal(widest: Range, fit_doc, picked: list[int]) -> float:
    """The share of ``widest``'s expected-value range (``mean_width``) that measuring the
    candidates ``picked`` (indices into the fit's candidates) would remove, were each measured
    at the fit's simulated value: at every end, each new metric's log distance from that value
    adds to the misfit growth, and the end moves back along its path until the growth is within
    the budget again (growth taken as quadratic along the path); the mean's sampling spread is added back as
    ``predict`` adds it (no measurement of the fit removes it)."""
    budget = (Z * fit_doc.spread) ** 2
    moved = [widest.point]
    for e, v in zip(fit_doc.range_ends, widest.values):
        if v is None:
            continue
        grown = e.growth
        for ci in picked:
            c = e.candidates[ci] if ci < len(e.candidates) else None
            value = fit_doc.candidates[ci].value
            grown += math.log(c / value) ** 2 if c and value else 1.0
        t = 1.0 if grown <= budget else math.sqrt(budget / grown)
        moved.append(widest.point + t * (v - widest.point))
    low, high = _widened(widest.point, min(moved), max(moved), widest.mean_noise)
    low_now, high_now = _widened(widest.point, *widest.parameter_extremes, widest.mean_noise)
    return 1 - (high - low) / (high_now - low_now) if high_now > low_now else 0.0


def _can_narrow(widest: Range, calibration: CalibrationFile) -> bool:
    """Whether there is anything to rank: a fit with range ends and a range of some width."""
    fit_doc = calibration.factor_fit
    return bool(fit_doc and fit_doc.range_ends and widest.high > widest.low)


def suggest(widest: Range, calibration: CalibrationFile, top: int = 3) -> list[Suggestion]:
    """The candidate measurements (one metric each) ranked by how much of ``widest`` each
    would remove (``_removal``)."""
    if not _can_narrow(widest, calibration):
        return []
    fit_doc = calibration.factor_fit
    out = [_suggestion(widest, fit_doc, i) for i in range(len(fit_doc.candidates))]
    out.sort(key=lambda s: -s.removes)
    return out[:top]


def _suggestion(widest: Range, fit_doc, i: int) -> Suggestion:
    c = fit_doc.candidates[i]
    return Suggestion(c.configuration, list(c.at), c.metric, c.kind, c.value,
                      _removal(widest, fit_doc, [i]))


@dataclass
class RunSuggestion:
    """One more run of a measured configuration under the overrides it was measured at, with
    every metric its bench reports kept (a published table kept only some): one run's cost
    pins what no one of its metrics pins alone (a trade seen in a server's p50 and a
    co-batching saving in the generation servers' TTFT)."""

    configuration: str
    at: list[str]
    metrics: list[Suggestion]  # each metric the run adds, with its own removal alone
    removes: float  # share of the expected value's range the whole run would remove

    def as_dict(self) -> dict:
        return {"configuration": self.configuration, "at": self.at, "removes": self.removes,
                "metrics": [{"metric": m.metric, "kind": m.kind, "value": m.value,
                             "removes": m.removes} for m in self.metrics]}


def suggest_run(widest: Range, calibration: CalibrationFile, top: int = 1) -> list[RunSuggestion]:
    """The measured configurations' runs (configuration, overrides), each with every candidate
    metric it reports, ranked by how much of ``widest`` the whole run would remove."""
    if not _can_narrow(widest, calibration):
        return []
    fit_doc = calibration.factor_fit
    runs: dict[tuple, list[int]] = {}
    for i, c in enumerate(fit_doc.candidates):
        runs.setdefault((c.configuration, tuple(c.at)), []).append(i)
    out = []
    for (configuration, at), picked in runs.items():
        out.append(RunSuggestion(configuration, list(at),
                                 [_suggestion(widest, fit_doc, i) for i in picked],
                                 _removal(widest, fit_doc, picked)))
    out.sort(key=lambda s: -s.removes)
    return out[:top]
