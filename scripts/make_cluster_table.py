"""Dedicated-1:1 vs Orthrus on two single-thread replicas of this machine, measured and
simulated: `scenarios/fidelity_cpu.yaml` on `cluster.gpus: 2` at the mixes 9:1, 5:5 and 1:9
(embedding:generation), each configuration served by `orthrus-real serve --replicas 2`
(one engine process per replica, one core each, behind the gateway) and benched with the
scenario's requests by `orthrus-real validate`, which simulates the same run with the given
calibration. Prints the tables docs/cluster.md holds (fidelity-table format: each cell
(simulated - measured) / measured, then the measured and simulated figures side by side).

Run: python scripts/make_cluster_table.py --model DIR --calibration FILE [--duration 30]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml
from make_fidelity import MIXES, TARGETS, cell  # beside this script

from orthrus_real.measure.validate import validate
from orthrus_sim.experiment.scenario import read_scenario

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["dedicated-1:1", "orthrus"]
METRICS = [("throughput_rps.embedding", "throughput", "emb tput"),
           ("throughput_rps.generation", "throughput", "gen tput"),
           ("throughput_rps.combined", "throughput", "combined"),
           ("latency_s.embedding.p50", "p50", "emb p50"), ("latency_s.embedding.p99", "p99", "emb p99"),
           ("latency_s.generation.p50", "p50", "gen p50"), ("latency_s.generation.p99", "p99", "gen p99"),
           ("latency_s.ttft.p50", "p50", "TTFT p50"), ("latency_s.ttft.p99", "p99", "TTFT p99")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "cluster")
    args = parser.parse_args()
    raw = read_scenario(ROOT / "scenarios" / "fidelity_cpu.yaml")
    raw.update(configurations=CONFIGS, cluster={"gpus": 2})
    args.out.mkdir(parents=True, exist_ok=True)
    scenario = args.out / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(raw, sort_keys=False))
    started = time.time()
    results = {}
    for mix, share in MIXES.items():
        print(f"mix {mix}", flush=True)
        results[mix] = validate(scenario, [f"workload.generation_share={share}",
                                           f"duration_s={args.duration}"],
                                str(args.model), None, str(args.calibration),
                                args.out / mix.replace(":", "-"), threads=1, engine_cpus="0,1")
    head = ["mix", "configuration", *(m[2] for m in METRICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mix, res in results.items():
        for cfg in CONFIGS:
            cells = []
            for metric, target, _ in METRICS:
                text, err = cell(res["rows"], cfg, metric)
                cells.append(f"**{text}**" if err is not None and err > TARGETS[target] else text)
            lines.append(f"| {mix} | {cfg} | " + " | ".join(cells) + " |")
    lines += ["", "| mix | configuration | emb tput (rps) | gen tput (rps) | emb p99 (s) | "
              "gen p99 (s) | TTFT p99 (s) |", "|---|---|---|---|---|---|---|"]
    shown = ["throughput_rps.embedding", "throughput_rps.generation", "latency_s.embedding.p99",
             "latency_s.generation.p99", "latency_s.ttft.p99"]
    for mix, res in results.items():
        for cfg in CONFIGS:
            row = {r["metric"]: r for r in res["rows"] if r["configuration"] == cfg}
            lines.append(f"| {mix} | {cfg} | " + " | ".join(
                f"{_fmt(row[m]['measured'])} ({_fmt(row[m]['simulated'])})" for m in shown) + " |")
    lines += ["", "Orthrus / Dedicated-1:1, combined throughput: measured (simulated)"]
    for mix, res in results.items():
        got = {(r["configuration"], kind): r[kind] for r in res["rows"]
               if r["metric"] == "throughput_rps.combined" for kind in ("measured", "simulated")}
        lines.append(f"* {mix}: {_ratio(got, 'measured')} ({_ratio(got, 'simulated')})")
    lines.append(f"\n({time.time() - started:.0f} s)")
    print("\n".join(lines))


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _ratio(got: dict, kind: str) -> str:
    a, b = got.get(("orthrus", kind)), got.get(("dedicated-1:1", kind))
    return "-" if not a or not b else f"{a / b:.2f}x"


if __name__ == "__main__":
    main()
