"""Long runs: peak memory and wall time against the number of requests.

An open-loop workload on 4 A100s (Poisson, 5:5 mix, 128-token inputs, 128 -> 128 generations) at
a rate they sustain (160/s: the generation p99 stays at ~3 s however long the run; ``--rate``
above ~220/s overloads them and the queues grow with the run), 10^4, 10^5 and 10^6 requests,
per-request rows streamed to a CSV as ``orthrus-sim run`` writes them. Each size runs in its
own process; the table gives its peak resident memory (targets: under 1 GiB at 10^6) and wall
seconds per 1,000 requests (target: flat, i.e. wall time linear in the request count).

Run: python -m benchmarks.simulator.memory [--sizes 10000,100000,1000000] [--rate 160]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console

from benchmarks.common import ROOT, parser, python_module, table

SCENARIO = {
    "name": "long-open-loop", "seed": 0, "calibration": "a100-40gb", "cluster": {"gpus": 4},
    "scheduler": {"token_budget": 2048, "chunk_size": 512},
    "workload": {"arrival": {"process": "poisson", "rate": 160.0}, "generation_share": 0.5,
                 "embedding_input": {"dist": "fixed", "value": 128},
                 "generation_prompt": {"dist": "fixed", "value": 128},
                 "generation_output": {"dist": "fixed", "value": 128}},
    "configurations": ["orthrus"],
}


def child(n: int, rate: float, out: str) -> None:
    """Run one size and print its figures as JSON (peak RSS of this process)."""
    from orthrus_sim.experiment.scenario import parse_scenario
    from orthrus_sim.sim.run import simulate

    workload = {**SCENARIO["workload"], "arrival": {"process": "poisson", "rate": rate}}
    scenario = parse_scenario({**SCENARIO, "workload": workload, "num_requests": n})
    start = time.perf_counter()
    result = simulate(scenario, "orthrus", requests_csv=Path(out) / "requests.csv")
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    m = result.metrics
    print(json.dumps({"n": n, "wall_s": wall, "peak_rss": rss,
                      "completed": sum(m["completed"].values()),
                      "csv_rows": sum(1 for _ in open(Path(out) / "requests.csv")) - 1,
                      "p99_exact": m["latency_s"]["embedding"]["count"] <= 100_000,
                      "generation_p99": m["latency_s"]["generation"]["p99"]}))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--rate", type=float, default=SCENARIO["workload"]["arrival"]["rate"],
                    help="arrivals per second (both kinds)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.rate, args.out)
        return
    console = Console()
    sizes = table("Simulator memory and time against request count "
                  f"(4 GPUs, open loop, {args.rate:g} requests/s)",
                  ["requests", "wall s", "s per 1,000 requests", "peak RSS MiB", "rows in CSV",
                   "generation p99 s", "percentiles"])
    first = None
    for n in (int(x) for x in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run(python_module(__spec__.name, "--child", str(n), "--rate",
                                                str(args.rate), "--out", out),
                                  capture_output=True, text=True, check=True, cwd=ROOT)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        per_k = 1000 * r["wall_s"] / n
        first = first or per_k
        sizes.add_row(f"{n:,}", f"{r['wall_s']:.1f}", f"{per_k:.3f} ({per_k / first:.2f}x)",
                      f"{r['peak_rss'] / 2**20:,.0f}", f"{r['csv_rows']:,}",
                      f"{r['generation_p99']:.2f}",
                      "exact" if r["p99_exact"] else "sketch, within 0.5 %")
        console.print(f"{n:,} requests: {r['wall_s']:.1f} s", highlight=False)
    console.print(sizes)


if __name__ == "__main__":
    main()
