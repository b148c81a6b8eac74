"""Where a simulation's wall time goes: SimPy, the policy, the cost model, metrics.

Runs Vidur's reference workload (the one ``simulator_speed.py`` times; ``--replicas 1`` or
``4``) once under cProfile and sums each function's own time by area of the code. Built-in
calls (``list.append``, ``heapq.heappush``, ...) are charged to the area of the Python
function that made them, in proportion to the time each caller spent in them, so the areas
add up to the whole run. cProfile slows a run about threefold and inflates small, often-called
functions most: the shares are for finding where to look, the wall figures belong to
``simulator_speed.py``.

Run: python benchmarks/simulator_profile.py [--replicas 4] [--fast|--stepping] [--top 15]
                                            [--out profile.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table
from simulator_speed import WORKLOADS, orthrus_scenario

from orthrus_sim.experiment.scenario import parse_scenario
from orthrus_sim.sim.run import simulate

# (area, path fragment): the first fragment found in a function's file names its area
AREAS = [
    ("SimPy event loop", "/simpy/"),
    ("cost model", "orthrus_sim/costmodel/"),
    ("policy, batch and KV (core)", "orthrus_sim/engine/"),
    ("metrics and request log", "orthrus_sim/sim/metrics.py"),
    ("metrics and request log", "orthrus_sim/experiment/results.py"),
    ("metrics and request log", "orthrus_sim/experiment/quantiles.py"),
    ("replica and driver processes", "orthrus_sim/sim/"),
    ("workload generation", "orthrus_sim/experiment/"),
]
OTHER = "other (start-up, stdlib)"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4, choices=sorted(WORKLOADS))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fast", dest="fast", action="store_true", default=True,
                      help="decode runs on (the default)")
    mode.add_argument("--stepping", dest="fast", action="store_false",
                      help="step every iteration (decode runs off)")
    ap.add_argument("--top", type=int, default=15, help="functions to list by own time")
    ap.add_argument("--out", help="write the breakdown to this JSON file")
    args = ap.parse_args()
    console = Console(width=max(Console().width, 110))

    scenario = parse_scenario(orthrus_scenario(args.replicas))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    result = simulate(scenario, scenario.configurations[0], fast_forward=args.fast,
                      keep_rows=False)
    profiler.disable()
    wall = time.perf_counter() - start
    by_area, functions = breakdown(pstats.Stats(profiler))
    total = sum(by_area.values())
    iterations = result.metrics["iterations"]

    requests, rate = WORKLOADS[args.replicas]
    mode_name = "decode runs" if args.fast else "every iteration"
    table = Table(title=f"{args.replicas} x A100, {requests:,} requests Poisson {rate:g}/s, "
                        f"{mode_name}: {wall:.1f} s under cProfile, {iterations:,} iterations")
    for col in ("area", "own s", "share", "us per iteration"):
        table.add_column(col, justify="right" if col != "area" else "left")
    for area, seconds in sorted(by_area.items(), key=lambda kv: -kv[1]):
        table.add_row(area, f"{seconds:.2f}", f"{seconds / total:.0%}",
                      f"{1e6 * seconds / iterations:.2f}")
    console.print(table)
    top = Table(title=f"Top {args.top} functions by own time")
    top.add_column("function")
    top.add_column("own s", justify="right")
    top.add_column("share", justify="right")
    for name, seconds in functions[:args.top]:
        top.add_row(name, f"{seconds:.2f}", f"{seconds / total:.1%}")
    console.print(top)
    if args.out:
        doc = {"replicas": args.replicas, "fast_forward": args.fast, "wall_s": wall,
               "iterations": iterations, "areas_s": by_area,
               "top_functions_s": dict(functions[:args.top])}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
