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
    jacobians,
)
from orthrus_sim.questions.ranges import Trials, profile

DETERMINED = 0.05  # a unit change moving the metrics (norm of log ratios) less: undetermined
DAMPING = 1e-2  # Levenberg-Marquardt's first damping, relative to the normal matrix's diagonal
FTOL = 1e-3  # a step gaining less of the misfit than this share ends the least squares
# (a simulation's metrics jump by a few tenths of a per cent as the factors move: below
# that, steps chase the jumps)
XTOL = 1e-3  # ... and one moving every parameter less than this (in z) on a fresh Jacobian
MAX_STEP = 1.5  # the longest step of one parameter, in z (an e^1.5 of a scale, 15 ms)
REFUSALS = 3  # failed steps in a row on a fresh Jacobian that end the least squares
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
    simulations: int = 0  # simulations run (``evaluations``: factor sets, each all the runs)


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
            moved = [n for n in todo if getattr(found, n) != getattr(current, n)]
            current = found
            fitted = [n for n in free if n in fitted or n in moved]
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
        return FitResult(cal, resid_rows, params, len(ev.cache), notes, misses, tried,
                         ev.simulations)


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
    """A fit that misses its inputs, tried harder: each parameter left out freed alone (at a
    few values), the overheads left out freed together (on a shared front end they show only
    together), the fitted ones restarted from far below and far above (and an overhead among
    them from a few values: it trades against a scale along a narrow valley). Every start is
    refitted by one step on the fit's Jacobian, all in two batches; the least squares then
    runs from the best, which is kept if it fits better. Returns it, what it fits, standard
    errors and what was tried (each with the RMS log residual its start reached)."""
    best, best_fitted, best_rms = current, list(fitted), _rms(ev, current)
    left = [n for n in free if n not in fitted]
    starts: list[tuple[str, tuple[str, ...], CostFactors]] = [
        (f"{n} freed", (n,), replace(current, **{n: v})) for n in left
        for v in _probe_values(BY_NAME[n], getattr(current, n))]
    # overheads paid on one shared front end queue the kinds behind each other: only
    # together do they show, so they are freed together too
    hidden = tuple(n for n in left if n.endswith("_overhead_s"))
    if len(hidden) > 1:
        starts += [(f"{', '.join(hidden)} freed together", hidden,
                    replace(current, **dict.fromkeys(hidden, v))) for v in JOINT_OVERHEADS_S]
    if fitted:
        starts += [(f"{', '.join(fitted)} restarted from far "
                    f"{'below' if side == 'low' else 'above'}", (),
                    replace(current, **{n: _corner(BY_NAME[n], getattr(current, n), side)
                                        for n in fitted})) for side in ("low", "high")]
        starts += [(f"{', '.join(fitted)} restarted with {n} = {v:g} s", (),
                    replace(current, **{n: v})) for n in fitted if n.endswith("_overhead_s")
                   for v in _probe_values(BY_NAME[n], getattr(current, n))]
    say(f"missed inputs: {len(starts)} other starts")
    trials = _fit_trials(ev, current, fitted)
    outcomes = trials.run_from([f for _, _, f in starts])
    reached: dict[str, float] = {}
    for (label, _, _), (_, growth) in zip(starts, outcomes):
        rms = math.sqrt(max(trials.ssr0 + growth, 0.0) / max(len(ev.targets), 1))
        reached[label] = min(reached.get(label, math.inf), rms)
    tried = [f"{label} (RMS {rms:.3f})" for label, rms in reached.items()]
    (label, freed, _), (start, growth) = min(zip(starts, outcomes), key=lambda s: s[1][1],
                                             default=(("", (), current), (current, 0.0)))
    if growth < 0:
        names = [n for n in free if n in fitted or n in freed]
        say(f"missed inputs: fitting {', '.join(names)} from the best start ({label})")
        res = _least_squares(ev, start, names, max_nfev=8)
        f = factors_at(start, names, res.x)
        if _rms(ev, f) < best_rms - 1e-4:
            best, best_fitted = f, names
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
    start_jac = None  # after parameters leave: the last Jacobian without their columns
    while fitted:
        say(f"fitting {', '.join(fitted)}")
        base = replace(prior, **{n: getattr(current, n) for n in fitted})
        res = _least_squares(ev, base, fitted, jac0=start_jac)
        current = factors_at(base, fitted, res.x)
        jac = jacobian(ev, current, fitted, res.x)
        kept = list(fitted)
        # the worst-pinned leaves and the rest are judged again on the same Jacobian (a
        # parameter's pinning depends on which others are fitted beside it), so one refit
        # serves every parameter that leaves
        while kept:
            cols = [fitted.index(n) for n in kept]
            pinning = dict(zip(kept, (float(e) for e in standard_errors(jac[:, cols]))))
            worst = max(kept, key=lambda n: pinning[n] / BY_NAME[n].tolerance)
            if pinning[worst] <= BY_NAME[worst].tolerance:
                break
            general = BY_NAME[worst].specialises
            if general in kept and pinning[general] > BY_NAME[general].tolerance:
                # a stock server's own term and the one every server pays, neither pinned: the
                # cost is the stock server's (the only one seen paying it); the other's range
                # carries every server paying it
                worst = general
            say(f"{worst} is not pinned by the measurements (a 1 % error in them moves it by "
                f"{pinning[worst]:.3g} > {BY_NAME[worst].tolerance:g}): back to its prior")
            kept.remove(worst)
        if kept == fitted:
            errors = {n: float(e) for n, e in zip(fitted, standard_errors(jac, res.fun))}
            return current, fitted, errors
        start_jac = jac[:, [fitted.index(n) for n in kept]]
        current = replace(current, **{n: getattr(prior, n) for n in fitted if n not in kept})
        fitted = kept
    return prior, [], {}


JOINT_OVERHEADS_S = (0.01, 0.05)  # where a missed fit frees every hidden overhead together
PROBE_GAIN = 0.8  # a probe is taken when its squared residuals are below this share of the fit's


def _probe_values(p: Parameter, at: float) -> list[float]:
    """A few values across a parameter's range (overheads log-spaced from 2 ms)."""
    if p.log:
        return [at * f for f in (0.25, 4.0) if p.low <= at * f <= p.high]
    if p.name.endswith("_overhead_s"):
        return [0.005, 0.05, 0.25]
    return [p.low, p.high]


def _probe(ev: Evaluator, at: CostFactors, names: list[str], fitted: list[str],
           say: Callable[[str], None]) -> CostFactors | None:
    """Where a parameter left out fits much better: each of ``names`` set to a few values
    (``_probe_values``) with the fitted ones refitted by one Gauss-Newton step on the fit's
    Jacobian (a hidden parameter often trades against a fitted one, a per-request overhead
    against a scale), all in two batches of simulations. The best such factor set, if its
    squared residuals are below ``PROBE_GAIN`` of the fit's, else None."""
    if not names:
        return None
    say(f"probing {', '.join(names)}")
    trials = _fit_trials(ev, at, fitted)
    moves = [(n, v) for n in names for v in _probe_values(BY_NAME[n], getattr(at, n))]
    best = min(zip(moves, trials.run(moves)), key=lambda m: m[1][1], default=None)
    if best is None or trials.ssr0 + best[1][1] >= PROBE_GAIN * trials.ssr0:
        return None
    (name, value), (found, _) = best
    say(f"{name} = {value:.4g} fits better: fitting it too")
    return found


def _fit_trials(ev: Evaluator, at: CostFactors, fitted: list[str]) -> Trials:
    """Trial factor sets from ``at``, the fitted ones refitted by one step on its Jacobian."""
    z = np.array([BY_NAME[n].to_z(getattr(at, n)) for n in fitted])
    jac = jacobian(ev, at, fitted, z) if fitted else np.zeros((len(ev.targets), 0))
    return Trials(ev, at, fitted, jac)


@dataclass
class Solution:
    """Where a least-squares fit ended: z, the log residuals there and half their squares."""

    x: np.ndarray
    fun: np.ndarray
    cost: float
    points: int  # factor sets it simulated (finite differences included)


def _least_squares(ev: Evaluator, base: CostFactors, names: list[str], max_nfev: int = 30,
                   jac0: np.ndarray | None = None) -> Solution:
    """Bounded least squares over ``names`` from ``base``, log-ratio residuals: Levenberg-
    Marquardt in z, steps clipped to the bounds.

    A simulation is what a fit pays for, so the Jacobian is taken by finite differences
    (``jacobian``: one simulation per parameter) only at the start and when a step on the
    current one fails; after an accepted step it is updated from that step alone (Broyden's
    rank-one update), so most iterations cost one simulation of the measured runs rather
    than one per parameter. Stops when a step gains under ``FTOL`` of the misfit, moves under
    ``XTOL`` in z on a fresh Jacobian, or after ``max_nfev`` steps. ``jac0``: a Jacobian taken
    near ``base`` to start from (a refit after a parameter left), treated as an update's."""
    lo = np.array([BY_NAME[n].z_bounds[0] for n in names])
    hi = np.array([BY_NAME[n].z_bounds[1] for n in names])
    z = np.clip(np.array([BY_NAME[n].to_z(getattr(base, n)) for n in names]), lo, hi)
    if jac0 is None:
        r, jac = jacobians(ev, [base], names, [z])[0]
        points, fresh = 1 + len(names), True
    else:
        r, jac = ev.residuals(ev.simulate([factors_at(base, names, z)])[0]), jac0
        points, fresh = 1, False
    cost, damping, refused = 0.5 * float(r @ r), DAMPING, 0
    for _ in range(max_nfev):
        normal, gradient = jac.T @ jac, jac.T @ r
        step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-9), -gradient)
        step *= min(1.0, MAX_STEP / max(float(np.max(np.abs(step), initial=0.0)), 1e-12))
        z_new = np.clip(z + step, lo, hi)
        moved = z_new - z
        promised = -float(gradient @ moved) - 0.5 * float(moved @ normal @ moved)
        if float(np.max(np.abs(moved), initial=0.0)) < XTOL or promised < FTOL * cost:
            if fresh:
                break  # the model promises nothing more: at the fit (or at the noise)
            r, jac = jacobians(ev, [base], names, [z])[0]
            points, fresh = points + len(names), True
            continue
        r_new = ev.residuals(ev.simulate([factors_at(base, names, z_new)])[0])
        points += 1
        cost_new = 0.5 * float(r_new @ r_new)
        if cost_new < cost:
            jac = jac + np.outer(r_new - r - jac @ moved, moved) / float(moved @ moved)
            gain = cost - cost_new
            z, r, cost, fresh, refused = z_new, r_new, cost_new, False, 0
            damping = max(damping / 3, 1e-6)
            if gain < FTOL * (cost + gain):
                break
        elif not fresh:  # the updated Jacobian misled the step: take it afresh here
            r, jac = jacobians(ev, [base], names, [z])[0]
            points, fresh = points + len(names), True
        else:
            damping, refused = damping * 4, refused + 1
            if refused == REFUSALS:
                break  # steps on a fresh Jacobian keep failing: the misfit is at its noise
    return Solution(z, r, cost, points)


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
