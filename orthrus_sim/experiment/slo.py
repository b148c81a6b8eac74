"""SLO attainment and goodput: whether a request met the scenario's SLOs, tallied per kind.

The convention of vLLM's ``bench serve --goodput`` and DistServe. A request *meets* its kind's
SLOs when it finished and every bound given for its kind holds: ``ttft_s`` (arrival to first
token), ``tpot_s`` ((e2e - ttft) / (output tokens - 1), as vLLM computes it; a one-token output
has no TPOT and meets it) and ``e2e_s`` for generation, ``latency_s`` for embedding. A rejected
request misses.

* **goodput**: requests that finished in the window and met their SLOs, per second of window
  (as throughput counts finished requests);
* **attainment**: of the requests that arrived in the window, the fraction that met their SLOs.
  A run cut at ``duration_s`` leaves requests in flight; counting them as missed would punish
  the last seconds, leaving them out would flatter it. So a request is counted when its fate is
  known by the end whatever it is: its *deadline* (arrival + ``latency_s`` or ``e2e_s``, or
  arrival + ``ttft_s`` + ``tpot_s`` x (max output - 1), the latest a compliant request ends) is
  in the window. The choice rests on arrival times and lengths only, never on outcomes, so it
  does not bias the fraction; what it leaves out is ``late``. A kind with no deadline (only
  ``tpot_s``, or no bound) counts every arrival; one still in flight at the end counts as missed
  when a bound is already broken, else as ``undetermined`` (a warning past 1 %). A run to
  completion (no ``duration_s``) knows every fate: nothing is late.
* **worst stretch**: per kind, the lowest attainment over any ``STRETCH_S`` (5 minutes) of
  arrivals, slid a minute at a time over the window (the whole window where it is shorter): a
  load that moves can meet its SLOs over an hour and miss them for the minutes of its peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orthrus_sim.engine.request import Request, RequestState

if TYPE_CHECKING:
    from orthrus_sim.experiment.scenario import SloSection

KINDS = ("embedding", "generation")
EPS = 1e-9
ATTAINMENT_EPS = 1e-12  # an attainment this close below a required floor still meets it
STRETCH_S = 300.0  # the worst stretch's length
STEP_S = 60.0  # and the step it slides by


def request_tpot(req: Request) -> float | None:
    """vLLM's time per output token of a finished generation: (e2e - ttft) / (outputs - 1);
    None for one output token (no inter-token time) or no first token."""
    if req.first_token_at is None or req.finished_at is None or req.num_generated < 2:
        return None
    return (req.finished_at - req.first_token_at) / (req.num_generated - 1)


def within(req: Request, bounds: dict[str, float]) -> dict[str, bool]:
    """Per bound, whether a finished request holds it."""
    out = {}
    for name, bound in bounds.items():
        if name in ("latency_s", "e2e_s"):
            out[name] = req.finished_at - req.arrival_time <= bound + EPS
        elif name == "ttft_s":
            out[name] = (req.first_token_at is not None
                         and req.first_token_at - req.arrival_time <= bound + EPS)
        else:  # tpot_s
            tpot = request_tpot(req)
            out[name] = (tpot is None and req.first_token_at is not None) or \
                (tpot is not None and tpot <= bound + EPS)
    return out


def deadline(req: Request, bounds: dict[str, float]) -> float | None:
    """The latest time a request meeting ``bounds`` finishes (None: no bound gives one)."""
    ends = [req.arrival_time + bounds[n] for n in ("latency_s", "e2e_s") if n in bounds]
    if "ttft_s" in bounds and "tpot_s" in bounds:
        ends.append(req.arrival_time + bounds["ttft_s"]
                    + bounds["tpot_s"] * max(req.max_output_tokens - 1, 0))
    return min(ends) if ends else None


def broken(req: Request, bounds: dict[str, float], now: float) -> bool:
    """Whether a request still in flight at ``now`` already broke a bound."""
    age = now - req.arrival_time
    for name, bound in bounds.items():
        if name in ("latency_s", "e2e_s") and age > bound + EPS:
            return True
        if name == "ttft_s":
            first = req.first_token_at
            if (first is None and age > bound + EPS) or \
                    (first is not None and first - req.arrival_time > bound + EPS):
                return True
        if name == "tpot_s" and req.first_token_at is not None and req.max_output_tokens > 1:
            # it ends after now with at most max_output_tokens outputs: its TPOT is above this
            if (now - req.first_token_at) / (req.max_output_tokens - 1) > bound + EPS:
                return True
    return False


class SloTally:
    """Counts, per kind, requests that met or missed the SLOs (see the module docstring).

    ``start``: the window's start; ``end_hint``: its end when known in advance (a run by
    duration), None for a run to completion."""

    def __init__(self, slo: SloSection, start: float, end_hint: float | None) -> None:
        self.slo = slo
        self.start = start
        self.end_hint = end_hint
        self.bounds = {k: slo.bounds(k) for k in KINDS}
        self.met = dict.fromkeys(KINDS, 0)
        self.missed = dict.fromkeys(KINDS, 0)
        self.late = dict.fromkeys(KINDS, 0)
        self.good = dict.fromkeys(KINDS, 0)  # finished in the window and met: goodput
        self.finished = dict.fromkeys(KINDS, 0)  # arrived in the window and finished
        self.held = {k: dict.fromkeys(self.bounds[k], 0) for k in KINDS}
        # per kind, per minute of arrival since the window's start: [met, counted]
        self.minutes: dict[str, dict[int, list[int]]] = {k: {} for k in KINDS}

    def _minute(self, req: Request, met: bool) -> None:
        slot = self.minutes[req.kind.value].setdefault(
            int((req.arrival_time - self.start) // STEP_S), [0, 0])
        slot[0] += met
        slot[1] += 1

    def _counted(self, req: Request, bounds: dict[str, float], end: float | None) -> bool:
        if end is None:
            return True
        due = deadline(req, bounds)
        return due is None or due <= end + EPS

    def ended(self, req: Request) -> None:
        """A request finished or was rejected (within the window's end, if one is known)."""
        kind = req.kind.value
        bounds = self.bounds[kind]
        ok = False
        if req.state is RequestState.FINISHED:
            checks = within(req, bounds)
            ok = all(checks.values())
            if ok and req.finished_at >= self.start - EPS:
                self.good[kind] += 1
            if req.arrival_time >= self.start - EPS:
                self.finished[kind] += 1
                for name, held in checks.items():
                    self.held[kind][name] += held
        if req.arrival_time < self.start - EPS:
            return
        if not self._counted(req, bounds, self.end_hint):
            self.late[kind] += 1
        elif ok:
            self.met[kind] += 1
            self._minute(req, True)
        else:
            self.missed[kind] += 1
            self._minute(req, False)

    def close(self, outstanding: list[Request], end: float, window: float) -> dict:
        """The ``slo`` block of the metrics; ``outstanding``: requests in flight at ``end``."""
        undetermined = dict.fromkeys(KINDS, 0)
        missed, late = dict(self.missed), dict(self.late)
        for req in outstanding:
            kind = req.kind.value
            if req.arrival_time < self.start - EPS:
                continue
            bounds = self.bounds[kind]
            if self.end_hint is not None and not self._counted(req, bounds, end):
                late[kind] += 1
            elif deadline(req, bounds) is not None or broken(req, bounds, end):
                missed[kind] += 1  # past its deadline (or a bound) and not finished
                self._minute(req, False)
            else:
                undetermined[kind] += 1
        out: dict = {"targets": {k: dict(self.bounds[k]) for k in KINDS}}
        for k in KINDS:
            counted = self.met[k] + missed[k]
            out[k] = {
                "attainment": self.met[k] / counted if counted else None,
                "goodput_rps": self.good[k] / window,
                "met": self.met[k], "missed": missed[k], "late": late[k],
                "undetermined": undetermined[k],
                "within": {n: (h / self.finished[k] if self.finished[k] else None)
                           for n, h in self.held[k].items()},
                "worst_stretch": worst_stretch(self.minutes[k], self.start),
            }
        met, counted = sum(self.met.values()), sum(self.met.values()) + sum(missed.values())
        out["combined"] = {"attainment": met / counted if counted else None,
                           "goodput_rps": sum(self.good.values()) / window}
        return out


def worst_stretch(minutes: dict[int, list[int]], start: float) -> dict | None:
    """The lowest attainment over ``STRETCH_S`` of arrivals, slid ``STEP_S`` at a time
    (``{attainment, start_s, counted}``; None: nothing counted)."""
    if not minutes:
        return None
    span = round(STRETCH_S / STEP_S)
    first, last = min(minutes), max(minutes)
    worst = None
    for m in range(first, max(first, last - span + 1) + 1):
        met = counted = 0
        for i in range(m, m + span):
            slot = minutes.get(i)
            if slot:
                met, counted = met + slot[0], counted + slot[1]
        if counted and (worst is None or met / counted < worst["attainment"]):
            worst = {"attainment": met / counted, "start_s": start + m * STEP_S,
                     "counted": counted}
    return worst


def slo_warnings(metrics: dict) -> list[str]:
    """Attainment resting on few requests, or leaving many out as undetermined."""
    slo = metrics.get("slo")
    if not slo:
        return []
    out = []
    for kind in KINDS:
        s = slo[kind]
        arrived = metrics["arrived_in_window"].get(kind, 0)
        if arrived and s["undetermined"] > 0.01 * arrived:
            out.append(f"{s['undetermined']} of {arrived} {kind} requests that arrived in the "
                       "window were still in flight at its end with no SLO yet broken: their "
                       "kind's SLOs give no deadline (add e2e_s or latency_s), so the attainment "
                       "leaves them out")
    return out
