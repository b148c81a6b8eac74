"""Simulator speed against Vidur, on Vidur's own reference workload, in one run.

The workload (Vidur's reference): Llama-2-7B on A100s, chunked prefill with a 512-token
budget, at most 256 running requests, 128-token prompts and 512-token outputs arriving
Poisson: 10,000 requests at 6 req/s on one replica, and 40,000 at 24 req/s on four
(round-robin). Vidur runs from a checkout prepared as ``../shared/tools/vidur/README.md`` says
(``--vidur-src`` and ``--vidur-python``, or the ``VIDUR_SRC`` and ``VIDUR_PYTHON`` variables);
its figure is the event loop alone (``run_s`` of that ``bench.py``), Orthrus's the whole
``simulate`` call (request generation and results included), so the ratio errs against Orthrus.

The machines are noisy: the two simulators alternate, round after round, and each round's
ratio is taken between neighbours; the table shows medians. Orthrus stepping every iteration
(decode runs off) is measured beside them as the baseline of the fast path.

Run: python benchmarks/simulator_speed.py --vidur-src /path/to/vidur --vidur-python /path/to/python
     [--rounds 3] [--replicas 1 4] [--no-stepping] [--out speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from orthrus_sim.experiment.scenario import parse_scenario
from orthrus_sim.sim.run import simulate

TARGET = 10.0  # x Vidur in simulated requests per wall-second
WORKLOADS = {1: (10_000, 6.0), 4: (40_000, 24.0)}  # replicas: (requests, req/s)


def orthrus_scenario(replicas: int) -> dict:
    requests, rate = WORKLOADS[replicas]
    return {
        "name": f"vidur-reference-{replicas}", "seed": 0, "hardware": "a100-80gb",
        "model": "llama-2-7b", "calibration": "a100-40gb", "embedding": {"lora_rank": None},
        "num_requests": requests, "cluster": {"gpus": replicas, "router": "round-robin"},
        "scheduler": {"token_budget": 512, "chunk_size": None, "max_num_seqs": 256,
                      "generation_token_budget": 512},
        "workload": {"pools": [{"kind": "generation", "process": "poisson", "rate": rate}],
                     "generation_prompt": {"dist": "fixed", "value": 128},
                     "generation_output": {"dist": "fixed", "value": 512}},
        "configurations": [f"dedicated-0:{replicas}"],
    }


def vidur_args(replicas: int, out: Path) -> list[str]:
    requests, rate = WORKLOADS[replicas]
    flags = {
        "replica_config_model_name": "meta-llama/Llama-2-7b-hf", "replica_config_device": "a100",
        "replica_config_tensor_parallel_size": 1, "cluster_config_num_replicas": replicas,
        "global_scheduler_config_type": "round_robin", "replica_scheduler_config_type": "sarathi",
        "sarathi_scheduler_config_chunk_size": 512, "sarathi_scheduler_config_batch_size_cap": 256,
        "request_generator_config_type": "synthetic",
        "synthetic_request_generator_config_num_requests": requests,
        "length_generator_config_type": "fixed",
        "fixed_request_length_generator_config_prefill_tokens": 128,
        "fixed_request_length_generator_config_decode_tokens": 512,
        "interval_generator_config_type": "poisson",
        "poisson_request_interval_generator_config_qps": rate,
        "execution_time_predictor_config_type": "linear_regression",
        "linear_regression_execution_time_predictor_config_prediction_max_batch_size": 256,
        "metrics_config_output_dir": out / "output", "metrics_config_cache_dir": out / "cache",
    }
    args = [f"--{k}={v}" for k, v in flags.items()]
    return args + ["--no-metrics_config_store_plots"]


def run_vidur(src: Path, python: str, replicas: int, work: Path) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(src)}
    proc = subprocess.run([python, "bench.py", *vidur_args(replicas, work)], cwd=src, env=env,
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            res = json.loads(line.removeprefix("BENCH_RESULT "))
            return {"wall_s": res["run_s"], "requests": res["num_requests"],
                    "iterations": res["num_batches"], "sim_end_s": res["sim_end_time_s"]}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    raise SystemExit(f"Vidur run failed (exit {proc.returncode}):\n" + "\n".join(tail))


def run_orthrus(replicas: int, fast: bool) -> dict:
    scenario = parse_scenario(orthrus_scenario(replicas))
    start = time.perf_counter()
    result = simulate(scenario, scenario.configurations[0], fast_forward=fast, keep_rows=False)
    wall = time.perf_counter() - start
    m = result.metrics
    return {"wall_s": wall, "requests": m["completed"]["generation"],
            "iterations": m["iterations"], "sim_end_s": m["sim_end_s"]}


def rates(run: dict) -> dict:
    return {**run, "requests_per_s": run["requests"] / run["wall_s"],
            "iterations_per_s": run["iterations"] / run["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur-src", default=os.environ.get("VIDUR_SRC"),
                    help="a Vidur checkout with bench.py (../shared/tools/vidur/README.md)")
    ap.add_argument("--vidur-python", default=os.environ.get("VIDUR_PYTHON", sys.executable),
                    help="the Python of Vidur's environment")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 4], choices=sorted(WORKLOADS))
    ap.add_argument("--no-stepping", action="store_true",
                    help="skip the Orthrus baseline that steps every iteration")
    ap.add_argument("--work-dir", default="/tmp/orthrus-vidur-bench", help="Vidur's output and cache")
    ap.add_argument("--out", help="write every run and the medians to this JSON file")
    args = ap.parse_args()
    console = Console(width=max(Console().width, 110))
    src = Path(args.vidur_src) if args.vidur_src else None
    if src is None or not (src / "bench.py").is_file():
        console.print("[yellow]No Vidur checkout (--vidur-src with bench.py): Orthrus only, "
                      "no ratio.[/]")
        src = None

    report: dict = {"rounds": args.rounds, "target_x_vidur": TARGET, "workloads": {}}
    for replicas in args.replicas:
        runs: dict[str, list[dict]] = {"vidur": [], "orthrus": [], "orthrus-stepping": []}
        ratios: list[float] = []
        if src is not None:  # the first Vidur run fits and caches its predictor: not timed
            run_vidur(src, args.vidur_python, replicas, Path(args.work_dir))
        for r in range(args.rounds):
            console.print(f"[dim]{replicas} replica(s), round {r + 1}/{args.rounds}[/]")
            if src is not None:
                runs["vidur"].append(rates(run_vidur(src, args.vidur_python, replicas,
                                                     Path(args.work_dir))))
            runs["orthrus"].append(rates(run_orthrus(replicas, fast=True)))
            if src is not None:
                ratios.append(runs["orthrus"][-1]["requests_per_s"] / runs["vidur"][-1]["requests_per_s"])
            if not args.no_stepping:
                runs["orthrus-stepping"].append(rates(run_orthrus(replicas, fast=False)))
        requests, rate = WORKLOADS[replicas]
        table = Table(title=f"Vidur's reference workload: {replicas} x A100, Llama-2-7B, "
                            f"{requests:,} requests Poisson {rate:g}/s (medians of {args.rounds})")
        for col in ("simulator", "wall s", "iterations", "simulated s", "requests/wall-s",
                    "iterations/wall-s", "x Vidur"):
            table.add_column(col, justify="right")
        medians = {}
        for name, label in (("vidur", "Vidur (event loop)"), ("orthrus", "Orthrus, decode runs"),
                            ("orthrus-stepping", "Orthrus, every iteration")):
            if not runs[name]:
                continue
            med = {k: statistics.median(run[k] for run in runs[name])
                   for k in ("wall_s", "iterations", "sim_end_s", "requests_per_s", "iterations_per_s")}
            medians[name] = med
            x = ""
            if runs["vidur"]:
                x = f"{med['requests_per_s'] / medians['vidur']['requests_per_s']:.1f}"
            table.add_row(label, f"{med['wall_s']:.2f}", f"{med['iterations']:,.0f}",
                          f"{med['sim_end_s']:,.0f}", f"{med['requests_per_s']:,.0f}",
                          f"{med['iterations_per_s']:,.0f}", x)
        console.print(table)
        if ratios:
            ratio = statistics.median(ratios)
            verdict = "[green]meets[/]" if ratio >= TARGET else "[red]misses[/]"
            console.print(f"Orthrus / Vidur, simulated requests per wall-second, per round: "
                          f"{', '.join(f'{x:.1f}' for x in ratios)}; median {ratio:.1f}x "
                          f"({verdict} the {TARGET:g}x target)")
        report["workloads"][str(replicas)] = {"runs": runs, "medians": medians,
                                              "ratios": ratios}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
