"""Simulator speed: simulated iterations and requests per wall-second.

1. Vidur's reference workload: one A100 replica, Llama-2-7B, chunked prefill (Sarathi-style,
   512-token budget), 128-token prompts, 512-token outputs, 10,000 requests (all at t=0,
   at most 128 running). Vidur measured on these machines: ~3,400 iterations/s and ~350
   requests/s; the target is ten times that.
2. The mix-sweep point: 4 GPUs, 512 closed-loop clients, 180 simulated seconds, 5:5 mix, each
   configuration (target: under 3 s of wall time each).

Each figure is also measured with decode runs disabled (stepping every iteration), as the
baseline in the same run.
Run: python benchmarks/simulator_speed.py
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from orthrus_sim.experiment.scenario import parse_scenario
from orthrus_sim.sim.run import simulate

VIDUR_REFERENCE = {"iterations_per_s": 3400.0, "requests_per_s": 350.0}

VIDUR_LIKE = {
    "name": "vidur-like", "seed": 0, "hardware": "a100-80gb", "model": "llama-2-7b",
    "calibration": "calibration/a100-40gb.json",
    "embedding": {"lora_rank": None},
    "scheduler": {"token_budget": 512, "chunk_size": None, "max_num_seqs": 128,
                  "generation_token_budget": 512},
    "workload": {"arrival": {"process": "burst"}, "burst": [{"kind": "generation", "count": 10000}],
                 "generation_prompt": {"dist": "fixed", "value": 128},
                 "generation_output": {"dist": "fixed", "value": 512}},
    "configurations": ["dedicated-0:1"],
}

MIX_POINT = {
    "name": "mix-point", "seed": 0, "duration_s": 180, "calibration": "calibration/a100-40gb.json",
    "cluster": {"gpus": 4},
    "workload": {"arrival": {"process": "closed-loop", "clients": 512}, "generation_share": 0.5,
                 "embedding_input": {"dist": "fixed", "value": 128},
                 "generation_prompt": {"dist": "fixed", "value": 128},
                 "generation_output": {"dist": "fixed", "value": 512}},
    "configurations": ["dedicated-1:3", "disagg-pd", "unified-homo", "unified-hetero", "orthrus"],
}


def timed(raw: dict, configuration: str, fast: bool):
    scenario = parse_scenario(raw)
    start = time.perf_counter()
    result = simulate(scenario, configuration, fast_forward=fast)
    return result, time.perf_counter() - start


def main() -> None:
    console = Console()
    table = Table(title="Vidur reference workload (1 x A100, Llama-2-7B, 10,000 requests)")
    for col in ("mode", "wall s", "iterations", "iterations/s", "requests/s", "x Vidur"):
        table.add_column(col, justify="right")
    for fast in (False, True):
        result, wall = timed(VIDUR_LIKE, "dedicated-0:1", fast)
        m = result.metrics
        it_rate = m["iterations"] / wall
        done = m["completed"]["generation"]
        table.add_row("decode runs" if fast else "every iteration", f"{wall:.2f}", f"{m['iterations']:,}",
                      f"{it_rate:,.0f}", f"{done / wall:,.0f}",
                      f"{it_rate / VIDUR_REFERENCE['iterations_per_s']:.1f}")
    console.print(table)

    table = Table(title="Mix-sweep point (4 GPUs, 512 clients, 180 s, 5:5), wall seconds")
    for col in ("configuration", "every iteration", "decode runs", "iterations", "target < 3 s"):
        table.add_column(col, justify="right")
    for cfg in MIX_POINT["configurations"]:
        _, slow = timed(MIX_POINT, cfg, False)
        result, fast = timed(MIX_POINT, cfg, True)
        table.add_row(cfg, f"{slow:.2f}", f"{fast:.2f}", f"{result.metrics['iterations']:,}",
                      "yes" if fast < 3 else "NO")
    console.print(table)


if __name__ == "__main__":
    main()
