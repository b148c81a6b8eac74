"""Capacity search: per configuration, the highest offered open-loop rate that meets the SLOs,
and the fewest GPUs that serve a given rate of each kind.

Both search over simulator runs of the scenario with its open-loop pools scaled (the mix kept):
a rate *meets the SLOs* when every kind the mix sends reaches the required attainment
(``metrics.slo``, docs/results.md). The rate search walks a geometric grid of rates (the
scenario's own times ``2 ** (i / n)``, ``n`` the fewest steps per doubling that keep a step within
``tolerance``): it doubles or halves until it brackets the answer, then narrows the bracket to
one step: the answer is a grid rate that passed with the next one up failing. The GPU search starts
from the estimate the rate search gives and steps by one GPU; a split configuration
(``dedicated-N:M``, ``disagg-pd-P:D``) stands for its family, every split of a GPU count tried.
Both assume attainment falls as the rate rises and grows with GPUs (a simulation's noise can
break that near the boundary; the runs are in ``capacity.json``).

Each round's runs go through the sweep backend at once (``orthrus_sim.questions.sweep``: local processes
or Ray), several points of a bracket per configuration when there are more workers than
configurations still searching.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from orthrus_sim.experiment.arrivals import kind_rates
from orthrus_sim.experiment.results import KINDS, results_doc, write_json
from orthrus_sim.experiment.scenario import REPLAN, Scenario, is_replan, scenario_dump
from orthrus_sim.experiment.slo import ATTAINMENT_EPS
from orthrus_sim.questions.sweep import Point, point_runner

SCHEMA = "orthrus.capacity/1"
MAX_DOUBLINGS = 10  # the rate search gives up 2^10 x above or below the scenario's rate
OPEN_LOOP = ("poisson", "gamma")
MOVING = ("mmpp", "diurnal", "trace")  # loads that move: scaled as a whole (rate_scale)
STRETCH_ATTAINMENT = 0.95  # a moving load's worst 5 minutes, by default


@dataclass(frozen=True)
class Load:
    """The scenario's open-loop load: its pools (plain data) and the rate each kind gets (a
    moving load's: its mean); ``moving``: a trace or bursty pool, scaled as a whole by
    ``workload.rate_scale`` (its kinds keep their ratio)."""

    pools: tuple[dict, ...]
    rates: dict[str, float]
    moving: bool = False
    rate_scale: float = 1.0

    @property
    def total(self) -> float:
        return sum(self.rates.values())


def open_loop_load(sc: Scenario) -> Load:
    """The load the search scales; a clear error for what it cannot scale or judge."""
    w = sc.workload
    if w.kind != "synthetic":
        raise ValueError(f"capacity: workload.kind {w.kind!r}: the search scales synthetic "
                         "open-loop pools (a trace or workflows have no single rate)")
    if w.phases:
        raise ValueError("capacity: workload.phases: the search needs one stationary mix")
    pools = w.default_pools()
    rates = dict.fromkeys(KINDS, 0.0)
    for i, pool in enumerate(pools):
        if pool.process not in OPEN_LOOP + MOVING:
            raise ValueError(f"capacity: workload pool {i} is {pool.process!r}: the search varies "
                             "an offered rate, so every pool must be open loop (poisson, gamma, "
                             "mmpp or diurnal with a rate, or a trace; see "
                             "scenarios/capacity_mix.yaml, scenarios/traces_merged.yaml)")
        for kind, rate in kind_rates(pool, w.generation_share).items():
            rates[kind] += rate * w.rate_scale
    if sc.slo is None:
        raise ValueError("capacity: the scenario has no slo section (ttft_s, tpot_s, e2e_s, "
                         "latency_s): there is nothing to meet")
    for kind, rate in rates.items():
        if rate > 0 and not sc.slo.bounds(kind):
            need = "latency_s" if kind == "embedding" else "ttft_s, tpot_s or e2e_s"
            raise ValueError(f"capacity: the mix sends {kind} requests but slo gives no bound for "
                             f"them (give {need})")
    moving = any(p.process in MOVING for p in pools)
    return Load(tuple(p.model_dump(mode="json") for p in pools), rates, moving, w.rate_scale)


def scaled_scenario(data: dict, load: Load, factors: dict[str, float], configuration: str,
                    gpus: int) -> dict:
    """The scenario (plain data) with each kind's rate scaled by ``factors``, on ``gpus`` GPUs,
    running ``configuration`` only."""
    if load.moving:
        return _scaled_moving(data, load, factors, configuration, gpus)
    pools = []
    for pool in load.pools:
        kinds = KINDS if pool["kind"] == "mixed" else (pool["kind"],)
        scale = _one_factor(factors, load, kinds, (
            "capacity: a mixed pool keeps its mix; give per-kind pools (kind: embedding / "
            "generation) to ask for another rate of one kind"))
        if scale > 0:
            pools.append(dict(pool, rate=pool["rate"] * scale))
    if not pools:
        raise ValueError("capacity: the load asked for sends no requests")
    out = copy.deepcopy(data)
    out["workload"].update(pools=pools, arrival=None, burst=[])
    out["cluster"]["gpus"] = gpus
    out["configurations"] = [configuration]
    return out


def _one_factor(factors: dict[str, float], load: Load, kinds, refusal: str) -> float:
    """The one factor ``kinds`` (those the load sends) are scaled by (0: none sent); equal
    to rounding (a scale times each kind's rate and divided back differs in the last bit)."""
    f = [factors[k] for k in kinds if load.rates[k] > 0]
    if any(not math.isclose(x, f[0], rel_tol=1e-9) for x in f):
        raise ValueError(refusal)
    return f[0] if f else 0.0


def _scaled_moving(data: dict, load: Load, factors: dict[str, float], configuration: str,
                   gpus: int) -> dict:
    """A moving load scaled as a whole: its ``rate_scale`` times the one factor."""
    scale = _one_factor(factors, load, KINDS, (
        "capacity: a trace or bursty load is scaled as a whole (its kinds keep their ratio); "
        "ask for one scale (--scale), not a demand per kind"))
    out = copy.deepcopy(data)
    out["workload"]["rate_scale"] = load.rate_scale * scale
    out["cluster"]["gpus"] = gpus
    out["configurations"] = [configuration]
    return out


def meets(metrics: dict, load: Load, required: float, stretch: float | None = None) -> bool:
    """Every kind the load sends reaches ``required`` attainment over the window, and
    ``stretch`` over its worst 5 minutes where given (a kind none of whose requests arrived
    in the window has nothing to miss). A run stopped early (``stop_below_attainment``) fails:
    it stopped because a kind could no longer reach ``required``."""
    if metrics.get("stopped_early"):
        return False
    for kind, rate in load.rates.items():
        if rate <= 0:
            continue
        slo = metrics["slo"][kind]
        attained = slo["attainment"]
        if attained is None:
            if metrics["arrived_in_window"].get(kind, 0):
                return False  # arrived, none judged: nothing finished by its deadline
            continue
        if attained < required - ATTAINMENT_EPS:
            return False
        worst = slo.get("worst_stretch")
        if stretch is not None and worst and worst["attainment"] < stretch - ATTAINMENT_EPS:
            return False
    return True


# ----- evaluations ------------------------------------------------------------------------------
Key = tuple[str, int, tuple[float, float]]  # configuration, GPUs, (embedding, generation) factor


class Evaluator:
    """Simulates (configuration, GPUs, rate factors) points through a sweep backend, each once.

    ``stop_early``: each run stops as soon as a kind can no longer reach ``required``
    (``stop_below_attainment``; the requests it sends are counted in advance), since the
    search asks only whether it passes; its record then holds no attainment, only which kind
    stopped it. ``False`` runs every point to its end (the failing runs' attainment kept)."""

    def __init__(self, scenario: Scenario, load: Load, required: float,
                 run_points: Callable[[list[Point]], Iterable], console: Console,
                 stretch: float | None = None, stop_early: bool = True) -> None:
        self.data = scenario_dump(scenario)  # the search decides where runs stop
        self.data["stop_below_attainment"] = required if stop_early else None
        self.load = load
        self.required = required
        self.stretch = stretch
        self.run_points = run_points
        self.console = console
        self.done: dict[Key, dict] = {}

    def evaluate(self, keys: list[Key]) -> None:
        todo = list(dict.fromkeys(k for k in keys if k not in self.done))
        if not todo:
            return
        points: dict[str, tuple[Point, Key]] = {}
        for i, key in enumerate(todo):
            cfg, gpus, (fe, fg) = key
            data = scaled_scenario(self.data, self.load, {"embedding": fe, "generation": fg}, cfg,
                                   gpus)
            name = f"run-{len(self.done) + i:04d}"
            over = {"configuration": cfg, "gpus": str(gpus),
                    "embedding_rps": f"{fe * self.load.rates['embedding']:.6g}",
                    "generation_rps": f"{fg * self.load.rates['generation']:.6g}"}
            points[name] = (Point(name, over, data), key)
        status = self.console.status(f"simulating {len(points)} points "
                                     f"({len(self.done)} done)")
        with status:
            outcomes = list(self.run_points([p for p, _ in points.values()]))
        for outcome in outcomes:
            _, key = points[outcome.point.name]
            if outcome.error is not None:
                raise ValueError(f"capacity: {key[0]} on {key[1]} GPUs at "
                                 f"{outcome.point.overrides}: {outcome.error}")
            self.done[key] = self._record(key, outcome.doc["runs"][0]["metrics"])

    def _record(self, key: Key, m: dict) -> dict:
        cfg, gpus, (fe, fg) = key
        rates = {"embedding": fe * self.load.rates["embedding"],
                 "generation": fg * self.load.rates["generation"]}
        stopped = m.get("stopped_early")
        slo = {k: ({} if stopped else m["slo"][k]) for k in KINDS}  # a stopped run's: partial
        return {"configuration": cfg, "gpus": gpus, "offered_rps": sum(rates.values()),
                "offered_rps_by_kind": rates,
                "attainment": {k: slo[k].get("attainment") for k in KINDS},
                "worst_stretch": {k: (slo[k].get("worst_stretch") or {}).get("attainment")
                                  for k in KINDS},
                "within": {k: slo[k].get("within") for k in KINDS},  # which bound held
                "stopped_early": stopped,
                "goodput_rps": None if stopped else m["slo"]["combined"]["goodput_rps"],
                "throughput_rps": None if stopped else m["throughput_rps"],
                "passed": meets(m, self.load, self.required, self.stretch),
                "sim_wall_s": m.get("sim_wall_s")}


# ----- the rate search ----------------------------------------------------------------------
def grid_steps(tolerance: float) -> int:
    """Steps of the rate grid per doubling: the fewest that keep one step within ``tolerance``."""
    return math.ceil(math.log(2.0) / math.log1p(tolerance) - 1e-9)


@dataclass
class Bracket:
    """A configuration's search on the rate grid: factor ``2 ** (i / steps)`` of the scenario's
    rate at grid index ``i``. ``lo`` is the highest index that passed below ``hi``, the lowest
    that failed (None: not found yet).

    Every configuration is searched on the same grid, so two configurations that pass and fail
    at the same rates get the same answer, however many workers split the bracket (an answer
    placed by where a bisection happened to land would differ by up to a step between equals).
    """

    configuration: str
    steps: int
    tried: dict[int, bool] = field(default_factory=dict)

    def factor(self, i: int) -> float:
        return 2.0 ** (i / self.steps)

    @property
    def hi(self) -> int | None:
        failed = [i for i, ok in self.tried.items() if not ok]
        return min(failed) if failed else None

    @property
    def lo(self) -> int | None:
        hi = self.hi
        passed = [i for i, ok in self.tried.items() if ok and (hi is None or i < hi)]
        return max(passed) if passed else None

    def done(self) -> bool:
        lo, hi = self.lo, self.hi
        edge = MAX_DOUBLINGS * self.steps
        if lo is not None and hi is not None:
            return hi - lo <= 1
        if lo is None and hi is not None:
            return hi <= -edge
        return lo is not None and lo >= edge

    def next(self, k: int) -> list[int]:
        """Up to ``k`` grid indices to try next: doublings or halvings until the answer is
        bracketed, then points spread evenly inside the bracket."""
        lo, hi, m = self.lo, self.hi, self.steps
        if lo is None and hi is None:
            return [j * m for j in range(k)]
        if hi is None:
            return [lo + (j + 1) * m for j in range(k)]
        if lo is None:
            return [hi - (j + 1) * m for j in range(k)]
        inside = {lo + round((hi - lo) * (j + 1) / (k + 1)) for j in range(k)}
        return sorted(i for i in inside if lo < i < hi) or [lo + (hi - lo) // 2]


def search_rates(ev: Evaluator, configurations: list[str], gpus: int, tolerance: float,
                 workers: int) -> list[dict]:
    """Per configuration on ``gpus`` GPUs: the highest rate (of the scenario's mix) that meets
    the SLOs, and the next one tried, which does not."""
    steps = grid_steps(tolerance)
    brackets = [Bracket(cfg, steps) for cfg in configurations]
    rounds = 0
    while active := [b for b in brackets if not b.done()]:
        rounds += 1
        k = max(1, workers // len(active))
        wanted = {b.configuration: b.next(k) for b in active}
        keys = [(b.configuration, gpus, (b.factor(i), b.factor(i)))
                for b in active for i in wanted[b.configuration]]
        ev.evaluate(keys)
        for b in active:
            for i in wanted[b.configuration]:
                f = b.factor(i)
                b.tried[i] = ev.done[(b.configuration, gpus, (f, f))]["passed"]
        ev.console.print(f"rate search, round {rounds}: " + ", ".join(
            f"{b.configuration} {_bracket_text(b, ev.load.total)}" for b in active), highlight=False)
    out = []
    for b in brackets:
        lo = None if b.lo is None else b.factor(b.lo)
        hi = None if b.hi is None else b.factor(b.hi)
        runs = sorted((ev.done[(b.configuration, gpus, (b.factor(i), b.factor(i)))]
                       for i in b.tried), key=lambda r: r["offered_rps"])
        best = ev.done[(b.configuration, gpus, (lo, lo))] if lo is not None else None
        out.append({
            "configuration": b.configuration, "gpus": gpus,
            "max_rate_rps": lo * ev.load.total if lo is not None else 0.0,
            "max_scale": lo or 0.0,  # of the scenario's load
            "max_rate_rps_by_kind": {k: (lo or 0.0) * ev.load.rates[k] for k in KINDS},
            "next_rate_rps": hi * ev.load.total if hi is not None else None,
            "attainment_at_max": best["attainment"] if best else None,
            "bound": "found" if lo is not None and hi is not None
            else ("below the lowest rate tried" if lo is None else "above the highest rate tried"),
            "runs": runs})
    return out


def _bracket_text(b: Bracket, total: float) -> str:
    lo, hi = b.lo, b.hi
    fmt = lambda i: "?" if i is None else f"{b.factor(i) * total:.3g}"  # noqa: E731
    return f"[{fmt(lo)}, {fmt(hi)}) req/s"


# ----- the GPU search -----------------------------------------------------------------------
def family(configuration: str) -> str:
    """What the GPU search varies: a split configuration stands for every split; a
    re-planning split from a given start for every start (``dedicated-replan`` alone picks its
    own)."""
    if is_replan(configuration):
        return REPLAN if configuration == REPLAN else REPLAN + "-start"
    for name in ("dedicated", "disagg-pd"):
        if configuration.startswith(name + "-"):
            return name
    return configuration


def family_members(name: str, gpus: int, demand: dict[str, float]) -> list[str]:
    """The configurations of a family on ``gpus`` GPUs (a dedicated pool may be empty only
    when its kind is not asked for; Disagg-PD and a re-planning split need a GPU on each
    side)."""
    if name.startswith(REPLAN) and gpus < 2:  # a re-planning split needs a GPU per role
        return []
    if name == REPLAN + "-start":  # a re-planning split from each start with both roles
        return [f"{REPLAN}-{a}:{gpus - a}" for a in range(1, gpus)]
    if name not in ("dedicated", "disagg-pd"):
        return [name]
    if name == "disagg-pd":
        return [f"disagg-pd-{a}:{gpus - a}" for a in range(1, gpus)]
    low = 0 if demand["embedding"] <= 0 else 1
    high = gpus if demand["generation"] <= 0 else gpus - 1
    return [f"dedicated-{a}:{gpus - a}" for a in range(low, high + 1)]


def search_gpus(ev: Evaluator, families: list[str], demand: dict[str, float], max_gpus: int,
                start: dict[str, int]) -> list[dict]:
    """Per family, the fewest GPUs (up to ``max_gpus``) on which one of its configurations
    serves ``demand`` within the SLOs: from ``start`` (the rate search's estimate), one GPU at
    a time, until a count passes with the one below it failing."""
    factors = tuple(demand[k] / ev.load.rates[k] if ev.load.rates[k] > 0 else 0.0 for k in KINDS)
    tried: dict[str, dict[int, bool]] = {f: {} for f in families}

    def verdict(fam: str) -> tuple[int | None, bool]:
        t = tried[fam]
        ok = [g for g, p in t.items() if p]
        best = min(ok) if ok else None
        if best is not None:
            return best, best == 1 or (best - 1) in t
        failed_top = max_gpus in t and not t[max_gpus]
        return None, failed_top

    rounds = 0
    while active := [f for f in families if not verdict(f)[1]]:
        rounds += 1
        wanted: dict[str, int] = {}
        for fam in active:
            t = tried[fam]
            best, _ = verdict(fam)
            if not t:
                wanted[fam] = start[fam]
            elif best is not None:
                wanted[fam] = best - 1
            else:
                wanted[fam] = max(t) + 1
        keys = {fam: [(cfg, g, factors) for cfg in family_members(fam, g, demand)]
                for fam, g in wanted.items()}
        ev.evaluate([k for ks in keys.values() for k in ks])
        for fam, g in wanted.items():
            tried[fam][g] = bool(keys[fam]) and any(ev.done[k]["passed"] for k in keys[fam])
        ev.console.print(f"GPU search, round {rounds}: " + ", ".join(
            f"{fam} on {g}: {'meets' if tried[fam][g] else 'misses'}" for fam, g in wanted.items()),
            highlight=False)
    out = []
    for fam in families:
        best, _ = verdict(fam)
        runs = [ev.done[(cfg, g, factors)] for g in sorted(tried[fam])
                for cfg in family_members(fam, g, demand)]
        passing = [r for r in runs if r["gpus"] == best and r["passed"]] if best else []
        chosen = max(passing, key=lambda r: min(a for a in r["attainment"].values()
                                                if a is not None), default=None)
        out.append({"family": fam, "gpus_needed": best,
                    "configuration": chosen["configuration"] if chosen else None,
                    "attainment": chosen["attainment"] if chosen else None,
                    "passing_configurations": [r["configuration"] for r in passing],
                    "runs": runs})
    return out


def estimate_gpus(rate_result: list[dict], fam: str, gpus: int, demand_rps: float,
                  max_gpus: int) -> int:
    """Where the family's GPU search starts: the GPUs it needs for ``demand_rps`` (of the
    scenario's mix) if its capacity grew in proportion to GPUs (1 when the rate search found no
    passing rate)."""
    best = max((r["max_rate_rps"] for r in rate_result if family(r["configuration"]) == fam),
               default=0.0)
    if best <= 0:
        return 1
    return max(1, min(max_gpus, math.ceil(gpus * demand_rps / best)))


# ----- the command --------------------------------------------------------------------------
def run_capacity(scenario: Scenario, out: Path, required: float = 0.99, tolerance: float = 0.05,
                 demand: dict[str, float] | None = None, max_gpus: int = 8,
                 max_parallel: int | None = None, ray: str | None = None,
                 console: Console | None = None, stretch: float | None = None,
                 scale: float | None = None, full_runs: bool = False) -> dict:
    """Both searches for every configuration of ``scenario``; writes ``capacity.json`` and
    ``capacity.png`` under ``out`` and prints the tables. ``demand``: requests/s per kind for
    the GPU search (default: the scenario's own rates), or ``scale``: the scenario's load times
    it; ``max_gpus`` 0 skips it. ``stretch``: the attainment every kind must also reach over
    its worst 5 minutes (default: ``STRETCH_ATTAINMENT`` for a trace or bursty load, none for
    a stationary one). ``full_runs``: no run stops early (``Evaluator``)."""
    console = console or Console()
    if not 0 < required <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {required}")
    if stretch is not None and not 0 < stretch <= 1:
        raise ValueError(f"--stretch-attainment must be in (0, 1], got {stretch}")
    if scale is not None and scale <= 0:
        raise ValueError(f"--scale must be > 0, got {scale}")
    if scale is not None and demand is not None:
        raise ValueError("give --demand or --scale, not both")
    if not 0 < tolerance < 1:
        raise ValueError(f"--tolerance must be in (0, 1), got {tolerance}")
    if max_gpus < 0:
        raise ValueError(f"--max-gpus must be >= 0, got {max_gpus}")
    load = open_loop_load(scenario)
    if stretch is None and load.moving:
        stretch = STRETCH_ATTAINMENT
    if scale is not None:
        demand = {k: r * scale for k, r in load.rates.items()}
    demand = dict(load.rates) if demand is None else {k: float(demand.get(k, 0.0)) for k in KINDS}
    for kind, rate in demand.items():
        if rate > 0 and load.rates[kind] <= 0:
            raise ValueError(f"--demand {kind}={rate:g}: the scenario sends no {kind} requests; "
                             "add a pool of that kind")
    workers = max(1, max_parallel or os.cpu_count() or 1)
    gpus = scenario.cluster.gpus
    wall = time.perf_counter()
    with point_runner(workers, ray) as run_points:
        ev = Evaluator(scenario, load, required, run_points, console, stretch,
                       stop_early=not full_runs)
        rates = search_rates(ev, list(scenario.configurations), gpus, tolerance, workers)
        gpu_result = None
        if max_gpus:
            families = list(dict.fromkeys(family(c) for c in scenario.configurations))
            scale = max(demand[k] / load.rates[k] for k in KINDS if load.rates[k] > 0)
            start = {f: estimate_gpus(rates, f, gpus, scale * load.total, max_gpus)
                     for f in families}
            gpu_result = {"demand_rps": demand, "max_gpus": max_gpus,
                          "families": search_gpus(ev, families, demand, max_gpus, start)}
    data = scenario_dump(scenario)
    doc = {**results_doc(data, []), "schema": SCHEMA, "required_attainment": required,
           "required_stretch_attainment": stretch, "moving_load": load.moving,
           "tolerance": tolerance, "rate_grid_steps": grid_steps(tolerance),
           "offered_rps_by_kind": load.rates, "full_runs": full_runs,
           "rate_search": rates, "gpu_search": gpu_result, "simulations": len(ev.done),
           "workers": workers, "wall_s": time.perf_counter() - wall}
    doc.pop("runs")
    out.mkdir(parents=True, exist_ok=True)
    write_json(doc, out / "capacity.json")
    from orthrus_sim.questions import plots

    plots.capacity_plot(doc, out / "capacity.png", f"{scenario.name}: SLO attainment against "
                        f"offered rate ({gpus} x {scenario.hardware})")
    print_capacity(console, doc, scenario.name)
    console.print(f"{doc['simulations']} simulations on {workers} workers in {doc['wall_s']:.0f} s; "
                  f"results: {out / 'capacity.json'}, {out / 'capacity.png'}", highlight=False)
    return doc


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def print_capacity(console: Console, doc: dict, name: str) -> None:
    from rich.table import Table

    sc = doc["scenario"]
    targets = ", ".join(f"{k} {v:g} s" for k, v in (sc.get("slo") or {}).items() if v is not None)
    mix = doc["offered_rps_by_kind"]
    share = mix["generation"] / max(sum(mix.values()), 1e-12)
    stretch = doc.get("required_stretch_attainment")
    worst = f", worst 5 min >= {stretch:.1%}" if stretch else ""
    table = Table(title=f"{name}: highest rate within the SLOs ({targets}; attainment >= "
                        f"{doc['required_attainment']:.1%}{worst}; generation share {share:.2f})")
    for col in ("configuration", "GPUs", "scale", "max req/s", "emb/s", "gen/s", "next (fails)",
                "SLO emb", "SLO gen", "worst 5 min", "runs"):
        table.add_column(col, justify="right", overflow="fold")
    for r in doc["rate_search"]:
        att = r["attainment_at_max"] or {}
        at_max = [x for x in r["runs"]
                  if math.isclose(x["offered_rps"], r["max_rate_rps"], rel_tol=1e-9)]
        worst = min((v for v in (at_max[0].get("worst_stretch") or {}).values() if v is not None),
                    default=None) if at_max else None
        table.add_row(r["configuration"], str(r["gpus"]), f"{r.get('max_scale', 0):.3g}x",
                      f"{r['max_rate_rps']:.2f}",
                      f"{r['max_rate_rps_by_kind']['embedding']:.2f}",
                      f"{r['max_rate_rps_by_kind']['generation']:.2f}",
                      "-" if r["next_rate_rps"] is None else f"{r['next_rate_rps']:.2f}",
                      _pct(att.get("embedding")), _pct(att.get("generation")), _pct(worst),
                      str(len(r["runs"])))
    console.print(table)
    g = doc["gpu_search"]
    if not g:
        return
    d = g["demand_rps"]
    table = Table(title=f"{name}: fewest GPUs for {d['embedding']:g} embeddings/s and "
                        f"{d['generation']:g} generations/s")
    for col in ("configuration", "GPUs", "as", "SLO emb", "SLO gen", "runs"):
        table.add_column(col, justify="right", overflow="fold")
    for f in g["families"]:
        att = f["attainment"] or {}
        needed = str(f["gpus_needed"]) if f["gpus_needed"] else f"> {g['max_gpus']}"
        table.add_row(f["family"], needed, f["configuration"] or "-", _pct(att.get("embedding")),
                      _pct(att.get("generation")), str(len(f["runs"])))
    console.print(table)
