"""Prediction ranges against simulated ground truths (issue 34's targets; docs/fitting.md).

Per seed it hides random cost factors (embedding_scale, decode_scale, embedding_overhead_s,
overlap) in a calibration, simulates a Dedicated-1:1 split served by one mixed pool of clients
at three mixes (``--mixes``; what a deployment's dashboard shows: each kind's throughput and p50
latency, or with ``--measure throughputs`` the throughputs alone, as a published table gives
them), and then, knowing only those numbers:

* fits them jointly (one fit, each run under its own ``workload.generation_share``) and checks
  every parameter the fit calls fitted against the truth (within 10 %; an overhead within 10 %
  or 2 ms);
* predicts Orthrus at the middle mix with its range and checks that the truth's throughput of
  each kind lies inside: one run of the truth inside the range of one run, and the truth's
  expected throughput (the mean of ``--truth-seeds`` runs under seeds no prediction uses)
  inside the expected value's range; where the fit pinned every parameter, compares each range
  with the point's 2-sigma error band (the fitted parameters' standard errors carried to the
  prediction through its own finite differences, beside the sampling spread of one run or of
  the seeds' mean);
* takes the measurement the tool suggests for the widest range, "measures" it on the truth,
  fits again with it and reports how much each range narrowed; and the same for the one run it
  suggests (a measured configuration at one of its mixes, every metric kept that the published
  numbers left out: the same simulated run, as a bench that kept its whole report).

    python -m benchmarks.fit.ranges                  # 20 seeds, ~30-50 min on 2 cores
    python -m benchmarks.fit.ranges --measure throughputs   # the narrowing case
    python -m benchmarks.fit.ranges --seeds 3 --out out/fit-ranges
    python -m benchmarks.fit.ranges --setting paper --measure throughputs --seeds 10  # ~2 h

``--setting paper`` is the issue's own case at full size: Dedicated-1:3 of the A100 mix sweep,
512 clients in one mixed pool (90 s), where the prediction's sampling spread is small and an
overhead that binds can stand in for the embedding device's time.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress

from benchmarks.common import ROOT, parser, table
from orthrus_sim.costmodel import load_calibration, save_calibration
from orthrus_sim.costmodel.calibration import CostFactorsModel
from orthrus_sim.experiment.measured import MeasuredRun, run_metrics
from orthrus_sim.experiment.results import _get
from orthrus_sim.experiment.scenario import apply_overrides, parse_scenario, read_scenario
from orthrus_sim.questions.evaluation import (
    BY_NAME,
    Evaluator,
    Simulations,
    difference_steps,
    factors_at,
    jacobian,
    metric_value,
)
from orthrus_sim.questions.fit import fit
from orthrus_sim.questions.predict import predict, sampling_bound, suggest, suggest_run
from orthrus_sim.sim.run import simulate

PRIOR = ROOT / "calibration" / "cpu-2core-small.json"
A100 = ROOT / "calibration" / "a100-40gb.json"
MIXES = (0.1, 0.5, 0.9)
HIDDEN = ("embedding_scale", "decode_scale", "embedding_overhead_s", "overlap")
FIXED = {"prefill_scale": 1.0, "generation_overhead_s": 0.0}  # not hidden: held at the truth
THROUGHPUTS = ("throughput_rps.embedding", "throughput_rps.generation")
SHOWN = THROUGHPUTS + ("latency_s.embedding.p50", "latency_s.generation.p50")
MEASURED = {"all": SHOWN, "throughputs": THROUGHPUTS}  # --measure: what each mix shows
CO_SERVED = "orthrus"
CHECKED = ("throughput_rps.embedding", "throughput_rps.generation")
TRUTH_SEEDS = 64  # runs the truth's expected co-served throughput is averaged over


def scenario_raw(calibration: Path = PRIOR, seed: int = 5) -> dict:
    """A 2-replica CPU deployment, one mixed pool of 12 closed-loop clients."""
    return {
        "name": "fit-ground-truth", "seed": seed, "duration_s": 60, "warmup_s": 5,
        "hardware": "cpu-2core", "model": "orthrus-small", "calibration": str(calibration),
        "cluster": {"gpus": 2},
        "scheduler": {"token_budget": 2048, "chunk_size": 512, "max_num_seqs": 64},
        "workload": {
            "arrival": {"process": "closed-loop", "pools": "mixed", "clients": 12},
            "generation_share": 0.5,
            "embedding_input": {"dist": "uniform", "low": 64, "high": 256},
            "generation_prompt": {"dist": "fixed", "value": 128},
            "generation_output": {"dist": "uniform", "low": 16, "high": 64}},
        "configurations": ["dedicated-1:1"],
    }


def paper_raw(calibration: Path, seed: int) -> dict:
    """The issue's case: the mix sweep (4 x A100, 512 clients) in one mixed pool, 90 s."""
    raw = read_scenario("mix_sweep")
    raw.update(seed=seed, duration_s=90, calibration=str(calibration),
               configurations=["dedicated-1:3"])
    raw["workload"]["arrival"]["pools"] = "mixed"
    return raw


@dataclass(frozen=True)
class Setting:
    """Where the hidden truth is measured: the prior, the split and the scenario."""

    prior: Path
    split: str
    describe: str
    scenario: Callable[[Path, int], dict]  # (calibration, seed) -> the raw scenario

    def raw(self, calibration: Path | None = None, seed: int = 5) -> dict:
        return self.scenario(calibration or self.prior, seed)


SETTINGS = {
    "cpu": Setting(PRIOR, "dedicated-1:1", "2 CPU replicas, 12 clients, 60 s", scenario_raw),
    "paper": Setting(A100, "dedicated-1:3", "4 x A100 mix sweep, 512 clients, 90 s", paper_raw),
}


def hidden_truth(seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    return {"embedding_scale": math.exp(rng.uniform(math.log(0.5), math.log(2.5))),
            "decode_scale": math.exp(rng.uniform(math.log(0.5), math.log(2.5))),
            "embedding_overhead_s": rng.uniform(0.0, 0.04),
            "overlap": rng.uniform(0.2, 1.6)}


def truth_file(factors: dict[str, float], path: Path, prior: Path = PRIOR) -> Path:
    cal = load_calibration(prior)
    save_calibration(cal.model_copy(update={"factors": CostFactorsModel(**factors)}), path)
    return path


def measure(raw: dict, configuration: str, share: float) -> dict:
    """One simulated "measurement": the configuration's metrics at a mix."""
    return measure_at(raw, configuration, [f"workload.generation_share={share}"])


def measure_at(raw: dict, configuration: str, overrides: list[str]) -> dict:
    """The configuration's metrics under scenario overrides (a suggestion's ``at``)."""
    sc = parse_scenario(apply_overrides(raw, overrides))
    return simulate(sc, configuration, keep_rows=False).metrics


def measured_runs(raw_truth: dict, mixes: tuple[float, ...] = MIXES,
                  shown: tuple[str, ...] = SHOWN, split: str = "dedicated-1:1") -> list[MeasuredRun]:
    runs = []
    for share in mixes:
        metrics = run_metrics(measure(raw_truth, split, share), "truth")
        runs.append(MeasuredRun(split, {k: metrics[k] for k in shown if k in metrics},
                                "ground truth", None, (f"workload.generation_share={share}",)))
    return runs


def _close(name: str, err: float, value: float) -> bool:
    """Within 10 % (an overhead: or within 2 ms)."""
    return err <= 0.1 * value or (name.endswith("_overhead_s") and err <= 0.002)


def freed(result) -> set[str]:
    """Fitted parameters that another one's range end frees by more than 10 % (a trade's far
    corner: an overhead binding where the fit had the device time)."""
    out = set()
    for e in result.calibration.factor_fit.range_ends:
        name = e.moved_too
        if name and not _close(name, abs(e.factors[name] - result.parameters[name]["value"]),
                               result.parameters[name]["value"]):
            out.add(name)
    return out


def recovered(result, truth: dict[str, float]) -> dict[str, bool]:
    """Each parameter the measurements determine to 10 % (fitted, with two standard errors at
    the stated spread within 10 % of its value, and no trade that frees it) against its truth:
    within 10 %."""
    out, loose = {}, freed(result)
    for name in HIDDEN:
        p = result.parameters[name]
        if p["status"] == "fitted" and name not in loose and _close(
                name, 2 * (p.get("standard_error") or 0), p["value"]):
            out[name] = _close(name, abs(p["value"] - truth[name]), truth[name])
    return out


def band(variance: float | None, noise: float) -> float | None:
    """A 2-sigma band (relative full width) from the parameters' variance of a prediction's log
    and a sampling spread ``noise`` (an sd of its log) beside it."""
    return None if variance is None else 4 * math.sqrt(variance + noise ** 2)


def error_variance(sc, mid, runs, result, metric: str, workers: int, spread: float,
                   prior: Path = PRIOR) -> float | None:
    """The variance of the co-served prediction's log that the fitted parameters' covariance
    gives (the fit's Jacobian, the residuals' scatter or the stated spread, whichever is
    larger), carried through the prediction's own finite differences. None unless every hidden
    parameter was fitted."""
    params = result.parameters
    if any(params[n]["status"] != "fitted" for n in HIDDEN):
        return None
    cal = result.calibration
    at = cal.cost_factors()
    names = list(HIDDEN)
    z = np.array([BY_NAME[n].to_z(getattr(at, n)) for n in names])
    with tempfile.TemporaryDirectory() as tmp:
        with Evaluator(sc, load_calibration(prior), runs, workers, Path(tmp) / "fit") as ev:
            jac = jacobian(ev, at, names, z)
            r = ev.residuals(ev.simulate([at])[0])
        m, k = jac.shape
        sigma = max(math.sqrt(float(r @ r) / max(m - k, 1)), spread)
        cov = sigma ** 2 * np.linalg.pinv(jac.T @ jac)
        steps = difference_steps(names, z)
        points = [at] + [factors_at(at, names, z + np.eye(k)[i] * steps[i]) for i in range(k)]
        (Path(tmp) / "pred").mkdir()
        with Simulations(mid, cal, [((), CO_SERVED)], workers, Path(tmp) / "pred") as sims:
            values = [_get(d[((), CO_SERVED)], metric) for d in sims.simulate(points)]
    if not values[0] or not all(values):
        return None
    grad = np.array([(math.log(v) - math.log(values[0])) / steps[i] for i, v in enumerate(values[1:])])
    return max(float(grad @ cov @ grad), 0.0)


def expected_truth(raw_truth: dict, seeds: int) -> dict[str, float]:
    """The truth's expected co-served throughputs at the middle mix: the geometric mean over
    ``seeds`` runs under seeds that no prediction uses (the scenario's + 101...), what the
    expected-value range claims to hold."""
    first = raw_truth["seed"] + 101
    logs: dict[str, list[float]] = {m: [] for m in CHECKED}
    for s in range(first, first + seeds):
        doc = measure_at(raw_truth, CO_SERVED, ["workload.generation_share=0.5", f"seed={s}"])
        for m in CHECKED:
            if _get(doc, m):
                logs[m].append(math.log(_get(doc, m)))
    return {m: math.exp(sum(v) / len(v)) for m, v in logs.items() if v}


def one_seed(seed: int, workers: int, work: Path, spread: float,
             mixes: tuple[float, ...] = MIXES, shown: tuple[str, ...] = SHOWN,
             setting: Setting = SETTINGS["cpu"], truth_seeds: int = TRUTH_SEEDS) -> dict:
    truth = hidden_truth(seed)
    raw_truth = setting.raw(truth_file({**truth, **FIXED}, work / f"truth-{seed}.json",
                                       setting.prior), seed)
    runs = measured_runs(raw_truth, mixes, shown, setting.split)
    sc = parse_scenario(setting.raw(seed=seed))
    start = time.perf_counter()
    result = fit(sc, runs, workers, FIXED, spread=spread)
    fit_s = time.perf_counter() - start
    mid_raw = apply_overrides(setting.raw(seed=seed), ["workload.generation_share=0.5"])
    mid = parse_scenario(mid_raw | {"configurations": [CO_SERVED]})
    ranges = [r for r in predict(mid, result.calibration, [CO_SERVED], workers) if r.metric in CHECKED]
    real = measure(raw_truth, CO_SERVED, 0.5)
    expected = expected_truth(raw_truth, truth_seeds)
    inside = {r.metric: _within(r.low, r.high, _get(real, r.metric)) for r in ranges}
    mean_inside = {r.metric: _within(r.mean_low, r.mean_high, expected.get(r.metric))
                   for r in ranges}
    widest = max(ranges, key=lambda r: (r.parameter_width, r.width))
    row = {"seed": seed, "truth": truth, "fit_s": fit_s, "evaluations": result.evaluations,
           "status": {n: result.parameters[n]["status"] for n in HIDDEN},
           "fitted": {n: result.parameters[n]["value"] for n in HIDDEN},
           "standard_error": {n: result.parameters[n].get("standard_error") for n in HIDDEN},
           "recovered": recovered(result, truth), "freed": sorted(freed(result)),
           "misfit": bool(result.misses),
           "ranges": [r.as_dict() | {"truth": _get(real, r.metric),
                                     "expected_truth": expected.get(r.metric)} for r in ranges],
           "inside": inside, "mean_inside": mean_inside, "widest": widest.metric,
           "width": widest.width, "mean_width": widest.mean_width,
           "parameter_width": widest.parameter_width, "sampling_sd": widest.noise,
           # mostly the prediction's own sampling spread: no measurement of the split halves it
           "sampling_bound": sampling_bound([widest], None) is not None}
    variance = error_variance(sc, mid, runs, result, widest.metric, workers, spread,
                              setting.prior)
    row["band"] = band(variance, widest.noise)
    row["mean_band"] = band(variance, widest.mean_noise)

    def narrowed_by(extra: list[MeasuredRun], key: str) -> None:
        """Fit again with ``extra`` measured on the truth; the widest range's metric again."""
        again = fit(sc, runs + extra, workers, FIXED, spread=spread)
        after = [r for r in predict(mid, again.calibration, [CO_SERVED], workers)
                 if r.metric == widest.metric][0]
        row[f"{key}narrowed_range"] = after.as_dict()
        row[f"{key}narrowed_width"] = after.width
        row[f"{key}narrowed_mean_width"] = after.mean_width
        row[f"{key}narrowed_parameter_width"] = after.parameter_width
        row[f"{key}narrowed_inside"] = _within(after.low, after.high, _get(real, widest.metric))
        row[f"{key}narrowed_mean_inside"] = _within(after.mean_low, after.mean_high,
                                                    expected.get(widest.metric))

    tips = suggest(widest, result.calibration)
    if tips and widest.width > 0:
        tip = tips[0]
        value = metric_value(measure_at(raw_truth, tip.configuration, tip.at), tip.metric,
                             tip.kind)
        row["suggested"] = tip.as_dict() | {"estimated_removal": tip.removes}
        if value:  # a metric over no requests is not a measurement
            narrowed_by([MeasuredRun(tip.configuration, {tip.metric: value}, "suggested",
                                     tip.kind, tuple(tip.at))], "")
    whole = suggest_run(widest, result.calibration)
    if whole and widest.width > 0:
        tip = whole[0]
        doc = measure_at(raw_truth, tip.configuration, tip.at)
        by_kind: dict[str | None, dict[str, float]] = {}
        for m in tip.metrics:
            value = metric_value(doc, m.metric, m.kind)
            if value:
                by_kind.setdefault(m.kind, {})[m.metric] = value
        row["suggested_run"] = tip.as_dict()
        if by_kind:
            narrowed_by([MeasuredRun(tip.configuration, metrics, "suggested run", kind,
                                     tuple(tip.at)) for kind, metrics in by_kind.items()], "run_")
    return row


def _within(low: float | None, high: float | None, value: float | None) -> bool:
    """``value`` inside ``low``..``high`` (0.1 % slack for the metrics' rounding)."""
    return None not in (low, high, value) and low * 0.999 <= value <= high * 1.001


def _cuts(rows: list[dict], prefix: str, width: str = "width") -> list[float]:
    """How much of each seed's widest range (``width``: whole, or ``parameter_width``) the
    measurement keyed ``prefix`` removed."""
    return [1 - r[f"{prefix}narrowed_{width}"] / r[width] for r in rows
            if f"{prefix}narrowed_{width}" in r and r[width] > 0]


def report(rows: list[dict], console: Console, mixes: tuple[float, ...] = MIXES,
           measured: str = "all", setting: Setting = SETTINGS["cpu"]) -> None:
    out = table(f"fit ranges against simulated ground truths ({setting.describe}; "
                f"{setting.split} at "
                f"{'/'.join(map(str, mixes))}, one mixed pool, {measured} measured; "
                f"predicting Orthrus at 0.5)",
                ["seed", "truth e/d/oh/ov", "determined", "recovered", "inside (run/exp.)",
                 "widest", "width (run/exp.)", "2-sigma band", "suggested", "after", "run",
                 "after run", "fit s"], justify="left", overflow="fold")

    def pair(r: dict, key: str) -> str:
        """One run's range width and the expected value's, as run/exp."""
        run, exp = r.get(key), r.get(key.replace("width", "mean_width"))
        return "-" if run is None else f"{run:.1%}/{exp:.1%}" if exp is not None else f"{run:.1%}"

    for r in rows:
        t = r["truth"]
        out.add_row(
            str(r["seed"]), f"{t['embedding_scale']:.2f}/{t['decode_scale']:.2f}/"
            f"{t['embedding_overhead_s'] * 1e3:.0f}ms/{t['overlap']:.2f}",
            " ".join(n.split("_")[0][:3] + ("_oh" if n.endswith("_s") else "")
                     for n in r["recovered"]),
            "ok" if all(r["recovered"].values()) else "MISS " + ",".join(
                n for n, ok in r["recovered"].items() if not ok),
            ("ok" if all(r["inside"].values()) else "OUT") + "/"
            + ("ok" if all(r["mean_inside"].values()) else "OUT"),
            r["widest"].split(".")[-1], pair(r, "width"),
            "-" if r["band"] is None else f"{r['band']:.1%}/{r['mean_band']:.1%}",
            (r["suggested"]["configuration"] + " " + r["suggested"]["metric"]
             + (f" ({r['suggested']['kind']})" if r["suggested"]["kind"] else "")
             + (f" @{r['suggested']['at'][0].split('=')[1]}" if r["suggested"]["at"] else ""))
            if "suggested" in r else "-",
            pair(r, "narrowed_width"),
            (r["suggested_run"]["configuration"] + " @"
             + ";".join(a.split("=")[1] for a in r["suggested_run"]["at"]))
            if "suggested_run" in r else "-",
            pair(r, "run_narrowed_width"),
            f"{r['fit_s']:.0f}")
    console.print(out)
    n = len(rows)
    covered = sum(all(r["inside"].values()) for r in rows)
    rec = sum(all(r["recovered"].values()) for r in rows)
    pinned = [r for r in rows if r["band"] is not None]
    console.print(f"every parameter determined to 10 % recovered within 10 %: {rec}/{n} seeds "
                  f"({sum(len(r['recovered']) for r in rows)} parameters determined)")
    console.print(f"truth's co-served throughput (both kinds) inside the range: {covered}/{n}")
    console.print(f"truth's expected co-served throughput (both kinds, mean of its runs under "
                  f"other seeds) inside the expected value's range: "
                  f"{sum(all(r['mean_inside'].values()) for r in rows)}/{n}")
    if pinned:
        for what, width, of in (("range", "width", "band"),
                                ("expected value's range", "mean_width", "mean_band")):
            ratios = [r[width] / r[of] for r in pinned if r[of]]
            console.print(f"all four pinned in {len(pinned)}/{n}: {what} / 2-sigma band "
                          f"median {np.median(ratios):.2f}, max {max(ratios):.2f}")
    cut, cut_p = _cuts(rows, ""), _cuts(rows, "", "parameter_width")
    console.print(f"the suggested measurement narrowed the widest range by >= 50 %: "
                  f"{sum(c >= 0.5 for c in cut)}/{n}"
                  + (f" (median {np.median(cut):.0%}; the truth still inside in "
                     f"{sum(bool(r.get('narrowed_inside')) for r in rows)}/{len(cut)})" if cut else ""))
    run_cut, run_cut_p = _cuts(rows, "run_"), _cuts(rows, "run_", "parameter_width")
    if run_cut:
        console.print(
            f"the suggested run (one more bench of a measured configuration, every metric kept) "
            f"narrowed it by >= 50 %: {sum(c >= 0.5 for c in run_cut)}/{n} (median "
            f"{np.median(run_cut):.0%}; its parameters' part by >= 50 %: "
            f"{sum(c >= 0.5 for c in run_cut_p)}/{len(run_cut_p)}; the truth still inside in "
            f"{sum(bool(r.get('run_narrowed_inside')) for r in rows)}/{len(run_cut)})")
    for prefix, what in (("", "measurement"), ("run_", "run")):
        cut_m = _cuts(rows, prefix, "mean_width")
        if cut_m:
            console.print(
                f"the suggested {what} narrowed the expected value's range by >= 50 %: "
                f"{sum(c >= 0.5 for c in cut_m)}/{n} (median {np.median(cut_m):.0%}; the truth's "
                f"expected throughput still inside in "
                f"{sum(bool(r.get(prefix + 'narrowed_mean_inside')) for r in rows)}/{len(cut_m)})")
    bound = sum(bool(r.get("sampling_bound")) for r in rows)
    console.print(f"the widest range mostly the prediction's own sampling spread (its parameters' "
                  f"part under half its width; `predict` names it): {bound}/{n}")
    if cut_p:
        console.print(f"its parameters' part (no sampling spread) by >= 50 %: "
                      f"{sum(c >= 0.5 for c in cut_p)}/{len(cut_p)} (median {np.median(cut_p):.0%})")
    widths, means = [r["width"] for r in rows], [r["mean_width"] for r in rows]
    console.print(f"widest range: median {np.median(widths):.1%}, max {max(widths):.1%}; its "
                  f"expected value's range median {np.median(means):.1%}, max {max(means):.1%}; "
                  f"sampling sd median {np.median([r.get('sampling_sd', 0) for r in rows]):.1%}")
    console.print(f"fit time: median {np.median([r['fit_s'] for r in rows]):.0f} s, "
                  f"simulations median {np.median([r['evaluations'] for r in rows]):.0f}")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first", type=int, default=1)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--spread", type=float, default=0.03, help="the measurements' stated spread")
    ap.add_argument("--mixes", default=",".join(map(str, MIXES)), help="the generation shares "
                    "the split is measured at (one: the coupled case, where ranges are wide)")
    ap.add_argument("--measure", choices=tuple(MEASURED), default="all",
                    help="what each mix shows: each kind's throughput and p50 latency (all), or "
                    "the throughputs alone (a published table: ranges the parameters leave wide)")
    ap.add_argument("--setting", choices=tuple(SETTINGS), default="cpu",
                    help="cpu: the case in miniature (fast); paper: the issue's own case, the "
                    "A100 mix sweep's 512 clients in one pool, Dedicated-1:3 measured")
    ap.add_argument("--truth-seeds", type=int, default=TRUTH_SEEDS, help="runs of the truth "
                    "its expected co-served throughput is averaged over")
    ap.add_argument("--out", type=Path, default=None, help="folder for fit_ranges.json")
    args = ap.parse_args()
    try:
        mixes = tuple(float(m) for m in args.mixes.split(",") if m)
    except ValueError:
        ap.error(f"--mixes: expected generation shares such as 0.1,0.5,0.9, got {args.mixes!r}")
    if not mixes or not all(0 < m < 1 for m in mixes):
        ap.error(f"--mixes: each share must lie in (0, 1), got {args.mixes!r}")
    if args.truth_seeds < 2:
        ap.error(f"--truth-seeds: at least 2 runs to average, got {args.truth_seeds}")
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console, transient=True) as bar:
        task = bar.add_task("seeds", total=args.seeds)
        for seed in range(args.first, args.first + args.seeds):
            rows.append(one_seed(seed, args.workers, Path(tmp), args.spread, mixes,
                                 MEASURED[args.measure], SETTINGS[args.setting],
                                 args.truth_seeds))
            bar.update(task, advance=1)
    report(rows, console, mixes, args.measure, SETTINGS[args.setting])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fit_ranges.json").write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
