"""What a sweep costs: one grid run on local processes and on a local Ray instance, alternately.

Per point it reads the simulation time the point itself spent (``sim_wall_s`` of its runs) and
sets it against the sweep's wall time: the scheduling overhead per task is what the workers'
capacity spent on anything but simulating, ``(wall * workers - sum of point times) / points``.
From those two figures it extrapolates a 10,000-point sweep on this machine and on a cluster of
``--cluster-cpus`` CPUs.

    python -m benchmarks.simulator.sweep_cost                       # 200 points: 50 seeds x 4 budgets
    python -m benchmarks.simulator.sweep_cost --seeds 10 --no-ray   # smaller, local processes only
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from rich.console import Console

from benchmarks.common import alternate, parser, table
from orthrus_sim.experiment.results import write_json
from orthrus_sim.experiment.scenario import read_scenario, scenario_path
from orthrus_sim.questions.sweep import run_sweep

BUDGETS = "1024,2048,3072,4096"


def run_once(backend: str, args, work: Path, console: Console) -> dict:
    out = work / backend
    shutil.rmtree(out, ignore_errors=True)
    path = scenario_path(args.scenario)
    seeds = ",".join(str(s) for s in range(1, args.seeds + 1))
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - the sweep's own table is not wanted
    start = time.perf_counter()
    doc = run_sweep(read_scenario(path), args.set, [f"seed={seeds}", f"scheduler.token_budget={BUDGETS}"],
                    out, args.workers, quiet, base_dir=path.parent, source=str(path),
                    ray="local" if backend == "ray" else None)
    wall = time.perf_counter() - start
    point_s = [sum(r["metrics"]["sim_wall_s"] for r in p["runs"]) for p in doc["points"]]
    n = len(point_s)
    overhead = (wall * args.workers - sum(point_s)) / n
    console.print(f"{backend}: {n} points in {wall:.1f} s", highlight=False)
    return {"backend": backend, "points": n, "failed": len(doc["failed"]), "wall_s": wall,
            "point_s_median": statistics.median(point_s), "point_s_mean": sum(point_s) / n,
            "overhead_per_task_s": overhead,
            "throughput": [p["runs"][0]["metrics"]["throughput_rps"]["combined"]
                           for p in doc["points"]]}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--scenario", default="quickstart")
    ap.add_argument("--set", action="append", default=[],
                    help="scenario override (default: 20 simulated seconds, 5 s warm-up)")
    ap.add_argument("--seeds", type=int, default=50, help="points = seeds x 4 token budgets")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=1, help="alternations of the two backends")
    ap.add_argument("--no-ray", action="store_true", help="local processes only")
    ap.add_argument("--cluster-cpus", type=int, default=64, help="for the extrapolation")
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    args = ap.parse_args()
    args.set = args.set or ["duration_s=20", "warmup_s=5"]
    console = Console()
    backends = ["local"] if args.no_ray else ["local", "ray"]
    work = Path(tempfile.mkdtemp(prefix="orthrus-sweep-cost-"))
    try:
        runs = alternate({b: partial(run_once, b, args, work, console) for b in backends},
                         args.rounds, reverse=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = [r for each_round in zip(*runs.values()) for r in each_round]  # in run order
    if len(backends) == 2:
        same = all(r["throughput"] == results[0]["throughput"] for r in results)
        console.print(f"identical numbers on both backends: {same}", highlight=False)
    out = table(f"sweep cost: {results[0]['points']} points of {args.scenario} "
                f"({' '.join(args.set)}), {args.workers} workers",
                ["backend", "wall s", "point s (median)", "overhead per task s",
                 "10,000 points here", f"10,000 points on {args.cluster_cpus} CPUs"])
    summary = []
    for b in backends:
        rs = runs[b]
        wall = statistics.median(r["wall_s"] for r in rs)
        point = statistics.median(r["point_s_mean"] for r in rs)
        over = statistics.median(r["overhead_per_task_s"] for r in rs)
        here = 10_000 * (point + over) / args.workers
        cluster = 10_000 * (point + over) / args.cluster_cpus
        summary.append({"backend": b, "wall_s": wall, "point_s": point, "overhead_per_task_s": over,
                        "extrapolated_10k_here_s": here, "extrapolated_10k_cluster_s": cluster})
        out.add_row(b, f"{wall:.1f}", f"{statistics.median(r['point_s_median'] for r in rs):.3f}",
                    f"{over:.3f}", f"{here / 60:.0f} min", f"{cluster / 60:.1f} min")
    console.print(out)
    if args.out:
        for r in results:
            r.pop("throughput")
        write_json({"cpu_count": os.cpu_count(), "workers": args.workers, "set": args.set,
                    "runs": results, "summary": summary}, args.out)


if __name__ == "__main__":
    main()
