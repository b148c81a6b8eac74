"""Where a simulation's time goes, at one replica and at four, and what grows with the cluster.

Runs Vidur's reference workload (the one ``benchmarks/simulator/speed.py`` times: 10,000 requests on one
replica, 40,000 on four) twice per case: once counting what happens (SimPy events, schedules,
iterations, decode runs and their phases, cohort joins; no profiler, so its wall time is real),
once under cProfile, summing each function's own time by area of the code. Built-in calls
(``list.append``, ``heapq.heappush``, ...) are charged to the area of the Python function that
made them, in proportion to the time each caller spent in them, so the areas add up to the whole
run. Every figure is per simulated request, so the two cases compare directly: four replicas
serve four times the requests, and a column that grows says what costs more than linearly.
cProfile slows a run about threefold and inflates small, often-called functions most: the
shares are for finding where to look, the wall figures belong to ``speed.py``.

``--paper CONFIG`` adds the mix sweep's paper-scale point (``scenarios/mix_sweep.yaml``: 4
GPUs, 512 closed-loop clients, 180 s) for one configuration, per request it issued: a workload
whose cost is its requests (~56,000 embeddings), not its iterations.

Run: python -m benchmarks.simulator.profiling [--replicas 1 4] [--paper orthrus] [--stepping]
                                                [--top 15] [--out profile.json]
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections import Counter, defaultdict
from pathlib import Path

import simpy
from rich.console import Console

import orthrus_sim.engine.cohort as cohort_module
import orthrus_sim.sim.replica as replica_module
from benchmarks.common import parser, table
from benchmarks.simulator.speed import WORKLOADS, orthrus_scenario
from orthrus_sim.engine.policy import Policy
from orthrus_sim.experiment.results import write_json
from orthrus_sim.experiment.scenario import load_scenario, parse_scenario
from orthrus_sim.sim.run import simulate

# (area, path fragment): the first fragment found in a function's file names its area
AREAS = [
    ("SimPy event loop", "/simpy/"),
    ("cost model", "orthrus_sim/costmodel/"),
    ("decode cohort and runs (core)", "orthrus_sim/engine/cohort.py"),
    ("decode cohort and runs (core)", "orthrus_sim/engine/decode_run.py"),
    ("policy, batch and KV (core)", "orthrus_sim/engine/"),
    ("metrics and request log", "orthrus_sim/sim/metrics.py"),
    ("metrics and request log", "orthrus_sim/experiment/results.py"),
    ("metrics and request log", "orthrus_sim/experiment/quantiles.py"),
    ("router and cluster", "orthrus_sim/routing/rules.py"),
    ("router and cluster", "orthrus_sim/sim/cluster.py"),
    ("replica process", "orthrus_sim/sim/replica.py"),
    ("workload and driver", "orthrus_sim/sim/driver.py"),
    ("workload and driver", "orthrus_sim/experiment/"),
    ("monitor and set-up", "orthrus_sim/sim/"),
]
OTHER = "other (stdlib, numpy)"


def area_of(filename: str) -> str | None:
    """The area of a Python file, or None for a built-in (charged to its callers)."""
    if filename == "~" or filename.startswith("<"):
        return None
    for area, fragment in AREAS:
        if fragment in filename:
            return area
    return OTHER


def breakdown(stats: pstats.Stats) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Own seconds by area, built-ins charged to their callers' areas; and the top functions."""
    raw = stats.stats  # type: ignore[attr-defined]
    by_area: dict[str, float] = defaultdict(float)
    functions: list[tuple[str, float]] = []
    for (filename, line, name), (_, _, own, _, callers) in raw.items():
        area = area_of(filename)
        if area is not None:
            by_area[area] += own
            functions.append((f"{Path(filename).name}:{line} {name}", own))
            continue
        functions.append((name, own))
        edges = {area_of(caller[0]) or OTHER: 0.0 for caller in callers}
        total = sum(edge[2] for edge in callers.values())
        for caller, edge in callers.items():
            share = edge[2] / total if total else 1 / len(callers)
            edges[area_of(caller[0]) or OTHER] += own * share
        if not callers:
            edges[OTHER] = own
        for a, seconds in edges.items():
            by_area[a] += seconds
    functions.sort(key=lambda f: -f[1])
    return dict(by_area), functions


def counted(scenario, configuration: str, fast: bool) -> tuple[dict[str, int], float, int]:
    """Run once with counters on the hot calls (a wrapper each: no profiler); the counts, the
    wall seconds of ``simulate`` and the requests the workload issued."""
    counts: Counter[str] = Counter()
    patches = []

    def wrap(owner, name, key):
        original = getattr(owner, name)

        def counting(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)
        setattr(owner, name, counting)
        patches.append((owner, name, original))

    wrap(simpy.Environment, "step", "SimPy events")
    wrap(Policy, "schedule", "schedules (fill)")
    wrap(Policy, "complete", "single iterations completed")
    wrap(replica_module.Replica, "_account_phase", "decode-run phases")
    wrap(cohort_module.DecodeCohort, "join", "cohort joins")
    try:
        start = time.perf_counter()
        result = simulate(scenario, configuration, fast_forward=fast, keep_rows=False)
        wall = time.perf_counter() - start
    finally:
        for owner, name, original in patches:
            setattr(owner, name, original)
    counts["iterations"] = result.metrics["iterations"]
    counts["decode runs"] = sum(g["decode_runs"] for g in result.metrics["utilization"]["per_gpu"])
    return dict(counts), wall, sum(result.metrics["issued"].values())


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 4], choices=sorted(WORKLOADS))
    ap.add_argument("--paper", metavar="CONFIG",
                    help="add the mix sweep's paper-scale point for this configuration")
    ap.add_argument("--stepping", action="store_true", help="step every iteration (no fast path)")
    ap.add_argument("--top", type=int, default=15, help="functions to list by own time")
    ap.add_argument("--out", help="write the breakdown to this JSON file")
    args = ap.parse_args()
    console = Console(width=max(Console().width, 110))
    fast = not args.stepping

    runs = [(f"{r} replica{'s' if r > 1 else ''}", parse_scenario(orthrus_scenario(r)), None)
            for r in args.replicas]
    if args.paper:
        runs.append((f"mix sweep, {args.paper}", load_scenario("mix_sweep"), args.paper))
    cases = {}
    for name, scenario, configuration in runs:
        configuration = configuration or scenario.configurations[0]
        console.print(f"[dim]{name}: counting, then under cProfile[/]")
        counts, wall, requests = counted(scenario, configuration, fast)
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        simulate(scenario, configuration, fast_forward=fast, keep_rows=False)
        profiler.disable()
        profiled = time.perf_counter() - start
        by_area, functions = breakdown(pstats.Stats(profiler))
        cases[name] = {"requests": requests, "wall_s": wall, "profiled_s": profiled,
                       "counts": counts, "areas_s": by_area,
                       "top_functions_s": dict(functions[:args.top])}

    mode = "decode runs" if fast else "every iteration"
    names = list(cases)
    g = len(args.replicas) - 1  # growth: the last replica count over the first
    grows = g > 0
    first, last = cases[names[0]], cases[names[g]]
    growth_column = ["growth"] if grows else []
    counts = table(f"Per simulated request, {mode} (counts: no profiler)",
                   [*names, *growth_column], label="what")
    for key in first["counts"]:
        vals = [c["counts"].get(key, 0) / c["requests"] for c in cases.values()]
        growth = [f"{vals[g] / vals[0]:.2f}x" if vals[0] else ""] if grows else []
        counts.add_row(key, *[f"{v:.2f}" for v in vals], *growth)
    vals = [1e6 * c["wall_s"] / c["requests"] for c in cases.values()]
    counts.add_row("[bold]wall us (simulate)[/]", *[f"{v:.0f}" for v in vals],
                   *([f"{vals[g] / vals[0]:.2f}x"] if grows else []))
    console.print(counts)

    by_area = table("Profiled microseconds per simulated request, by area (cProfile)",
                    [*[col for name in names for col in (name, "share")], *growth_column],
                    label="area")
    areas = sorted({a for c in cases.values() for a in c["areas_s"]},
                   key=lambda a: -last["areas_s"].get(a, 0.0))
    for area in areas:
        row = []
        for c in cases.values():
            s = c["areas_s"].get(area, 0.0)
            row += [f"{1e6 * s / c['requests']:.1f}", f"{s / sum(c['areas_s'].values()):.0%}"]
        if grows:
            a0 = first["areas_s"].get(area, 0.0) / first["requests"]
            a1 = last["areas_s"].get(area, 0.0) / last["requests"]
            row.append(f"{a1 / a0:.2f}x" if a0 else "")
        by_area.add_row(area, *row)
    console.print(by_area)

    top = table(f"Top {args.top} functions by own time, {names[-1]}",
                ["own s", "us per request"], label="function")
    shown = cases[names[-1]]
    for name, seconds in list(shown["top_functions_s"].items())[:args.top]:
        top.add_row(name, f"{seconds:.2f}", f"{1e6 * seconds / shown['requests']:.1f}")
    console.print(top)
    if args.out:
        doc = {"fast_forward": fast, "cases": {str(k): v for k, v in cases.items()}}
        write_json(doc, Path(args.out))
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
