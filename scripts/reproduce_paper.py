"""The paper reconciled (docs/paper.md): one calibration fitted to every baseline figure the paper
published, Orthrus predicted on each of its setups with ranges, and the predicted gain split
into what the fixed split, the raw metric, the window and one-pass batching each give.

Steps, every one a simulation of the scenarios in ``scenarios/paper/`` (deterministic: each
scenario's own seed, 1 for the mix sweep and 6 for Iter-RetGen; the prediction ranges add seeds
+1..+N of each):

1. ``orthrus-sim fit`` over the 13 figures of ``scenarios/paper/baselines.yaml`` (one joint fit,
   each run under its own scenario); the calibration goes to ``docs/paper/fitted.json``;
2. ``orthrus-sim predict``: Orthrus on each setup at the fit and at every end of its ranges,
   and what to measure next;
3. the decomposition: each setup's configurations in the paper's window and in a steady one,
   with the fitted calibration and with the shipped A100 calibration alone (no server costs).

Writes the generated sections of ``docs/paper.md`` (between its markers) and
``docs/paper/paper.json``; prints the fit's and the whole run's time (kept out of the page, so
a rerun writes it byte for byte the same).

    python scripts/reproduce_paper.py [--workers 2] [--seeds 8] [--fit FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from doc_sections import write_section

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "paper.md"
OUT = ROOT / "docs" / "paper"
MEASURED = ROOT / "scenarios" / "paper" / "baselines.yaml"
OWN = "a100-40gb"  # our own calibration of the paper's card, without the paper's server costs
MIX_STEADY = ["workload.arrival.ramp_s=20", "warmup_s=60", "duration_s=360"]
ITER_STEADY = ["workload.arrival.process=closed-loop", "duration_s=2400", "warmup_s=600"]
# goodput's SLOs (the paper states none; ours): an embedding within 1 s, a generation's first
# token within 2 s and every next one within 100 ms
SLO = ["slo.latency_s=1.0", "slo.ttft_s=2.0", "slo.tpot_s=0.1"]
SPLITS = ["dedicated-1:3", "dedicated-2:2", "dedicated-3:1"]
PLANNER_TARGET_X = 2.0  # the planner's TPOT target: this many times the baseline's TPOT p50


@dataclass(frozen=True)
class Setup:
    """One of the paper's setups: a scenario (with overrides), the baseline the paper compared
    Orthrus with there, and the paper's metric."""

    name: str
    scenario: str
    overrides: tuple[str, ...]
    baseline: str
    metric: str  # throughput_rps.<combined|workflow>
    gpus: int

    @property
    def mix(self) -> bool:
        return self.metric == "throughput_rps.combined"

    def steady(self) -> list[str]:
        """The overrides of a steady window: clients ramped in, a warm-up, a long window (a
        dataset run: the same questions' concurrency as a closed loop)."""
        if self.mix:
            return MIX_STEADY + SLO
        return ITER_STEADY + [f"workload.arrival.clients={100 * self.gpus}"]


SETUPS = [
    Setup("mix 9:1", "paper/mix_sweep", ("workload.generation_share=0.1",), "dedicated-1:3",
          "throughput_rps.combined", 4),
    Setup("mix 5:5", "paper/mix_sweep", ("workload.generation_share=0.5",), "dedicated-1:3",
          "throughput_rps.combined", 4),
    Setup("mix 1:9", "paper/mix_sweep", ("workload.generation_share=0.9",), "dedicated-1:3",
          "throughput_rps.combined", 4),
    Setup("Iter-RetGen, 4 GPUs", "paper/iter_retgen", (), "dedicated-1:3",
          "throughput_rps.workflow", 4),
    Setup("Iter-RetGen, 1 GPU", "paper/iter_retgen",
          ("cluster.gpus=1", "workload.arrival.clients=100"), "unified-homo",
          "throughput_rps.workflow", 1),
]


def get(metrics: dict, path: str) -> float | None:
    node = metrics
    for key in path.split("."):
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return float(node)


# ----- simulations ---------------------------------------------------------------------------
class Runs:
    """Simulations of (setup, window, configuration) under a calibration, in one process pool,
    each once."""

    def __init__(self, workers: int) -> None:
        from orthrus_sim.questions.run import process_pool

        self.pool = process_pool(workers)
        self.done: dict[tuple, dict] = {}

    def close(self) -> None:
        self.pool.shutdown()

    def run(self, wanted: list[tuple[Setup, tuple[str, ...], str, str]]) -> None:
        """Simulate each (setup, extra overrides, configuration, calibration) not run yet."""
        from orthrus_sim.experiment.scenario import load_scenario, scenario_dump
        from orthrus_sim.questions.run import Task

        todo = [w for w in dict.fromkeys(wanted) if w not in self.done]
        futures = []
        for setup, extra, cfg, cal in todo:
            sc = load_scenario(setup.scenario, [*setup.overrides, *extra,
                                                f"configurations=[{cfg}]", f"calibration={cal}"])
            futures.append(self.pool.submit(_metrics, Task(scenario_dump(sc), cfg, cfg)))
        for w, f in zip(todo, futures):
            self.done[w] = f.result()

    def get(self, setup: Setup, extra: tuple[str, ...], cfg: str, cal: str) -> dict:
        return self.done[setup, extra, cfg, cal]


def _metrics(task) -> dict:
    from orthrus_sim.questions.run import run_task

    return run_task(task).metrics


# ----- the decomposition ---------------------------------------------------------------------
def decompose(runs: Runs, setup: Setup, cal: str, bare: str | None = None) -> dict:
    """The predicted gain of Orthrus over the setup's baseline in the paper's metric and window,
    as a product: window x metric x stock embedding server x fixed split x unified serving x
    one-pass batching (each a ratio, below), and beside it the gain over the planner's
    placement and in goodput. ``bare``: ``cal`` without the stock embedding server's own
    terms (the splits' embeddings then cost what a unified replica's do); None: ``cal`` has
    none."""
    steady = tuple(setup.steady())
    configs = ["orthrus", setup.baseline, "unified-homo"]
    splits = SPLITS if setup.gpus == 4 else []
    bare = bare or cal
    wanted = [(setup, (), c, cal) for c in configs]
    wanted += [(setup, steady, c, cal) for c in configs + splits]
    wanted += [(setup, steady, c, bare) for c in configs + splits]
    if setup.mix:
        # one kind alone on the cluster, steady: what normalised throughput divides by
        wanted += [(setup, steady + (f"workload.generation_share={s}",), "orthrus", cal)
                   for s in (0.0, 1.0)]
    runs.run(wanted)
    raw = setup.metric
    paper = {c: get(runs.get(setup, (), c, cal), raw) for c in configs}
    at = {c: runs.get(setup, steady, c, cal) for c in configs + splits}
    plain = {c: runs.get(setup, steady, c, bare) for c in configs + splits}
    if setup.mix:
        ref = {"embedding": get(runs.get(setup, steady + ("workload.generation_share=0.0",),
                                         "orthrus", cal), "throughput_rps.embedding"),
               "generation": get(runs.get(setup, steady + ("workload.generation_share=1.0",),
                                          "orthrus", cal), "throughput_rps.generation")}

        def norm(m: dict) -> float:
            return sum((get(m, f"throughput_rps.{k}") or 0.0) / ref[k] for k in ref)
    else:  # a workflow is both kinds in fixed proportion: normalising changes no ratio
        def norm(m: dict) -> float:
            return get(m, raw) or 0.0
    base = setup.baseline
    best = max(splits or [base], key=lambda c: norm(plain[c]))
    g_paper = paper["orthrus"] / paper[base]
    g_steady = get(at["orthrus"], raw) / get(at[base], raw)
    g_norm = norm(at["orthrus"]) / norm(at[base])
    g_bare = norm(plain["orthrus"]) / norm(plain[base])
    out = {
        "gain": g_paper,
        "window": g_paper / g_steady,
        "metric": g_steady / g_norm,
        "stock": g_norm / g_bare,
        "split": norm(plain[best]) / norm(plain[base]), "best_split": best,
        "unified": norm(plain["unified-homo"]) / norm(plain[best]),
        "batching": norm(plain["orthrus"]) / norm(plain["unified-homo"]),
        "over_best_split": norm(plain["orthrus"]) / norm(plain[best]),
        "over_paper_split": norm(at["orthrus"]) / max(norm(at[c]) for c in splits or [base]),
    }
    if setup.mix:
        goodput = [sum((get(at[c], f"slo.{k}.goodput_rps") or 0.0) / ref[k] for k in ref)
                   for c in ("orthrus", base)]
        # none where the baseline meets the SLOs on nothing (no ratio to give)
        out["goodput"] = goodput[0] / goodput[1] if goodput[1] else None
    out |= _planner(runs, setup, steady, cal, at, norm)
    out["over_planner"] = None if out["planner"] is None else g_norm / out["planner"]
    return out


def _planner(runs: Runs, setup: Setup, steady: tuple[str, ...], cal: str, at: dict,
             norm) -> dict:
    """Orthrus over the adaptive router's placement (the placement planner: every split, with
    and without embeddings riding beside the decodes), at a TPOT target of
    ``PLANNER_TARGET_X`` x the baseline's TPOT p50; none on one GPU."""
    tpot = get(at[setup.baseline], "latency_s.tpot.p50")
    if setup.gpus < 2 or not tpot:
        return {"planner": None}
    target = round(PLANNER_TARGET_X * tpot, 4)
    extra = steady + ("cluster.router=adaptive", f"scheduler.tpot_target_s={target}")
    runs.run([(setup, extra, "orthrus", cal)])
    return {"planner": norm(runs.get(setup, extra, "orthrus", cal)) / norm(at[setup.baseline]),
            "planner_target_s": target}


# ----- the page ------------------------------------------------------------------------------
def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def ratio(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def fit_section(result) -> str:
    rows = ["| experiment | configuration | figure | published | fitted simulation | residual |",
            "|---|---|---|---|---|---|"]
    for r in result.residuals:
        where = ", ".join(a for a in r["at"]) or "-"
        sim = "-" if r["simulated"] is None else f"{r['simulated']:.4g}"
        rows.append(f"| {where} | {r['configuration']} | {r['metric']} | {r['measured']:.4g} | "
                    f"{sim} | {pct(r['residual'])} |")
    rows += ["", "| parameter | fitted value | status | standard error | sensitivity |",
             "|---|---|---|---|---|"]
    for name, p in result.parameters.items():
        se = "-" if p.get("standard_error") is None else f"{p['standard_error']:.3g}"
        sens = f"{p['sensitivity']:.3g}" if math.isfinite(p["sensitivity"]) else "inf"
        rows.append(f"| `{name}` | {p['value']:.4g} | {p['status']} | {se} | {sens} |")
    misses = len(result.misses)
    rows += ["", f"Within 10 %: {len(result.residuals) - misses} of {len(result.residuals)} "
                 f"figures; {result.evaluations} factor sets simulated."]
    if result.notes:
        rows += [""] + [f"* {n}" for n in result.notes]
    return "\n".join(rows)


def prediction_section(predictions: list[tuple[Setup, list, list, list]]) -> str:
    rows = ["| setup | metric | point | expected (range) | one run (range) | low end | "
            "high end |", "|---|---|---|---|---|---|---|"]
    for setup, ranges, _, _ in predictions:
        for r in ranges:
            mean = "-" if r.mean is None else (f"{r.mean:.4g} ({r.mean_low:.4g}..{r.mean_high:.4g})")
            rows.append(f"| {setup.name} | {r.metric} | {r.point:.4g} | {mean} | "
                        f"{r.low:.4g}..{r.high:.4g} | {r.low_end or '-'} | {r.high_end or '-'} |")
    rows += ["", "What to measure next (the widest range of each setup):", ""]
    for setup, _, nexts, runs in predictions:
        if not nexts and not runs:
            rows.append(f"* {setup.name}: nothing the baselines' runs report would narrow it")
            continue
        best = nexts[0] if nexts else None
        text = (f"{best.configuration} {best.metric}"
                + (f" ({best.kind}'s server)" if best.kind else "")
                + (f" at {', '.join(best.at)}" if best.at else "")
                + f": would remove ~{best.removes:.0%}") if best else ""
        if runs:
            r = runs[0]
            text += ("; " if text else "") + (
                f"or one more run of {r.configuration}"
                + (f" at {', '.join(r.at)}" if r.at else "") + f": ~{r.removes:.0%}")
        rows.append(f"* {setup.name}: {text}")
    return "\n".join(rows)


def decomposition_section(rows_by_cal: dict[str, list[tuple[Setup, dict]]]) -> str:
    out = []
    for title, rows in rows_by_cal.items():
        out += [f"**{title}**", "",
                "| setup | baseline | gain (paper's metric, window) | window | raw metric "
                "| stock embedding server | fixed split (best split) | unified, homogeneous | "
                "one-pass batching | over the best split, its server's costs | over the "
                "planner | goodput |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for setup, d in rows:
            out.append(
                f"| {setup.name} | {setup.baseline} | {ratio(d['gain'])} | {ratio(d['window'])} "
                f"| {ratio(d['metric'])} | {ratio(d['stock'])} | {ratio(d['split'])} "
                f"({d['best_split'].removeprefix('dedicated-')}) | {ratio(d['unified'])} | "
                f"{ratio(d['batching'])} | {ratio(d['over_paper_split'])} | "
                f"{ratio(d['over_planner'])} | {ratio(d.get('goodput'))} |")
        out.append("")
    return "\n".join(out)


def without_stock(cal):
    """``cal`` with the stock embedding server's own terms neutral: a split's embeddings then
    cost what a unified replica's do (every other fitted factor kept)."""
    from orthrus_sim.costmodel.calibration import CostFactorsModel

    factors = cal.factors.model_dump() if cal.factors else {}
    for name in ("stock_embedding_scale", "stock_embedding_padding",
                 "stock_embedding_overhead_s"):
        factors.pop(name, None)
    return cal.model_copy(update={"factors": CostFactorsModel(**factors), "factor_fit": None})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seeds", type=int, default=8, help="at most this many other seeds per "
                    "prediction (orthrus-sim predict --seeds)")
    ap.add_argument("--fit", type=Path, default=None, help="a calibration fitted before (skip "
                    "step 1; the page's fit section is then left as it is)")
    args = ap.parse_args()
    from orthrus_sim.costmodel import load_calibration, save_calibration
    from orthrus_sim.experiment.measured import load_measured
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.questions.fit import fit
    from orthrus_sim.questions.predict import predict, suggest, suggest_run

    start = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    fitted = OUT / "fitted.json"
    base = load_scenario(SETUPS[0].scenario)
    fit_s = None
    if args.fit is None:
        t = time.perf_counter()
        result = fit(base, load_measured([MEASURED]), args.workers,
                     progress=lambda msg: print(f"fit: {msg}", flush=True))
        fit_s = time.perf_counter() - t
        save_calibration(result.calibration, fitted)
        write_section(DOC, "<!-- fit -->", "<!-- /fit -->", fit_section(result))
        print(f"fit: {fit_s:.0f} s, {result.evaluations} factor sets")
    else:
        save_calibration(load_calibration(args.fit), fitted)
    cal = load_calibration(fitted)

    predictions = []
    for setup in SETUPS:
        sc = load_scenario(setup.scenario, [*setup.overrides, "configurations=[orthrus]",
                                            f"calibration={fitted}"])
        metrics = ((setup.metric, "throughput_rps.embedding", "throughput_rps.generation")
                   if setup.mix else (setup.metric, "latency_s.workflow.p99"))
        ranges = predict(sc, cal, ["orthrus"], args.workers, metrics, args.seeds)
        widest = max(ranges, key=lambda r: (r.parameter_width, r.width))
        predictions.append((setup, ranges, suggest(widest, cal), suggest_run(widest, cal)))
        print(f"predicted {setup.name}", flush=True)
    write_section(DOC, "<!-- predictions -->", "<!-- /predictions -->",
                  prediction_section(predictions))

    bare = OUT / "fitted-without-stock.json"
    save_calibration(without_stock(cal), bare)
    runs = Runs(args.workers)
    try:
        tables = {}
        for title, c, b in (
                ("With the fitted calibration (the paper's server costs)", str(fitted), str(bare)),
                ("Our own A100 calibration, without the paper's server costs", OWN, None)):
            tables[title] = [(s, decompose(runs, s, c, b)) for s in SETUPS]
            print(f"decomposed: {title}", flush=True)
    finally:
        runs.close()
    write_section(DOC, "<!-- decomposition -->", "<!-- /decomposition -->",
                  decomposition_section(tables))
    doc = {"predictions": {s.name: [r.as_dict() for r in ranges]
                           for s, ranges, _, _ in predictions},
           "decomposition": {t: {s.name: d for s, d in rows} for t, rows in tables.items()}}
    (OUT / "paper.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    total = time.perf_counter() - start
    print(f"done in {total:.0f} s" + (f" (fit {fit_s:.0f} s)" if fit_s is not None else ""))


if __name__ == "__main__":
    main()
