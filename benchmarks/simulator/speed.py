"""Simulator speed against Vidur, on Vidur's own reference workload, in one run.

The workload (Vidur's reference): Llama-2-7B on A100s, chunked prefill with a 512-token
budget, at most 256 running requests, 128-token prompts and 512-token outputs arriving
Poisson: 10,000 requests at 6 req/s on one replica, and 40,000 at 24 req/s on four
(round-robin). Vidur runs from a checkout prepared as ``../shared/tools/vidur/README.md`` says
(``--vidur DIR`` and ``--vidur-python``, or the ``VIDUR_SRC`` and ``VIDUR_PYTHON`` variables),
two ways: *default* (its metrics files and Chrome trace written, plots off) and *lean*
(``--no-metrics_config_write_metrics --no-metrics_config_enable_chrome_trace``: it only
simulates and keeps the requests' metrics in memory, as ``orthrus-sim``'s ``simulate`` does).

Each simulator runs as a whole process (interpreter start, imports, set-up, simulation and
its metrics), timed from outside: that is what a user waits for. The loop alone is reported
beside it (Vidur's ``run_s``, Orthrus's ``simulate`` call). The first run of each is not timed:
Vidur's fits and caches its predictor, and both write their bytecode caches (the children run
with ``PYTHONDONTWRITEBYTECODE`` unset, as a user's second run would find them).

The machines are noisy (a neighbour can slow a run 1.5x for minutes): the runs alternate, round
after round; Orthrus, being short, runs ``--orthrus-repeat`` times a round and its fastest run
stands for the round. Each round's ratio is taken between neighbours, and the table shows
medians over rounds. Orthrus stepping every iteration (decode runs off) is measured beside them
as the baseline of the fast path.

``--paper`` times the mix sweep's paper-scale point instead (``scenarios/mix_sweep.yaml``: 4
GPUs, 512 closed-loop clients, 180 s; target < 1 s inside ``simulate`` for every
configuration), each configuration in its own process; ``--baseline DIR`` times another
checkout (``git worktree add DIR REV``) beside it, alternated, for a before/after ratio.

``--instructions`` counts what a whole 1-replica Orthrus process executes on Vidur's workload
under valgrind (cachegrind, no cache simulation) instead of timing it, beside ``--baseline DIR``:
a before/after ratio that neighbours do not move, for changes of a few per cent.

Run: python -m benchmarks.simulator.speed --vidur DIR --vidur-python PY
     [--rounds 3] [--replicas 1 4] [--no-stepping] [--no-default] [--out speed.json]
     python -m benchmarks.simulator.speed --paper [--baseline DIR] [--rounds 3] [--out paper.json]
     python -m benchmarks.simulator.speed --instructions [--baseline DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

# statistics, subprocess and benchmarks.common are imported where used: the timed child process
# (``child``) should pay for Orthrus's imports, not the harness's. The child runs this file (not
# ``-m``), so that with ``--baseline DIR`` (``PYTHONPATH=DIR``) it is this checkout's workload
# that another checkout's orthrus_sim simulates: the child imports nothing from ``benchmarks``.

TARGETS = {"lean": 20.0, "default": 30.0}  # x Vidur, whole processes
LINEAR_TARGET = 4.2  # 4 replicas (4x the requests) over 1 replica, Orthrus's simulate time
WORKLOADS = {1: (10_000, 6.0), 4: (40_000, 24.0)}  # replicas: (requests, req/s)
LEAN_FLAGS = ["--no-metrics_config_write_metrics", "--no-metrics_config_enable_chrome_trace"]


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


def vidur_args(replicas: int, out: Path, lean: bool) -> list[str]:
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
    args = [f"--{k}={v}" for k, v in flags.items()] + ["--no-metrics_config_store_plots"]
    return args + (LEAN_FLAGS if lean else [])


def child_env(**extra: str) -> dict:
    """The environment of a timed process: bytecode caches written and read."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **extra}


def run_vidur(src: Path, python: str, replicas: int, work: Path, lean: bool) -> dict:
    import subprocess

    env = child_env(WANDB_MODE="disabled", PYTHONPATH=str(src))
    start = time.perf_counter()
    proc = subprocess.run([python, "bench.py", *vidur_args(replicas, work, lean)], cwd=src,
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            res = json.loads(line.removeprefix("BENCH_RESULT "))
            return {"process_s": wall, "loop_s": res["run_s"], "requests": res["num_requests"],
                    "iterations": res["num_batches"], "sim_end_s": res["sim_end_time_s"]}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    raise SystemExit(f"Vidur run failed (exit {proc.returncode}):\n" + "\n".join(tail))


def run_orthrus(replicas: int, fast: bool) -> dict:
    """One whole Orthrus process (this script with ``--child``), timed from outside."""
    import subprocess

    cmd = [sys.executable, __file__, "--child", str(replicas)] + ([] if fast else ["--stepping"])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"Orthrus run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {"process_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def fastest_orthrus(replicas: int, repeat: int) -> dict:
    """The fastest of ``repeat`` runs of Orthrus's fast path: it stands for the round."""
    return min((run_orthrus(replicas, fast=True) for _ in range(max(1, repeat))),
               key=lambda r: r["process_s"])


def child(replicas: int, fast: bool) -> None:
    """The Orthrus process: parse the scenario, simulate it, print its figures as JSON."""
    from orthrus_sim.experiment.scenario import parse_scenario
    from orthrus_sim.sim.run import simulate

    scenario = parse_scenario(orthrus_scenario(replicas))
    start = time.perf_counter()
    result = simulate(scenario, scenario.configurations[0], fast_forward=fast, keep_rows=False)
    loop = time.perf_counter() - start
    m = result.metrics
    print(json.dumps({"loop_s": loop, "requests": m["completed"]["generation"],
                      "iterations": m["iterations"], "sim_end_s": m["sim_end_s"]}))


PAPER_TARGET_S = 1.0  # the mix sweep's paper-scale point, each configuration, inside simulate


def paper_child(configuration: str) -> None:
    """One configuration of the mix sweep's paper-scale point, timed inside ``simulate``."""
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.sim.run import simulate

    scenario = load_scenario("mix_sweep")
    start = time.perf_counter()
    result = simulate(scenario, configuration, keep_rows=False)
    seconds = time.perf_counter() - start
    m = result.metrics
    print(json.dumps({"simulate_s": seconds, "completed": sum(m["completed"].values()),
                      "issued": sum(m["issued"].values())}))


def run_paper(configuration: str, tree: Path | None) -> dict:
    """``paper_child`` in its own process, with this checkout's code or ``tree``'s."""
    import subprocess

    env = child_env(**({"PYTHONPATH": str(tree)} if tree is not None else {}))
    proc = subprocess.run([sys.executable, __file__, "--paper-child", configuration],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"paper-scale run of {configuration} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def paper_scale(console, rounds: int, repeat: int, baseline: Path | None) -> dict:
    """The mix sweep's paper-scale point (4 GPUs, 512 closed-loop clients, 180 s), every
    configuration: ``simulate`` seconds (the fastest of ``repeat`` a round, the median over
    rounds), and with ``baseline`` (another checkout) the same beside it, alternated."""
    import statistics

    from benchmarks.common import in_turn, table
    from orthrus_sim.experiment.scenario import load_scenario

    configurations = load_scenario("mix_sweep").configurations
    trees = {"this": None} | ({"baseline": baseline} if baseline is not None else {})
    runs: dict[str, dict[str, list[dict]]] = {t: {c: [] for c in configurations} for t in trees}
    for r in range(rounds):
        console.print(f"[dim]mix sweep at paper scale, round {r + 1}/{rounds}[/]")
        for c in configurations:
            for t in in_turn(list(trees), r):
                runs[t][c].append(min((run_paper(c, trees[t]) for _ in range(max(1, repeat))),
                                      key=lambda x: x["simulate_s"]))
    out = table(f"The mix sweep's paper-scale point: 4 GPUs, 512 clients, 180 s "
                f"(simulate seconds, medians of {rounds})",
                ["configuration", "seconds", "requests issued", "us per request"]
                + (["baseline s", "x baseline"] if baseline is not None else []))
    medians: dict[str, dict[str, float]] = {t: {} for t in trees}
    for c in configurations:
        for t in trees:
            medians[t][c] = statistics.median(x["simulate_s"] for x in runs[t][c])
        sec, issued = medians["this"][c], runs["this"][c][-1]["issued"]
        mark = "green" if sec < PAPER_TARGET_S else "red"
        row = [c, f"[{mark}]{sec:.2f}[/]", f"{issued:,}", f"{1e6 * sec / issued:.1f}"]
        if baseline is not None:
            row += [f"{medians['baseline'][c]:.2f}", f"{sec / medians['baseline'][c]:.2f}"]
        out.add_row(*row)
    console.print(out)
    met = sum(medians["this"][c] < PAPER_TARGET_S for c in configurations)
    console.print(f"under {PAPER_TARGET_S:g} s: {met} of {len(configurations)} configurations")
    return {"runs": runs, "medians": medians, "target_s": PAPER_TARGET_S}


def count_instructions(replicas: int, tree: Path | None) -> int:
    """Instructions one whole Orthrus process executes on Vidur's workload (``--child``), with
    this checkout's code or ``tree``'s, counted by valgrind's cachegrind without its cache
    simulation: a count a busy neighbour does not move (wall times here spread by 5-10 %), for
    the before/after ratio of a change too small to time. String hashes are fixed
    (``PYTHONHASHSEED=0``); what still varies between runs (addresses) moves it by ~1 %."""
    import re
    import shutil
    import subprocess

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind on PATH")
    env = child_env(PYTHONHASHSEED="0", **({"PYTHONPATH": str(tree)} if tree is not None else {}))
    proc = subprocess.run([valgrind, "--tool=cachegrind", "--cache-sim=no",
                           "--cachegrind-out-file=/dev/null", sys.executable, __file__,
                           "--child", str(replicas)], capture_output=True, text=True, env=env)
    found = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"counting instructions failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def instructions(console, rounds: int, replicas: int, baseline: Path | None) -> dict:
    """``count_instructions`` of this checkout and ``baseline``, alternated, medians."""
    import subprocess

    from benchmarks.common import alternate, medians

    trees = {"this": None} | ({"baseline": baseline} if baseline is not None else {})
    for tree in trees.values():  # bytecode caches written outside the count, as run_orthrus does
        env = child_env(**({"PYTHONPATH": str(tree)} if tree is not None else {}))
        subprocess.run([sys.executable, __file__, "--child", str(replicas)], env=env,
                       capture_output=True, check=True)
    counts = alternate({t: partial(count_instructions, replicas, tree) for t, tree in trees.items()},
                       rounds, announce=lambda r: console.print(
                           f"[dim]instructions, {replicas} replica(s), round {r + 1}/{rounds}[/]"))
    middle = medians(counts)
    line = f"instructions, {replicas} replica(s), whole process: this {middle['this']:,.0f}"
    if baseline is not None:
        line += (f", baseline {middle['baseline']:,.0f}: "
                 f"{middle['this'] / middle['baseline']:.3f}x")
    console.print(line)
    return {"replicas": replicas, "counts": counts, "medians": middle}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur", "--vidur-src", dest="vidur", default=os.environ.get("VIDUR_SRC"),
                    help="a Vidur checkout with bench.py (../shared/tools/vidur/README.md)")
    ap.add_argument("--vidur-python", default=os.environ.get("VIDUR_PYTHON", sys.executable),
                    help="the Python of Vidur's environment")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 4], choices=sorted(WORKLOADS))
    ap.add_argument("--no-stepping", action="store_true",
                    help="skip the Orthrus baseline that steps every iteration")
    ap.add_argument("--orthrus-repeat", type=int, default=3,
                    help="Orthrus runs per round; the fastest stands for the round")
    ap.add_argument("--no-default", action="store_true",
                    help="skip Vidur's default run (metrics files and trace written)")
    ap.add_argument("--work-dir", default="/tmp/orthrus-vidur-bench", help="Vidur's output and cache")
    ap.add_argument("--out", help="write every run and the medians to this JSON file")
    ap.add_argument("--paper", action="store_true",
                    help="time the mix sweep's paper-scale point instead (every configuration)")
    ap.add_argument("--baseline", type=Path,
                    help="with --paper or --instructions: another checkout (a git worktree) "
                         "measured alternately")
    ap.add_argument("--instructions", action="store_true",
                    help="count the instructions of the Orthrus process on Vidur's workload "
                         "(the first of --replicas) under valgrind instead of timing it")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--paper-child", help=argparse.SUPPRESS)
    ap.add_argument("--stepping", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, fast=not args.stepping)
        return
    if args.paper_child is not None:
        paper_child(args.paper_child)
        return

    from rich.console import Console

    from orthrus_sim.experiment.results import write_json

    console = Console(width=max(Console().width, 120))
    if args.paper:
        report = paper_scale(console, args.rounds, args.orthrus_repeat, args.baseline)
    elif args.instructions:
        report = instructions(console, args.rounds, args.replicas[0], args.baseline)
    else:
        report = against_vidur(console, args)
    if args.out:
        write_json(report, Path(args.out))
        console.print(f"wrote {args.out}")


def against_vidur(console, args) -> dict:
    """Vidur (lean and default) and Orthrus (its fast path, and stepping every iteration) on
    Vidur's reference workload, alternated round by round, for each replica count: the table,
    each round's ratio and the growth from one replica to four."""
    import statistics

    from benchmarks.common import alternate, table

    src = Path(args.vidur) if args.vidur else None
    if src is None or not (src / "bench.py").is_file():
        console.print("[yellow]No Vidur checkout (--vidur DIR with bench.py): Orthrus only, "
                      "no ratio.[/]")
        src = None
    vidur_modes = [] if src is None else ["lean"] + ([] if args.no_default else ["default"])
    work = Path(args.work_dir)
    report: dict = {"rounds": args.rounds, "targets_x_vidur": TARGETS, "workloads": {}}
    for replicas in args.replicas:
        systems = {f"vidur-{m}": partial(run_vidur, src, args.vidur_python, replicas, work,
                                         lean=m == "lean") for m in vidur_modes}
        systems["orthrus"] = partial(fastest_orthrus, replicas, args.orthrus_repeat)
        if not args.no_stepping:
            systems["orthrus-stepping"] = partial(run_orthrus, replicas, fast=False)
        names = list(systems)
        if src is not None:  # the first Vidur run fits and caches its predictor: not timed
            run_vidur(src, args.vidur_python, replicas, work, lean=True)
        run_orthrus(replicas, fast=True)  # bytecode caches written: not timed
        runs = alternate(systems, args.rounds, announce=lambda r, n=replicas: console.print(
            f"[dim]{n} replica(s), round {r + 1}/{args.rounds}[/]"))
        # each round's ratio between neighbours
        ratios = {m: [v["process_s"] / o["process_s"] for v, o in zip(runs[f"vidur-{m}"],
                                                                      runs["orthrus"])]
                  for m in vidur_modes}
        requests, rate = WORKLOADS[replicas]
        out = table(f"Vidur's reference workload: {replicas} x A100, Llama-2-7B, "
                    f"{requests:,} requests Poisson {rate:g}/s (medians of {args.rounds})",
                    ["simulator", "process s", "loop s", "iterations", "simulated s",
                     "requests / process-s", "x lean Vidur", "x default Vidur"])
        labels = {"vidur-default": "Vidur, default", "vidur-lean": "Vidur, lean",
                  "orthrus": "Orthrus, decode runs", "orthrus-stepping": "Orthrus, every iteration"}
        medians = {}
        for name in names:
            med = {k: statistics.median(run[k] for run in runs[name])
                   for k in ("process_s", "loop_s", "iterations", "sim_end_s")}
            medians[name] = med
        for name in names:
            med = medians[name]
            xs = [f"{medians[f'vidur-{m}']['process_s'] / med['process_s']:.1f}"
                  if f"vidur-{m}" in medians else "" for m in ("lean", "default")]
            out.add_row(labels[name], f"{med['process_s']:.2f}", f"{med['loop_s']:.2f}",
                        f"{med['iterations']:,.0f}", f"{med['sim_end_s']:,.0f}",
                        f"{requests / med['process_s']:,.0f}", *xs)
        console.print(out)
        for m in vidur_modes:
            ratio = statistics.median(ratios[m])
            verdict = "[green]meets[/]" if ratio >= TARGETS[m] else "[red]misses[/]"
            loop = medians[f"vidur-{m}"]["loop_s"] / medians["orthrus"]["loop_s"]
            console.print(f"Orthrus / {m} Vidur, whole processes, per round: "
                          f"{', '.join(f'{x:.1f}' for x in ratios[m])}; median {ratio:.1f}x "
                          f"({verdict} the {TARGETS[m]:g}x target); loops alone {loop:.1f}x")
        report["workloads"][str(replicas)] = {"runs": runs, "medians": medians, "ratios": ratios}
    if {"1", "4"} <= set(report["workloads"]):
        one, four = (report["workloads"][k]["medians"]["orthrus"]["loop_s"] for k in ("1", "4"))
        growth = four / one
        verdict = "[green]meets[/]" if growth <= LINEAR_TARGET else "[red]misses[/]"
        console.print(f"Orthrus, 4 replicas (4x the requests) / 1 replica, simulate time: "
                      f"{growth:.2f}x ({verdict} the {LINEAR_TARGET}x target)")
        report["four_over_one_loop"] = growth
    return report


if __name__ == "__main__":
    main()
