"""Scheduling iterations per second for each policy with 512 requests queued and 256 running.

Each timed iteration is one ``schedule`` + ``complete`` pair on a replica that is kept in steady
state: finished requests are replaced so the queue stays at 512 and the running set near 256.
Run: python -m benchmarks.simulator.scheduler_throughput [--seconds 1.0]
"""

from __future__ import annotations

import itertools
import time

from rich.console import Console

from benchmarks.common import parser, table
from orthrus_sim.engine import Request, SchedulerConfig, make_policy

POLICIES = ["ibs", "unified-hetero", "unified-homo", "generation", "embedding-only"]


def steady_replica(name: str):
    cfg = SchedulerConfig(token_budget=4096, chunk_size=512, max_num_seqs=256,
                          block_size=16, num_blocks=1_000_000)
    policy = make_policy(name, cfg)
    ids = itertools.count()
    kinds = {"generation": ["generation"], "embedding-only": ["embedding"]}.get(
        name, ["generation", "embedding"])
    kind_cycle = itertools.cycle(kinds)

    def new_request(now: float) -> Request:
        kind = next(kind_cycle)
        return Request(f"r{next(ids)}", kind, now, 128,
                       max_output_tokens=512 if kind == "generation" else 0)

    def top_up(now: float) -> None:
        while policy.num_unfinished < 768:
            policy.add(new_request(now), now)

    now = 0.0
    top_up(now)
    # warm up until the running set has filled
    for _ in range(200):
        now += 1
        policy.complete(policy.schedule(now), now)
        top_up(now)
    return policy, top_up


def measure(name: str, seconds: float) -> tuple[float, float, float]:
    policy, top_up = steady_replica(name)
    n = 0
    now = 1000.0
    items = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        now += 1
        batch = policy.schedule(now)
        items += len(batch)
        policy.complete(batch, now)
        top_up(now)
        n += 1
    elapsed = time.perf_counter() - start
    snap = policy.snapshot()
    return n / elapsed, items / max(n, 1), snap.embeddings_running + snap.generations_running


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    out = table("Scheduling iterations per second (512 queued, up to 256 running)",
                ["policy", "iterations/s", "items/batch", "requests holding KV"])
    for name in POLICIES:
        rate, per_batch, holding = measure(name, args.seconds)
        out.add_row(name, f"{rate:,.0f}", f"{per_batch:.0f}", str(holding))
    Console().print(out)


if __name__ == "__main__":
    main()
