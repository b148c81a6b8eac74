"""Capacity over traffic that moves: co-serving against the best frozen split and the split that
re-plans, on production traces and bursty loads (issue 62).

For each scenario (``traces_merged``, ``bursty_mmpp``, ``bursty_diurnal``) and GPU
(A100-40GB, H100-SXM, each with its shipped calibration), ``orthrus_sim.questions.capacity``
answers over the scenario's load scaled as a whole (``workload.rate_scale``), every answer
meeting the SLOs over the whole window (attainment >= 99 % per kind) and over its worst
5-minute stretch (>= 95 %):

* at 4, 8 and 16 GPUs, the largest scale each configuration holds: Orthrus (the adaptive
  router), every frozen split ``dedicated-E:G`` (at 16 GPUs the splits within 3 GPUs of twice
  the best at 8), the best of which is "frozen", and the re-planning split started from that
  best frozen split (``dedicated-replan-E:G``: the planner's own start, from its throughput
  model, put too few GPUs on the bursty embeddings);
* at the scale the best frozen split holds on 8 GPUs, the fewest GPUs (up to 16) each needs
  (the frozen and the re-planning split each from its best split of a GPU count).

Writes docs/capacity/moving.json and the generated part of docs/capacity.md (between its
``<!-- moving -->`` markers). Deterministic: the simulator is.

    python scripts/make_capacity_tables.py [--workers 2] [--scenarios traces_merged ...]
        [--hardware a100-40gb ...] [--tolerance 0.1] [--stop-early]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from doc_sections import write_section  # beside this script
from rich.console import Console

from orthrus_sim.experiment.scenario import load_scenario
from orthrus_sim.questions.capacity import (
    Evaluator,
    open_loop_load,
    search_gpus,
    search_rates,
)
from orthrus_sim.questions.sweep import point_runner

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "capacity"
PAGE = ROOT / "docs" / "capacity.md"
SCENARIOS = ["traces_merged", "bursty_mmpp", "bursty_diurnal"]
HARDWARE = ["a100-40gb", "h100-sxm"]
GPU_COUNTS = [4, 8, 16]
WHOLE, STRETCH = 0.99, 0.95
CO, REPLAN = "orthrus", "dedicated-replan"
STARTS = REPLAN + "-start"  # the capacity search's family: a re-planning split from each start


def splits(gpus: int, best_at_8: int | None) -> list[str]:
    """The frozen splits tried on ``gpus`` GPUs (embedding GPUs first)."""
    low, high = 1, gpus - 1
    if gpus > 8 and best_at_8 is not None:
        centre = best_at_8 * gpus // 8
        low, high = max(1, centre - 3), min(gpus - 1, centre + 3)
    return [f"dedicated-{e}:{gpus - e}" for e in range(low, high + 1)]


def one(name: str, hardware: str, tolerance: float, workers: int, console: Console,
        stop_early: bool = False) -> dict:
    sc = load_scenario(ROOT / "scenarios" / f"{name}.yaml", [f"hardware={hardware}"])
    load = open_loop_load(sc)
    wall = time.perf_counter()
    out: dict = {"scenario": name, "hardware": hardware, "calibration": sc.calibration,
                 "mean_rps": load.rates, "rates": {}, "stop_early": stop_early}
    with point_runner(workers) as run_points:
        # every run to its end unless asked: the tables say what a failing run missed, and by
        # how much (a run stopped early says only which kind failed, and when)
        ev = Evaluator(sc, load, WHOLE, run_points, console, STRETCH, stop_early=stop_early)
        best_at_8 = None
        for gpus in sorted(GPU_COUNTS, key=lambda g: (g > 8, g)):  # 8 before 16
            frozen = splits(gpus, best_at_8)
            rows = search_rates(ev, [CO, *frozen], gpus, tolerance, workers)
            by = {r["configuration"]: r for r in rows}
            best = max(frozen, key=lambda c: (by[c]["max_scale"], c))
            # the re-planning split starts where the best frozen one stays
            replan = f"{REPLAN}-{best.removeprefix('dedicated-')}"
            by |= {r["configuration"]: r for r in search_rates(ev, [replan], gpus, tolerance,
                                                                 workers)}
            if gpus == 8:
                best_at_8 = int(best.split("-")[1].split(":")[0])
            out["rates"][str(gpus)] = {
                "orthrus": _rate(by[CO]), "replan": _rate(by[replan]) | {"start": best},
                "frozen": _rate(by[best]) | {"split": best},
                "splits": {c: by[c]["max_scale"] for c in frozen}}
        scale = out["rates"]["8"]["frozen"]["max_scale"]
        out["scale_at_8"] = scale
        if scale > 0:
            demand = {k: r * scale for k, r in load.rates.items()}
            fams = search_gpus(ev, [CO, STARTS, "dedicated"], demand, 16,
                               {CO: 8, STARTS: 8, "dedicated": 8})
            out["gpus_at_scale"] = {f["family"]: {"gpus": f["gpus_needed"],
                                                  "configuration": f["configuration"],
                                                  "runs": _brief(f["runs"])}
                                    for f in fams}
    out["simulations"] = len(ev.done)
    out["wall_s"] = time.perf_counter() - wall
    return out


def _rate(r: dict) -> dict:
    """A rate search's answer and why the next scale fails."""
    failing = [x for x in r["runs"] if r["next_rate_rps"] is not None
               and abs(x["offered_rps"] - r["next_rate_rps"]) < 1e-9]
    return {"max_scale": r["max_scale"], "max_rate_rps": r["max_rate_rps"],
            "attainment": r["attainment_at_max"], "bound": r["bound"],
            "fails_next": _why(failing[0]) if failing else None}


def _why(run: dict) -> str:
    """Which kind and criterion a failing run missed."""
    stop = run.get("stopped_early")
    if stop:
        return (f"{stop['kind']} missed more than {1 - WHOLE:.0%} of its requests by "
                f"{stop['time_s']:.0f} s (stopped)")
    out = []
    for kind in ("embedding", "generation"):
        whole, worst = run["attainment"][kind], run["worst_stretch"][kind]
        if whole is not None and whole < WHOLE:
            out.append(f"{kind} {whole:.1%} over the window")
        elif worst is not None and worst < STRETCH:
            out.append(f"{kind} {worst:.1%} over its worst 5 min")
    return ", ".join(out) or "-"


def _brief(runs: list[dict]) -> list[dict]:
    return [{"configuration": r["configuration"], "gpus": r["gpus"], "passed": r["passed"],
             "attainment": r["attainment"], "worst_stretch": r["worst_stretch"]} for r in runs]


def table(results: list[dict]) -> str:
    lines = []
    for res in results:
        rates = res["rates"]
        lines += [f"**{res['scenario']}, {res['hardware']}** (mean {res['mean_rps']['generation']:.1f} "
                  f"generations/s and {res['mean_rps']['embedding']:.1f} embeddings/s at scale 1; "
                  f"{res['simulations']} simulations, {res['wall_s'] / 60:.0f} min"
                  + (", failing runs stopped early" if res.get("stop_early") else "") + ")", "",
                  "| GPUs | Orthrus: largest scale | best frozen split | its scale | re-planning split "
                  "| Orthrus / frozen | Orthrus / re-planning | next scale fails (Orthrus; frozen) |",
                  "|---|---|---|---|---|---|---|---|"]
        for gpus in sorted(rates, key=int):
            r = rates[gpus]
            co, fr, rp = (r[k]["max_scale"] for k in ("orthrus", "frozen", "replan"))
            ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"  # noqa: E731
            lines.append(f"| {gpus} | {co:.2f} | {r['frozen']['split']} | {fr:.2f} | {rp:.2f} | "
                         f"{ratio(co, fr)} | {ratio(co, rp)} | {r['orthrus']['fails_next']}; "
                         f"{r['frozen']['fails_next']} |")
        g = res.get("gpus_at_scale")
        if g:
            need = {k: v["gpus"] for k, v in g.items()}
            fmt = lambda n: str(n) if n else "> 16"  # noqa: E731
            lines += ["", f"At scale {res['scale_at_8']:.2f} (the most the best frozen split holds "
                      f"on 8 GPUs), fewest GPUs: Orthrus {fmt(need[CO])}, best frozen split "
                      f"{fmt(need['dedicated'])} ({g['dedicated']['configuration']}), re-planning "
                      f"split {fmt(need[STARTS])} ({g[STARTS]['configuration']})."]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--scenarios", nargs="*", default=SCENARIOS)
    ap.add_argument("--hardware", nargs="*", default=HARDWARE)
    ap.add_argument("--tolerance", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--stop-early", action="store_true",
                    help="stop each failing run once it fails (faster; its 'why' says only "
                    "which kind failed and when)")
    args = ap.parse_args()
    console = Console()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "moving.json"
    done = json.loads(path.read_text()) if path.exists() else []
    for hardware in args.hardware:
        for name in args.scenarios:
            if any(d["scenario"] == name and d["hardware"] == hardware for d in done):
                continue  # kept from an earlier run: delete moving.json to redo it
            console.print(f"[bold]{name} on {hardware}[/bold]")
            done.append(one(name, hardware, args.tolerance, args.workers, console,
                            args.stop_early))
            path.write_text(json.dumps(done, indent=1))
    body = table([d for h in HARDWARE for s in SCENARIOS for d in done
                  if d["scenario"] == s and d["hardware"] == h])
    write_section(PAGE, "<!-- moving -->", "<!-- /moving -->", body)
    console.print(body)


if __name__ == "__main__":
    main()
