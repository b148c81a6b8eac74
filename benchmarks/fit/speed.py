"""How long a fit takes on the mix sweep at paper scale (issue 34's speed targets).

The case of docs/fitting.md's coupled pool: a Dedicated-1:3 split of `scenarios/mix_sweep.yaml`
(4 x A100, 512 closed-loop clients in one mixed pool, 180 s) "measured" at three mixes by
simulating a hidden truth (the shipped calibration with slower embeddings and decodes), each
kind's throughput and p50 latency. Then, knowing only those numbers, it times

* one simulation of the split at each mix (the unit a fit is paid in);
* a separate fit at each mix (one measured run: the user with one dashboard);
* one joint fit over the three mixes (each run under its own ``workload.generation_share``),

and prints each one's simulations, seconds and the ratios the targets are stated in (a fit
<= 3 minutes; the joint fit <= 2x the three separate ones together). Everything runs in this
process, one after the other, so the ratios compare like with like on a noisy machine.

``--only published`` times the fit of the paper's three published Dedicated-1:3 rows (issue
63's case: the mix sweep in one mixed pool from a cold start), ``--only paper`` the joint fit
over all 13 of its baseline figures (``scenarios/paper/baselines.yaml``; this code only).

Only the separate fits use nothing newer than the fit of 2026-12-02, so the same script
measures the code before this work when that checkout comes first on the path (``-P``: not the
current directory first, so ``/tmp/before``'s orthrus_sim is found before this one's, and this
checkout's ``benchmarks`` after it)::

    python -m benchmarks.fit.speed --out out/fit-speed
    git worktree add /tmp/before 9b46a18
    PYTHONPATH=/tmp/before:$PWD python -P -m benchmarks.fit.speed --only separate \
        --out out/fit-speed-before
"""

from __future__ import annotations

import inspect
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

import orthrus_sim
from benchmarks.common import parser, table
from orthrus_sim.costmodel import load_calibration, save_calibration
from orthrus_sim.costmodel.calibration import CostFactorsModel
from orthrus_sim.experiment.measured import MeasuredRun, run_metrics
from orthrus_sim.experiment.results import write_json
from orthrus_sim.experiment.scenario import load_scenario
from orthrus_sim.questions.fit import fit
from orthrus_sim.sim.run import simulate

SHARES = (0.1, 0.5, 0.9)
# the paper's published Dedicated-1:3 figures (emb/s, gen/s) at each share, as issue 63 timed
# their fit: the mix sweep in one mixed pool from a cold start (scenarios/paper/baselines.yaml)
PUBLISHED = {0.1: (15.64, 1.49), 0.5: (12.54, 11.97), 0.9: (5.10, 29.56)}
COLD = ["warmup_s=0", "workload.arrival.ramp_s=0"]
PAPER_BASELINES = Path(orthrus_sim.__file__).parents[1] / "scenarios" / "paper" / "baselines.yaml"
CONFIGURATION = "dedicated-1:3"
TRUTH = {"embedding_scale": 2.0, "decode_scale": 1.4, "embedding_overhead_s": 0.004}
SHOWN = ("throughput_rps.embedding", "throughput_rps.generation", "latency_s.embedding.p50",
         "latency_s.generation.p50")
FIXED = {"prefill_scale": 1.0, "generation_overhead_s": 0.0}
TARGET_S = 180.0


def overrides(share: float, calibration: str | None = None) -> list[str]:
    out = ["workload.arrival.pools=mixed", f"workload.generation_share={share}",
           f"configurations=[{CONFIGURATION}]"]
    return out + ([f"calibration={calibration}"] if calibration else [])


def truth_calibration(path: Path) -> str:
    cal = load_calibration(Path(orthrus_sim.__file__).parents[1] / "calibration" / "a100-40gb.json")
    save_calibration(cal.model_copy(update={"factors": CostFactorsModel(**TRUTH)}), path)
    return str(path)


def measure(share: float, truth: str) -> tuple[MeasuredRun, float]:
    """The truth's split at ``share``: its shown metrics, and the simulation's seconds."""
    start = time.perf_counter()
    metrics = simulate(load_scenario("mix_sweep", overrides(share, truth)), CONFIGURATION,
                       keep_rows=False).metrics
    seconds = time.perf_counter() - start
    shown = {k: v for k, v in run_metrics(metrics, "truth").items() if k in SHOWN}
    return MeasuredRun(CONFIGURATION, shown, f"truth at {share}"), seconds


def timed_fit(scenario, runs: list[MeasuredRun], workers: int, fixed: dict | None = None,
              spread: float | None = 0.05) -> dict:
    kwargs = {"spread": spread} if spread and "spread" in inspect.signature(fit).parameters \
        else {}
    start = time.perf_counter()
    result = fit(scenario, runs, workers, FIXED if fixed is None else fixed, **kwargs)
    seconds = time.perf_counter() - start
    worst = max((abs(r["residual"]) for r in result.residuals if r["residual"] is not None),
                default=None)
    # ``simulations``: factor sets, each all the runs (what the fit reports as evaluations);
    # ``runs``: the simulations run, where the fit counts them (a run a factor set does not
    # change is reused)
    return {"seconds": seconds, "simulations": result.evaluations,
            "runs": getattr(result, "simulations", None), "worst_residual": worst,
            "misses": len(result.misses) if hasattr(result, "misses") else None,
            "fitted": {n: p["value"] for n, p in result.parameters.items()
                       if p["status"] == "fitted"}}


def published_runs() -> list[MeasuredRun]:
    """The paper's three Dedicated-1:3 rows, each at its share."""
    return [MeasuredRun(CONFIGURATION, {"throughput_rps.embedding": emb,
                                        "throughput_rps.generation": gen},
                        f"published at {share}", None, (f"workload.generation_share={share}",))
            for share, (emb, gen) in PUBLISHED.items()]


def with_overrides(run: MeasuredRun, share: float) -> MeasuredRun:
    return MeasuredRun(run.configuration, run.metrics, run.source, None,
                       (f"workload.generation_share={share}",))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", choices=("separate", "joint", "both", "published", "paper"),
                    default="both", help="published: the paper's three Dedicated-1:3 rows "
                    "(the code of any date runs it); paper: the joint fit over its 13 baseline "
                    "figures (scenarios/paper/baselines.yaml)")
    ap.add_argument("--out", type=Path, default=None, help="folder for fit_speed.json")
    args = ap.parse_args()
    console = Console()
    rows: list[dict] = []
    if args.only in ("published", "paper"):
        if args.only == "published":
            sc = load_scenario("mix_sweep", overrides(0.5) + COLD)
            row = timed_fit(sc, published_runs(), args.workers, {}, None)
        else:
            from orthrus_sim.experiment.measured import load_measured

            row = timed_fit(load_scenario("paper/mix_sweep"), load_measured([PAPER_BASELINES]),
                            args.workers, {}, None)
        rows.append({"case": f"{args.only} fit"} | row)
        console.print(f"{args.only} fit: {row['seconds']:.0f} s, {row['simulations']} factor "
                      f"sets, {row['runs']} simulations, {row['misses']} misses")
        report(rows, console, args.workers)
        if args.out:
            write_json({"workers": args.workers, "rows": rows}, args.out / "fit_speed.json")
        return
    with tempfile.TemporaryDirectory() as tmp:
        truth = truth_calibration(Path(tmp) / "truth.json")
        measured = {}
        for share in SHARES:
            run, seconds = measure(share, truth)
            measured[share] = run
            rows.append({"case": f"one simulation at {share}", "seconds": seconds,
                         "simulations": 1})
            console.print(f"simulated the truth at {share}: {seconds:.1f} s")
        if args.only in ("separate", "both"):
            for share in SHARES:
                sc = load_scenario("mix_sweep", overrides(share))
                row = timed_fit(sc, [measured[share]], args.workers)
                rows.append({"case": f"separate fit at {share}"} | row)
                console.print(f"separate fit at {share}: {row['seconds']:.0f} s, "
                              f"{row['simulations']} simulations")
        if args.only in ("joint", "both"):
            sc = load_scenario("mix_sweep", overrides(0.5))
            row = timed_fit(sc, [with_overrides(measured[s], s) for s in SHARES], args.workers)
            rows.append({"case": "joint fit, 3 mixes"} | row)
            console.print(f"joint fit: {row['seconds']:.0f} s, {row['simulations']} simulations")
    report(rows, console, args.workers)
    if args.out:
        write_json({"workers": args.workers, "truth": TRUTH, "rows": rows},
                   args.out / "fit_speed.json")


def report(rows: list[dict], console: Console, workers: int) -> None:
    units = [r["seconds"] for r in rows if r["simulations"] == 1]
    unit = float(np.mean(units)) if units else None
    out = table(f"fits on the mix sweep (Dedicated-1:3, 512 clients, 180 s, one mixed "
                f"pool; {workers} workers)",
                ["case", "simulations", "seconds", "x one simulation", "worst residual", "fitted"],
                justify="left", overflow="fold")
    for r in rows:
        worst = r.get("worst_residual")
        out.add_row(r["case"], str(r["simulations"]), f"{r['seconds']:.1f}",
                    f"{r['seconds'] / unit:.1f}" if unit else "-",
                    "-" if worst is None else f"{worst:.1%}",
                    " ".join(f"{k}={v:.3g}" for k, v in r.get("fitted", {}).items()))
    console.print(out)
    separate = [r for r in rows if r["case"].startswith("separate")]
    joint = [r for r in rows if r["case"].startswith("joint")]
    if separate:
        worst = max(r["seconds"] for r in separate)
        console.print(f"slowest separate fit {worst:.0f} s (target <= {TARGET_S:.0f} s): "
                      + ("met" if worst <= TARGET_S else "missed"))
    if separate and joint:
        total = sum(r["seconds"] for r in separate)
        console.print(f"joint fit / three separate fits: {joint[0]['seconds'] / total:.2f} "
                      f"(target <= 2); / the median separate fit: "
                      f"{joint[0]['seconds'] / float(np.median([r['seconds'] for r in separate])):.2f}")


if __name__ == "__main__":
    main()
