"""``orthrus-sim fit``: fit the cost factors (``orthrus_sim.costmodel.factors``) to what a
deployment measured, by simulation (docs/fitting.md).

Each measured run names a configuration of the scenario; the scenario is simulated with candidate
factors and every measured metric is compared with its simulated twin, as a log ratio. First
each parameter's effect on the metrics is measured at the prior (finite differences, one
simulation per parameter, in parallel through the sweep backend): a parameter whose effect is
too small, or no more than a combination of the others' (nothing in the measurements tells
them apart), is *undetermined*: it stays at its prior and is reported with its sensitivity,
instead of being fitted to noise. The others are fitted with scipy's bounded least squares
(``trf``), the Jacobian by the same parallel differences; the choice is checked again at the fit.
"""

from __future__ import annotations

import datetime
import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from orthrus_sim.costmodel import load_calibration
from orthrus_sim.costmodel.calibration import (
    CalibrationFile,
    FactorFitModel,
    FactorParameterModel,
    ResidualModel,
)
from orthrus_sim.costmodel.factors import CostFactors
from orthrus_sim.experiment.measured import MeasuredRun
from orthrus_sim.experiment.scenario import (
    Scenario,
)
from orthrus_sim.questions.evaluation import (
    BY_NAME,
    PARAMETERS,
    Evaluator,
    Parameter,
    factors_at,
    jacobian,
)
from orthrus_sim.questions.ranges import profile

DETERMINED = 0.05  # a unit change moving the metrics (norm of log ratios) less: undetermined
NOISE = 0.01  # floor of the metrics' scatter (log ratio) in the standard errors
SPREAD = 0.10  # the measurements' stated spread (relative), unless told


@dataclass
class FitResult:
    calibration: CalibrationFile
    residuals: list[dict]
    parameters: dict[str, dict]
    evaluations: int
    notes: list[str] = field(default_factory=list)
    misses: list[dict] = field(default_factory=list)  # metrics further than the spread
    tried: list[str] = field(default_factory=list)  # what the fit tried before giving up


def determined(jac: np.ndarray, names: list[str], limit: int) -> tuple[list[str], dict[str, float]]:
    """The parameters the measurements tell apart: greedily by effect, each kept only if what it
    adds beyond those kept already (the part of its column orthogonal to theirs) is at least
    ``DETERMINED``; at most ``limit`` (the number of measured metrics). Also each one's effect."""
    effect = {n: float(np.linalg.norm(jac[:, i])) for i, n in enumerate(names)}
    basis: list[np.ndarray] = []
    kept = []
    for i in sorted(range(len(names)), key=lambda i: -effect[names[i]]):
        col = jac[:, i].copy()
        for q in basis:
            col -= q * float(q @ col)
        norm = float(np.linalg.norm(col))
        if norm >= DETERMINED and len(kept) < limit:
            kept.append(names[i])
            basis.append(col / norm)
    return [n for n in names if n in kept], effect


def standard_errors(jac: np.ndarray, residuals: np.ndarray | None = None,
                    floor: float = NOISE) -> np.ndarray:
    """Each parameter's standard error (in z) from the Jacobian: the residuals' scatter (at
    least ``floor``, the measurements' spread; only ``floor`` without residuals) over the part
    of its column the others do not explain, i.e. sqrt of diag((J^T J)^-1) times the scatter;
    inf where that part is 0.

    Without residuals it says whether the measurements *can* pin a parameter (a 1 % error in
    every metric moves it by this much), whatever the fit's misfit."""
    m, k = jac.shape
    if k == 0:
        return np.zeros(0)
    sigma = floor
    if residuals is not None:
        sigma = math.sqrt(max(float(residuals @ residuals) / max(m - k, 1), floor ** 2))
    out = np.empty(k)
    for i in range(k):
        col, others = jac[:, i], np.delete(jac, i, axis=1)
        if others.shape[1]:
            coef = np.linalg.lstsq(others, col, rcond=None)[0]
            col = col - others @ coef
        norm = float(np.linalg.norm(col))
        out[i] = sigma / norm if norm > 1e-12 else math.inf
    return out


def fit(scenario: Scenario, runs: list[MeasuredRun], workers: int = 1,
        fixed: dict[str, float] | None = None, progress: Callable[[str], None] | None = None,
        max_rounds: int = 4, spread: float = SPREAD, ranges: bool = True) -> FitResult:
    """Fit the factors of ``PARAMETERS`` (less ``fixed``: name -> value) to ``runs``, each run
    simulated under its own scenario overrides (one joint fit across loads).

    The parameters with an effect at the prior (``determined``) are fitted, keeping only those
    the measurements pin (``_pinned_fit``); then each parameter left out is probed at a few
    values (``_probe``), and one that fits much better there joins the fit, from that value.
    A fit further than ``spread`` from a metric it was given tries harder (``_rescue``) and
    says so. ``ranges``: each parameter's ends as far as the measurements allow
    (``orthrus_sim.questions.ranges.profile``), for prediction ranges.
    """
    if not 0 < spread < 1:
        raise ValueError(f"--spread must be in (0, 1) (a relative spread such as 0.1), got {spread}")
    fixed = dict(fixed or {})
    for name in fixed:
        if name not in BY_NAME:
            raise ValueError(f"--fix {name}: unknown parameter; known: {', '.join(BY_NAME)}")
        p = BY_NAME[name]
        if not p.low <= fixed[name] <= p.high:
            raise ValueError(f"--fix {name}={fixed[name]}: outside its bounds [{p.low}, {p.high}]")
    prior_cal = load_calibration(scenario.calibration_file) if scenario.calibration_file else None
    prior = (prior_cal.cost_factors() if prior_cal else None) or CostFactors()
    prior = replace(prior, **fixed)
    for p in PARAMETERS:  # a prior outside the bounds (a hand-edited file) starts at the bound
        v = getattr(prior, p.name)
        prior = replace(prior, **{p.name: min(max(v, p.low), p.high)})
    free = [p.name for p in PARAMETERS if p.name not in fixed]
    say = progress or (lambda _msg: None)
    with tempfile.TemporaryDirectory(prefix="orthrus-fit-") as tmp, \
            Evaluator(scenario, prior_cal, runs, workers, Path(tmp)) as ev:
        say(f"sensitivities at the prior ({len(free) + 1} simulations)")
        z_prior = np.array([BY_NAME[n].to_z(getattr(prior, n)) for n in free])
        fitted, _ = determined(jacobian(ev, prior, free, z_prior), free, len(ev.targets))
        current, errors = prior, {}
        probed: set[str] = set()
        for _ in range(max_rounds):
            current, fitted, errors = _pinned_fit(ev, prior, current, fitted, say)
            # a parameter with no effect at its prior may still matter further out (a small
            # per-request overhead hides behind the device's queue, a large one shows): try
            # each once at a few values, and fit it from the best if that fits much better
            todo = [n for n in free if n not in fitted and n not in probed]
            probed.update(todo)
            found = _probe(ev, current, todo, fitted, say)
            if found is None:
                break
            name, value = found
            current = replace(current, **{name: value})
            fitted = [n for n in free if n in fitted or n == name]
        tried: list[str] = []
        if _misses(ev, current, spread):
            current, fitted, errors, tried = _rescue(ev, prior, current, fitted, free, spread, say)
        errors = _errors(ev, current, fitted, spread)  # at the measurements' stated spread
        say("sensitivity of each parameter across its bounds")
        sensitivity = _sensitivity(ev, current)
        sims = ev.simulate([current])[0]
        resid_rows = _residual_rows(ev, sims)
        params = {}
        for p in PARAMETERS:
            status = "fixed" if p.name in fixed else ("fitted" if p.name in fitted else "undetermined")
            params[p.name] = {"value": getattr(current, p.name), "prior": getattr(prior, p.name),
                              "bounds": (p.low, p.high), "status": status,
                              "sensitivity": sensitivity[p.name]}
            if p.name in fitted and p.name in errors:
                se = errors[p.name]
                params[p.name]["standard_error"] = (getattr(current, p.name) * se if p.log
                                                    else se * p.unit)
        logs = ev.residuals(sims)
        rms = float(np.sqrt(np.mean(logs ** 2))) if len(logs) else 0.0
        misses = _misses(ev, current, spread)
        ends, candidates = [], []
        if ranges:
            say("each parameter moved as far as the measurements allow")
            ends, candidates = profile(ev, current, fitted, free, spread, say)
        cal = _output(ev, current, runs, params, resid_rows, rms, scenario,
                      {"spread": spread, "misses": misses, "tried": tried, "range_ends": ends,
                       "candidates": candidates})
        notes = []
        if len(ev.targets) < len(fitted) + 1:
            notes.append(f"{len(ev.targets)} measured metrics for {len(fitted)} fitted parameters: "
                         "the fit reproduces them exactly and says nothing about its error")
        if misses:
            notes.append(f"the fit misses {len(misses)} of the {len(ev.targets)} metrics it was "
                         f"given by more than their spread ({spread:.0%}): "
                         + "; ".join(f"{_case_text(m)} {m['metric']} {m['residual']:+.1%}"
                                     if m["residual"] is not None else
                                     f"{_case_text(m)} {m['metric']} (not simulated)"
                                     for m in misses)
                         + ". Tried: " + "; ".join(tried or ["nothing else"])
                         + ". The cost model cannot reproduce these measurements as they stand "
                         "(another arrangement than the prior's, a cost no factor carries, or "
                         "runs measured under other settings than the scenario's)")
        notes += _trade_notes(ends, current)
        return FitResult(cal, resid_rows, params, len(ev.cache), notes, misses, tried)


def _trade_notes(ends: list, at: CostFactors) -> list[str]:
    """A fitted parameter that another one's end frees (``ranges._corners``): its value holds
    only while that other one stays near its fit, which its standard error does not say."""
    out = []
    for e in ends:
        name, unit = e.moved_too, " s" if e.parameter.endswith("_s") else ""
        if name is None:
            continue
        out.append(f"{name} = {getattr(at, name):.4g} holds only while {e.parameter} stays near "
                   f"{getattr(at, e.parameter):.4g}{unit}: with {e.parameter} = "
                   f"{e.factors[e.parameter]:.4g}{unit}, {name} = {e.factors[name]:.4g} fits the "
                   f"measurements as well ({'its bound' if e.at_bound else 'as far as they allow'}"
                   f"); the prediction ranges carry both, and `predict` suggests what tells them "
                   f"apart")
    return out


def _case_text(row: dict) -> str:
    return row["configuration"] + (f" at {', '.join(row['at'])}" if row.get("at") else "")


def _residual_rows(ev: Evaluator, sims: dict) -> list[dict]:
    rows = []
    for ((ov, cfg), metric, measured), s in zip(ev.targets, ev.simulated(sims)):
        rows.append({"configuration": cfg, "at": list(ov), "metric": metric, "measured": measured,
                     "simulated": s, "residual": (s / measured - 1) if s else None})
    return rows


def _misses(ev: Evaluator, at: CostFactors, spread: float) -> list[dict]:
    """The measured metrics the simulation at ``at`` is further from than ``spread``."""
    return [r for r in _residual_rows(ev, ev.simulate([at])[0])
            if r["residual"] is None or abs(math.log1p(r["residual"])) > math.log1p(spread)]


def _rms(ev: Evaluator, at: CostFactors) -> float:
    r = ev.residuals(ev.simulate([at])[0])
    return float(np.sqrt(np.mean(r ** 2))) if len(r) else 0.0


def _corner(p: Parameter, at: float, side: str) -> float:
    """A start far from ``at`` on one side, inside the bounds."""
    if p.log:
        value = at / 4 if side == "low" else at * 4
    elif p.name.endswith("_overhead_s"):
        value = 0.0 if side == "low" else max(0.05, 4 * at)
    else:
        value = p.low + 0.1 * (p.high - p.low) if side == "low" else p.high - 0.1 * (p.high - p.low)
    return min(max(value, p.low), p.high)


def _rescue(ev: Evaluator, prior: CostFactors, current: CostFactors, fitted: list[str],
            free: list[str], spread: float, say: Callable[[str], None]):
    """A fit that misses its inputs, tried harder: each parameter left out freed alone (from a
    few values), then the fitted ones restarted from far below and far above. The best fit
    found is kept if it fits better. Returns it, what it fits, standard errors and what was
    tried (each with its RMS log residual)."""
    best, best_fitted, best_rms = current, list(fitted), _rms(ev, current)
    tried = []
    for name in [n for n in free if n not in fitted]:
        say(f"missed inputs: freeing {name}")
        p = BY_NAME[name]
        outcome = math.inf
        for start in dict.fromkeys([getattr(current, name), *_probe_values(p, getattr(current, name))]):
            names = [*fitted, name]
            res = _least_squares(ev, replace(current, **{name: start}), names, max_nfev=8)
            f = factors_at(replace(current, **{name: start}), names, res.x)
            rms = _rms(ev, f)
            outcome = min(outcome, rms)
            if rms < best_rms - 1e-4:
                best, best_fitted, best_rms = f, [n for n in free if n in names], rms
        tried.append(f"{name} freed (RMS {outcome:.3f})")
    starts = [] if not fitted else [
        (f"from far {'below' if side == 'low' else 'above'}",
         replace(current, **{n: _corner(BY_NAME[n], getattr(current, n), side) for n in fitted}))
        for side in ("low", "high")]
    # a per-request overhead trades against a scale along a narrow valley: restart it elsewhere
    starts += [(f"with {n} = {v:g} s", replace(current, **{n: v})) for n in fitted
               if n.endswith("_overhead_s") for v in _probe_values(BY_NAME[n], getattr(current, n))]
    for label, start in starts:
        say(f"missed inputs: restarting {', '.join(fitted)} {label}")
        res = _least_squares(ev, start, fitted, max_nfev=10)
        f = factors_at(start, fitted, res.x)
        rms = _rms(ev, f)
        tried.append(f"{', '.join(fitted)} restarted {label} (RMS {rms:.3f})")
        if rms < best_rms - 1e-4:
            best, best_fitted, best_rms = f, list(fitted), rms
    if best is current:
        best, best_fitted, errors = current, fitted, _errors(ev, current, fitted)
    else:
        best, best_fitted, errors = _pinned_fit(ev, prior, best, best_fitted, say)
    return best, best_fitted, errors, tried


def _errors(ev: Evaluator, at: CostFactors, fitted: list[str],
            floor: float = NOISE) -> dict[str, float]:
    """The fitted parameters' standard errors (in z) at ``at``, for measurements whose
    spread is at least ``floor``."""
    z = np.array([BY_NAME[n].to_z(getattr(at, n)) for n in fitted])
    jac = jacobian(ev, at, fitted, z)
    r = ev.residuals(ev.simulate([at])[0])
    return {n: float(e) for n, e in zip(fitted, standard_errors(jac, r, floor))}


def _pinned_fit(ev: Evaluator, prior: CostFactors, current: CostFactors, fitted: list[str],
                say: Callable[[str], None]) -> tuple[CostFactors, list[str], dict[str, float]]:
    """Fit ``fitted`` from ``current`` (the rest at the prior); while one is not pinned by the
    measurements (a 1 % error in them moves it by more than its tolerance), return the worst
    to its prior and refit the rest. Returns the fit, what stayed fitted, standard errors."""
    fitted = list(fitted)
    while fitted:
        say(f"fitting {', '.join(fitted)}")
        base = replace(prior, **{n: getattr(current, n) for n in fitted})
        res = _least_squares(ev, base, fitted)
        current = factors_at(base, fitted, res.x)
        jac = jacobian(ev, current, fitted, res.x)
        pinning = {n: float(e) for n, e in zip(fitted, standard_errors(jac))}
        errors = {n: float(e) for n, e in zip(fitted, standard_errors(jac, res.fun))}
        worst = max(fitted, key=lambda n: pinning[n] / BY_NAME[n].tolerance)
        if pinning[worst] <= BY_NAME[worst].tolerance:
            return current, fitted, errors
        say(f"{worst} is not pinned by the measurements (a 1 % error in them moves it by "
            f"{pinning[worst]:.3g} > {BY_NAME[worst].tolerance:g}): back to its prior")
        fitted.remove(worst)
        current = replace(current, **{worst: getattr(prior, worst)})
    return prior, [], {}


PROBE_GAIN = 0.8  # a probe is taken when its squared residuals are below this share of the fit's


def _probe_values(p: Parameter, at: float) -> list[float]:
    """A few values across a parameter's range (overheads log-spaced from 2 ms)."""
    if p.log:
        return [at * f for f in (0.25, 4.0) if p.low <= at * f <= p.high]
    if p.name.endswith("_overhead_s"):
        return [0.005, 0.05, 0.25]
    return [p.low, p.high]


def _probe(ev: Evaluator, at: CostFactors, names: list[str], fitted: list[str],
           say: Callable[[str], None]) -> tuple[str, float] | None:
    """The (parameter, value) that lowers the squared residuals most, if below ``PROBE_GAIN``
    of theirs at ``at``: a brief fit of it and ``fitted`` from each of a few starting values
    of it (a hidden parameter often trades against a fitted one, a per-request overhead
    against a scale)."""
    if not names:
        return None
    r0 = ev.residuals(ev.simulate([at])[0])
    base = float(np.sum(r0 ** 2))
    best, best_cost = None, PROBE_GAIN * base
    for name in names:
        values = _probe_values(BY_NAME[name], getattr(at, name))
        sims = ev.simulate([replace(at, **{name: v}) for v in values])
        if all(np.array_equal(ev.residuals(x), r0) for x in sims):
            continue  # no effect anywhere on these measurements
        say(f"probing {name}")
        for value in values:
            res = _least_squares(ev, replace(at, **{name: value}), [*fitted, name], max_nfev=4)
            if 2 * res.cost < best_cost:
                best, best_cost = (name, BY_NAME[name].from_z(float(res.x[-1]))), 2 * res.cost
    if best is not None:
        say(f"{best[0]} = {best[1]:.4g} fits better: fitting it too")
    return best


def _least_squares(ev: Evaluator, base: CostFactors, names: list[str], max_nfev: int = 30):
    """Bounded least squares over ``names`` from ``base``, log-ratio residuals."""
    z0 = np.array([BY_NAME[n].to_z(getattr(base, n)) for n in names])
    lo = np.array([BY_NAME[n].z_bounds[0] for n in names])
    hi = np.array([BY_NAME[n].z_bounds[1] for n in names])
    return least_squares(
        lambda z: ev.residuals(ev.simulate([factors_at(base, names, z)])[0]), z0,
        jac=lambda z: jacobian(ev, base, names, z), bounds=(lo, hi), method="trf",
        x_scale=1.0, xtol=1e-4, ftol=1e-6, gtol=1e-8, max_nfev=max_nfev)


def _sensitivity(ev: Evaluator, at: CostFactors) -> dict[str, float]:
    """Per parameter: the largest relative change of a measured metric with the parameter at
    its lower or upper bound (the others at ``at``)."""
    points = [at]
    for p in PARAMETERS:
        points += [replace(at, **{p.name: p.low}), replace(at, **{p.name: p.high})]
    sims = ev.simulate(points)
    base = ev.simulated(sims[0])
    out = {}
    for i, p in enumerate(PARAMETERS):
        worst = 0.0
        for s in sims[1 + 2 * i: 3 + 2 * i]:
            for b, v in zip(base, ev.simulated(s)):
                if b and v:
                    worst = max(worst, abs(v / b - 1))
                elif b or v:
                    worst = math.inf
        out[p.name] = worst
    return out


def _output(ev: Evaluator, factors: CostFactors, runs: list[MeasuredRun], params: dict,
            resid_rows: list[dict], rms: float, scenario: Scenario, extra: dict) -> CalibrationFile:
    base = ev.calibration(factors)
    fit_doc = FactorFitModel(
        scenario=scenario.name, measured=list(dict.fromkeys(r.source for r in runs)),
        prior=_shown(scenario.calibration_file),
        parameters={k: FactorParameterModel(
            **{**v, "sensitivity": v["sensitivity"] if math.isfinite(v["sensitivity"]) else 1e9})
            for k, v in params.items()},
        residuals=[ResidualModel(**r) for r in resid_rows], rms_residual=rms,
        evaluations=len(ev.cache), spread=extra["spread"],
        misses=[ResidualModel(**r) for r in extra["misses"]], tried=extra["tried"],
        range_ends=extra["range_ends"], candidates=extra["candidates"])
    return base.model_copy(update={"factor_fit": fit_doc,
                                   "created": datetime.date.today().isoformat()})


def _shown(path: str | None) -> str | None:
    """A path as recorded: relative to the current folder when inside it."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def fit_json(result: FitResult) -> str:
    """The report as JSON (``--format json``)."""
    fit_doc = result.calibration.factor_fit
    return json.dumps({"parameters": result.parameters, "residuals": result.residuals,
                       "evaluations": result.evaluations, "notes": result.notes,
                       "misfit": bool(result.misses), "misses": result.misses,
                       "tried": result.tried, "spread": fit_doc.spread if fit_doc else None,
                       "range_ends": [e.model_dump() for e in fit_doc.range_ends] if fit_doc else []},
                      indent=2, default=str)
