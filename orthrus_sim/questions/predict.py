"""A prediction and how sure it is: each configuration simulated at the calibration's factors
and at every end of its fit's parameter ranges (``ranges``), widened by its own sampling spread
over other seeds, and the one extra measurement (or run) that would narrow the widest range
most (docs/fitting.md, "Prediction ranges"). ``orthrus-sim predict``."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from orthrus_sim.costmodel.calibration import CalibrationFile, RangeEndModel
from orthrus_sim.costmodel.factors import CostFactors
from orthrus_sim.experiment.results import _get
from orthrus_sim.experiment.scenario import Scenario
from orthrus_sim.questions.evaluation import Simulations
from orthrus_sim.questions.ranges import Z

SEEDS = 64  # other seeds a predicted configuration runs under at most: its spread and its mean
FIRST_SEEDS = 8  # ... at least (more while its mean's spread hides the parameters' part)
PRECISION = 0.01  # a mean's 2-sd spread (of its log) that needs no more seeds
PREDICTED = ("throughput_rps.embedding", "throughput_rps.generation", "latency_s.embedding.p50",
             "latency_s.generation.p50", "latency_s.ttft.p99", "latency_s.tpot.p99")


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
