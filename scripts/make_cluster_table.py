"""Dedicated-1:1 vs Orthrus on two single-thread replicas of this machine, measured and
simulated: `scenarios/fidelity_cpu.yaml` on `cluster.gpus: 2` at the mixes 9:1, 5:5 and 1:9
(embedding:generation), each configuration served by `orthrus-real serve --replicas 2`
(one engine process per replica, one core each, behind the gateway) and benched with the
scenario's requests by `orthrus-real validate`, which simulates the same run with the given
calibration (make it with `calibrate --colocated 2 --devices cpu:0,cpu:1`, docs/cluster.md).

Every mix runs `--rounds` times, the two configurations alternating their order round by round
(the machine is shared and noisy); a measured figure is the mean over rounds with its range.
A kind's figures are judged only where every round completed at least `--min-completions` of
it (fewer: shown with their count, not judged). `--compare-calibration FILE` simulates the same
runs with a second calibration too (an engine profiled alone, say), so one table shows what
the co-located profile changes. Targets (issue 33): throughput within 10 %, p50 within 20 %.
Prints the tables docs/cluster.md holds and writes `OUT/summary.json`.

`--phased` runs the compressed phased mix instead: three phases of `--phase-requests` each
(generation shares 0.9, 0.5, 0.1, the order of `scenarios/phased.yaml`), Dedicated-1:1 (stock
servers) against Orthrus with a TPOT target (`--tpot-target`) on each replica, placed by the planner
(`cluster.router: adaptive`); the figure is the time to finish all three phases (its inverse
the throughput of a fixed amount of work), measured and simulated, and the TPOT p99 beside it.

`--trace` replays `scenarios/traces_cpu.yaml` instead: the merged production traces (Azure's
conversation trace as generations, its coding trace's arrivals and inputs as embeddings) shrunk
to this cluster, its time stretched by `workload.rate_scale` (`--trace-scale`), Dedicated-1:1 against
Orthrus placed by the planner; the figure is goodput (requests that met the scenario's SLOs per
second), measured and simulated, with each kind's SLO attainment beside it.

`--tables-only` measures nothing: the runs stored in `OUT/measured.json` are simulated again
with `--calibration` (and `--compare-calibration`), so a new calibration is judged against the
same measured runs.

Run: python scripts/make_cluster_table.py --model DIR --calibration FILE [--rounds 2]
     [--duration 45] [--compare-calibration FILE] [--tables-only]
     [--phased [--phase-requests 80] [--tpot-target 0.1]] [--trace [--trace-scale 0.4]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import yaml
from make_fidelity import MIXES  # beside this script

from orthrus_real.cluster.machine_plan import real_scenario
from orthrus_real.measure.validate import lookup, validate
from orthrus_sim.experiment.scenario import load_scenario, read_scenario
from orthrus_sim.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["dedicated-1:1", "orthrus"]
TARGETS = {"throughput": 0.10, "p50": 0.20}
# (metric, target, header, kind whose completions it needs)
METRICS = [("throughput_rps.embedding", "throughput", "emb tput", "embedding"),
           ("throughput_rps.generation", "throughput", "gen tput", "generation"),
           ("throughput_rps.combined", "throughput", "combined", "both"),
           ("latency_s.embedding.p50", "p50", "emb p50", "embedding"),
           ("latency_s.generation.p50", "p50", "gen p50", "generation"),
           ("latency_s.ttft.p50", "p50", "TTFT p50", "generation")]


def measure(args, scenario_path: Path) -> dict:
    """Each mix `rounds` times, configurations alternating: {mix: {cfg: [metrics per round]}},
    and the simulated metrics {mix: {cfg: metrics}} with the judged calibration."""
    raw = read_scenario(scenario_path)
    measured: dict = {m: {c: [] for c in CONFIGS} for m in MIXES}
    simulated: dict = {m: {} for m in MIXES}
    for r in range(args.rounds):
        path = args.out / f"scenario-{r}.yaml"
        order = round_scenario(raw, r, path)
        for mix, share in MIXES.items():
            print(f"round {r + 1}/{args.rounds}, mix {mix}: {', '.join(order)}", flush=True)
            out = args.out / f"round-{r}" / mix.replace(":", "-")
            validate(path, overrides(share, args.duration), str(args.model), None,
                     str(args.calibration), out, threads=1, engine_cpus="0,1")
            runs = json.loads((out / "measured" / "results.json").read_text())["runs"]
            for run in runs:
                measured[mix][run["configuration"]].append(run["metrics"])
            sims = json.loads((out / "simulated" / "results.json").read_text())["runs"]
            simulated[mix] = {run["configuration"]: run["metrics"] for run in sims}
    return {"measured": measured, "simulated": simulated}


def round_scenario(raw: dict, r: int, path: Path) -> list[str]:
    """Round ``r``'s scenario, written to ``path``: the configurations in the order they run that
    round, reversed every other round (the machine is shared and noisy: neither always runs
    first); returns that order."""
    order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
    path.write_text(yaml.safe_dump({**raw, "configurations": order}, sort_keys=False))
    return order


def overrides(share: float, duration: float) -> list[str]:
    return [f"workload.generation_share={share}", f"duration_s={duration}"]


def resimulate(args, scenario_path: Path, calibration: Path) -> dict:
    """The same runs simulated with another calibration: {mix: {cfg: metrics}}."""
    out: dict = {}
    for mix, share in MIXES.items():
        base = load_scenario(scenario_path, overrides(share, args.duration))
        sc = real_scenario(base, str(args.model), None, str(calibration), 32768,
                           gpus=base.cluster.gpus)
        out[mix] = {cfg: simulate(sc, cfg).metrics for cfg in CONFIGS}
    return out


def summarise(data: dict, min_completions: int, other: dict | None) -> list[dict]:
    rows = []
    for mix in MIXES:
        for cfg in CONFIGS:
            runs = data["measured"][mix][cfg]
            done = {k: min(lookup(m, f"completed.{k}") or 0 for m in runs)
                    for k in ("embedding", "generation")}
            for metric, target, header, kind in METRICS:
                got = [v for v in (lookup(m, metric) for m in runs) if v is not None]
                need = min(done.values()) if kind == "both" else done[kind]
                sim = lookup(data["simulated"][mix].get(cfg, {}), metric)
                mean = statistics.fmean(got) if got else None
                row = {"mix": mix, "configuration": cfg, "metric": metric, "header": header,
                       "target": TARGETS[target], "measured": got, "measured_mean": mean,
                       "completions": need, "judged": need >= min_completions and bool(got),
                       "simulated": sim, "error": _error(sim, mean)}
                if other is not None:
                    row["error_other"] = _error(lookup(other[mix][cfg], metric), mean)
                rows.append(row)
    return rows


def _error(sim, mean):
    return None if sim is None or not mean else sim / mean - 1


def tables(rows: list[dict], args) -> list[str]:
    heads = [m[2] for m in METRICS]
    lines = ["| mix | configuration | " + " | ".join(heads) + " |", "|" + "---|" * (2 + len(heads))]
    for mix in MIXES:
        for cfg in CONFIGS:
            cells = []
            for r in (r for r in rows if r["mix"] == mix and r["configuration"] == cfg):
                cells.append(_cell(r, "error", args.min_completions))
            lines.append(f"| {mix} | {cfg} | " + " | ".join(cells) + " |")
    judged = [r for r in rows if r["judged"] and r["error"] is not None]
    met = sum(abs(r["error"]) <= r["target"] for r in judged)
    lines += ["", f"{met} of {len(judged)} judged cells within target"]
    if args.compare_calibration:
        other = [r for r in judged if r.get("error_other") is not None]
        met_o = sum(abs(r["error_other"]) <= r["target"] for r in other)
        lines += [f"with {args.compare_calibration.name}: {met_o} of {len(other)}; median |error| "
                  f"{_median_abs(other, 'error_other')} against {_median_abs(judged, 'error')}",
                  "", "The same cells simulated with " + args.compare_calibration.name + ":", "",
                  lines[0], lines[1]]
        for mix in MIXES:
            for cfg in CONFIGS:
                cells = [_cell(r, "error_other", args.min_completions) for r in rows
                         if r["mix"] == mix and r["configuration"] == cfg]
                lines.append(f"| {mix} | {cfg} | " + " | ".join(cells) + " |")
    lines += ["", "| mix | configuration | " + " | ".join(
        f"{h} measured (range) sim" for h in heads[:3]) + " | completions (emb, gen) |",
        "|---|---|---|---|---|---|"]
    for mix in MIXES:
        for cfg in CONFIGS:
            mine = [r for r in rows if r["mix"] == mix and r["configuration"] == cfg]
            cells = [f"{_fmt(r['measured_mean'])} ({_range(r['measured'])}) {_fmt(r['simulated'])}"
                     for r in mine[:3]]
            counts = f"{mine[0]['completions']}, {mine[1]['completions']}"
            lines.append(f"| {mix} | {cfg} | " + " | ".join(cells) + f" | {counts} |")
    lines += ["", "Orthrus / Dedicated-1:1, combined throughput: measured (simulated)"]
    for mix in MIXES:
        pick = {r["configuration"]: r for r in rows
                if r["mix"] == mix and r["metric"] == "throughput_rps.combined"}
        a, b = pick["orthrus"], pick["dedicated-1:1"]
        lines.append(f"* {mix}: {_ratio(a['measured_mean'], b['measured_mean'])} "
                     f"({_ratio(a['simulated'], b['simulated'])})")
    return lines


def _cell(row: dict, key: str, floor: int) -> str:
    err = row.get(key)
    if err is None:
        return "-"
    text = f"{err:+.1%}"
    if not row["judged"]:
        return f"({text}, n={row['completions']})"
    return f"**{text}**" if abs(err) > row["target"] else text


def _median_abs(rows: list[dict], key: str) -> str:
    return f"{statistics.median(abs(r[key]) for r in rows):.1%}" if rows else "-"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _range(values: list) -> str:
    return "-" if not values else f"{min(values):.3g}-{max(values):.3g}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def alternating_rounds(args, raw: dict, label: str, figures) -> tuple[dict, list[str]]:
    """``raw`` validated ``rounds`` times, the configurations alternating: per configuration
    ``figures(metrics)`` of each measured round and of the simulated run, written to
    OUT/<label>.json; and the simulated run's workload notes."""
    got: dict = {c: {"measured": [], "simulated": None} for c in CONFIGS}
    notes: list[str] = []
    for r in range(args.rounds):
        path = args.out / f"{label}-{r}.yaml"
        order = round_scenario(raw, r, path)
        print(f"{label}, round {r + 1}/{args.rounds}: {', '.join(order)}", flush=True)
        out = args.out / f"{label}-round-{r}"
        validate(path, [], str(args.model), None, str(args.calibration), out, threads=1,
                 engine_cpus="0,1")
        for side in ("measured", "simulated"):
            for run in json.loads((out / side / "results.json").read_text())["runs"]:
                entry = figures(run["metrics"])
                if side == "measured":
                    got[run["configuration"]]["measured"].append(entry)
                else:
                    got[run["configuration"]]["simulated"] = entry
                    notes = run["metrics"].get("workload_notes") or notes
    (args.out / f"{label}.json").write_text(json.dumps(got, indent=1) + "\n")
    return got, notes


def phased(args) -> list[str]:
    """The compressed phased mix, `rounds` times, configurations alternating."""
    raw = read_scenario(ROOT / "scenarios" / "fidelity_cpu.yaml")
    raw["scheduler"]["tpot_target_s"] = args.tpot_target
    raw.update(cluster={"gpus": 2, "router": "adaptive"}, duration_s=None)
    raw["workload"]["phases"] = [{"requests": args.phase_requests, "generation_share": g}
                                 for g in (0.9, 0.5, 0.1)]
    raw["workload"].pop("generation_share", None)
    got, _ = alternating_rounds(args, raw, "phased", _phased_figures)
    lines = ["| configuration | makespan s, measured (range) | simulated | error | TPOT p99 s, "
             "measured | simulated | completions (emb, gen) |", "|---|---|---|---|---|---|---|"]
    for cfg in CONFIGS:
        runs, sim = got[cfg]["measured"], got[cfg]["simulated"]
        spans = [m["makespan_s"] for m in runs if m["makespan_s"] is not None]
        mean = statistics.fmean(spans) if spans else None
        tpot = [m["tpot_p99_s"] for m in runs if m["tpot_p99_s"] is not None]
        lines.append(f"| {cfg} | {_fmt(mean)} ({_range(spans)}) | {_fmt(sim['makespan_s'])} | "
                     f"{_pct(_error(sim['makespan_s'], mean))} | {_range(tpot)} | "
                     f"{_fmt(sim['tpot_p99_s'])} | {min(m['embedding'] for m in runs)}, "
                     f"{min(m['generation'] for m in runs)} |")
    ded, orth = (got[c] for c in CONFIGS)
    pairs = [d["makespan_s"] / o["makespan_s"] for d, o in zip(ded["measured"], orth["measured"])
             if d["makespan_s"] and o["makespan_s"]]
    sim_ratio = (ded["simulated"]["makespan_s"] / orth["simulated"]["makespan_s"]
                 if ded["simulated"]["makespan_s"] and orth["simulated"]["makespan_s"] else None)
    lines += ["", "Orthrus (planner) / Dedicated-1:1, throughput of the three phases (makespan "
              f"ratio): measured per round {', '.join(f'{x:.2f}x' for x in pairs) or '-'}, "
              f"simulated {_fmt(sim_ratio)}x"]
    return lines


def _phased_figures(m: dict) -> dict:
    phases = m.get("phases") or []
    starts = [p["start_s"] for p in phases if p["start_s"] is not None]
    ends = [p["last_finish_s"] for p in phases]
    span = max(ends) - min(starts) if starts and ends and None not in ends else None
    return {"makespan_s": span, "tpot_p99_s": lookup(m, "latency_s.tpot.p99"),
            "embedding": lookup(m, "completed.embedding") or 0,
            "generation": lookup(m, "completed.generation") or 0}


def trace(args) -> list[str]:
    """The shrunk merged traces, `rounds` times, configurations alternating."""
    raw = read_scenario(ROOT / "scenarios" / "traces_cpu.yaml")
    if args.trace_scale is not None:
        raw["workload"]["rate_scale"] = args.trace_scale
    for pool in raw["workload"]["pools"]:  # the rounds' scenarios are written under --out
        pool["trace"] = str(ROOT / "scenarios" / pool["trace"])
    got, notes = alternating_rounds(args, raw, "trace", _trace_figures)
    lines = [f"* {n}" for n in notes] + [
        "", "| configuration | goodput rps, measured per round | simulated | error | "
        "attainment emb, gen: measured | simulated | TPOT p99 s, measured | simulated | "
        "completions (emb, gen) |", "|---|---|---|---|---|---|---|---|---|"]
    for cfg in CONFIGS:
        runs, sim = got[cfg]["measured"], got[cfg]["simulated"]
        good = [m["goodput_rps"] for m in runs]
        mean = statistics.fmean(good) if good else None
        att = "; ".join(f"{_pct1(m['attainment_embedding'])}, {_pct1(m['attainment_generation'])}"
                        for m in runs)
        lines.append(
            f"| {cfg} | {', '.join(_fmt(g) for g in good)} | {_fmt(sim['goodput_rps'])} | "
            f"{_pct(_error(sim['goodput_rps'], mean))} | {att} | "
            f"{_pct1(sim['attainment_embedding'])}, {_pct1(sim['attainment_generation'])} | "
            f"{_range([m['tpot_p99_s'] for m in runs if m['tpot_p99_s'] is not None])} | "
            f"{_fmt(sim['tpot_p99_s'])} | {min(m['embedding'] for m in runs)}, "
            f"{min(m['generation'] for m in runs)} |")
    ded, orth = (got[c] for c in CONFIGS)
    pairs = [o["goodput_rps"] / d["goodput_rps"] for d, o in zip(ded["measured"], orth["measured"])
             if d["goodput_rps"] and o["goodput_rps"] is not None]
    sims = ded["simulated"]["goodput_rps"], orth["simulated"]["goodput_rps"]
    lines += ["", "Orthrus (planner) / Dedicated-1:1, goodput: measured per round "
              f"{', '.join(f'{x:.2f}x' for x in pairs) or '-'}, simulated "
              f"{_ratio(sims[1], sims[0])}"]
    return lines


def _trace_figures(m: dict) -> dict:
    return {"goodput_rps": lookup(m, "slo.combined.goodput_rps"),
            "attainment_embedding": lookup(m, "slo.embedding.attainment"),
            "attainment_generation": lookup(m, "slo.generation.attainment"),
            "tpot_p99_s": lookup(m, "latency_s.tpot.p99"),
            "embedding": lookup(m, "completed.embedding") or 0,
            "generation": lookup(m, "completed.generation") or 0}


def _pct1(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _pct(err) -> str:
    return "-" if err is None else f"{err:+.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--compare-calibration", type=Path, default=None)
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-completions", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "cluster")
    parser.add_argument("--tables-only", action="store_true",
                        help="no runs: the tables of OUT/measured.json's measured runs, "
                        "simulated with --calibration")
    parser.add_argument("--phased", action="store_true", help="the compressed phased mix")
    parser.add_argument("--phase-requests", type=int, default=80)
    parser.add_argument("--tpot-target", type=float, default=0.1,
                        help="seconds (predicted) a decode iteration may take, --phased")
    parser.add_argument("--trace", action="store_true",
                        help="the merged production traces shrunk to this cluster")
    parser.add_argument("--trace-scale", type=float, default=None,
                        help="--trace: workload.rate_scale (default: the scenario's, 0.4)")
    args = parser.parse_args()
    if args.trace:
        args.out.mkdir(parents=True, exist_ok=True)
        print("\n".join(trace(args)))
        return
    if args.phased:
        args.out.mkdir(parents=True, exist_ok=True)
        print("\n".join(phased(args)))
        return
    raw = read_scenario(ROOT / "scenarios" / "fidelity_cpu.yaml")
    raw.update(configurations=CONFIGS, cluster={"gpus": 2})
    args.out.mkdir(parents=True, exist_ok=True)
    scenario = args.out / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(raw, sort_keys=False))
    started = time.time()
    stored = args.out / "measured.json"
    if args.tables_only:  # the stored runs, simulated again with --calibration
        data = json.loads(stored.read_text())
        data["simulated"] = resimulate(args, scenario, args.calibration)
    else:
        data = measure(args, scenario)
        stored.write_text(json.dumps(data) + "\n")
    other = resimulate(args, scenario, args.compare_calibration) if args.compare_calibration else None
    rows = summarise(data, args.min_completions, other)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = tables(rows, args)
    lines.append(f"\n({time.time() - started:.0f} s)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
