"""A fit's parameter ranges: each cost factor moved as far as the fit's measurements allow (the
fitted ones refitted), the ends ``predict`` simulates a prediction's extremes at
(docs/fitting.md, "Prediction ranges").

A move is allowed while the sum of squared log residuals grows by no more than
``(Z * spread)^2``: for measurements with a relative spread ``spread`` that is a ``Z``-sigma
move of one parameter, the others refitted (a profile of the fit's misfit). A fitted
parameter's ends come from the fit's Jacobian (a linear profile; the fitted ones move with it
as the Jacobian says they would refit); a parameter the fit left undetermined is moved to its
bound, or halfway back while that grows the misfit too much, the fitted ones refitted
(``Trials``); where the measurements stopped it, the fitted ones are moved on from there
(``_corners``: an overhead that binds frees the scale it hid). Every end is then simulated once,
which records its actual misfit growth and the measured configurations' other metrics there
(the candidates of ``predict.suggest``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from orthrus_sim.costmodel.calibration import CandidateModel, RangeEndModel
from orthrus_sim.costmodel.factors import CostFactors
from orthrus_sim.experiment.measured import ITERATION_RATE
from orthrus_sim.questions.evaluation import (
    BY_NAME,
    Evaluator,
    factors_at,
    jacobian,
    jacobians,
    metric_value,
)

Z = 2.0  # ends at a 2-sigma move of one parameter
BISECT = 2  # halvings towards an undetermined parameter's farthest allowed value
REFIT_STEPS = 1  # more Gauss-Newton steps (its own updated Jacobian) for a trial past the budget
SHRINK = 1.5  # a simulated end this far above the allowed growth is pulled in once

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


class Trials:
    """Factor sets with one parameter set to a value and the fitted ones refitted: one
    Gauss-Newton step on the fit's Jacobian, then, while the misfit still grows past the
    budget, up to ``REFIT_STEPS`` more, each on the Jacobian updated by the trial's own last
    step (``_updated``: a per-request overhead hides behind the device until it binds, so the
    fit's Jacobian cannot say how far a scale must give way to it; the step shows it, at one
    simulation where a new Jacobian costs one per fitted parameter), or on a fresh one where a
    step gained nothing. Simulated in batches; the best point of each kept."""

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
        return self.run_from([replace(self.at, **{n: v}) for n, v in moves])

    def run_from(self, first: list[CostFactors]) -> list[tuple[CostFactors, float]]:
        """(factors, misfit growth) from each start, the fitted ones refitted (the start's
        values of them are where the step begins)."""
        r1 = [self.ev.residuals(s) for s in self.ev.simulate(first)]
        best = [(f, _ssr(r)) for f, r in zip(first, r1)]
        if self.fitted:
            # a start that changes no measured metric from the fit needs no refit, nor one
            # already within a (finite) budget: the move is allowed as it stands
            r_at = self.ev.residuals(self.ev.simulate([self.at])[0])
            todo = [i for i in range(len(first)) if not np.array_equal(r1[i], r_at)
                    and not best[i][1] - self.ssr0 <= self.budget < math.inf]
            points = self._step([first[i] for i in todo], [r1[i] for i in todo],
                                [self.jac] * len(todo))
            last = {i: (first[i], r1[i], self.jac) for i in todo}  # each trial's last point
            for step in range(REFIT_STEPS + 1):
                stalled = set()  # trials whose step gained nothing: their Jacobian misled it
                for i, f, s in zip(todo, points, self.ev.simulate(points)):
                    r = self.ev.residuals(s)
                    c = _ssr(r)
                    last[i] = (f, r, _updated(*last[i], f, r, self.fitted))
                    if c < best[i][1]:
                        best[i] = (f, c)
                    else:
                        stalled.add(i)
                todo = [i for i in todo if best[i][1] - self.ssr0 > self.budget]
                if step == REFIT_STEPS or not todo:
                    break
                # a stalled trial takes a fresh Jacobian where it stands (an overhead hidden
                # where the fit was has no column there, and a step along none updates none)
                fresh = [i for i in todo if i in stalled]
                for i, (r, jac) in zip(fresh, jacobians(self.ev, [best[i][0] for i in fresh],
                                                        self.fitted)):
                    last[i] = (best[i][0], r, jac)
                points = self._step([last[i][0] for i in todo], [last[i][1] for i in todo],
                                    [last[i][2] for i in todo])
        return [(f, c - self.ssr0) for f, c in best]


def _updated(f0: CostFactors, r0: np.ndarray, jac: np.ndarray, f1: CostFactors, r1: np.ndarray,
             names: list[str]) -> np.ndarray:
    """``jac`` updated by the step from ``f0`` to ``f1`` (Broyden's rank-one update: the
    residuals' change along the step, which a refit's next step then trusts instead of a
    finite difference per parameter)."""
    step = np.array([BY_NAME[n].to_z(getattr(f1, n)) - BY_NAME[n].to_z(getattr(f0, n))
                     for n in names])
    norm = float(step @ step)
    if norm < 1e-12:
        return jac
    return jac + np.outer(r1 - r0 - jac @ step, step) / norm


def _midpoint(name: str, near: float, far: float) -> float:
    """Halfway in the parameter's own scale (geometric for scales and for an overhead moving up
    from a few milliseconds)."""
    p = BY_NAME[name]
    if p.log:
        return math.sqrt(near * far)
    if p.name.endswith("_overhead_s") and far > near:
        return math.sqrt(max(near, 0.001) * far)
    return (near + far) / 2


def _refitted_ends(trials: Trials, names: list[str], budget: float, say: Callable[[str], None],
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


def _corners(trials: Trials, ends: dict[tuple[str, str], tuple[CostFactors, bool]],
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
        traded = [n for n in fitted if BY_NAME[n].trades_with(BY_NAME[key[0]])]
        if bound or f == trials.at or not traded:
            continue
        # the end's own column (the fit's has none for it: the measurements did not see it
        # there), beside the fit's columns of the others; the refits' updates correct them
        column = jacobians(trials.ev, [f], [key[0]])[0][1]
        for name in traded:
            refit = [n for n in fitted if n != name] + [key[0]]
            jac_f = np.column_stack([trials.jac[:, fitted.index(n)] for n in refit[:-1]]
                                    + [column[:, 0]])
            inner = Trials(trials.ev, f, refit, jac_f, budget, trials.ssr0)
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
    trials = Trials(ev, at, fitted, jac, budget)
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
