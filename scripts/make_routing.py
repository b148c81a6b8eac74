"""The routing rules compared in the simulator: p99 latency per kind and throughput for
round-robin, least-work and least-predicted-time (and adaptive placement, which needs an
iteration-time target) at 4 GPUs, on the Iter-RetGen scenario (scenarios/iter_retgen.yaml) and
the mix sweep (scenarios/mix_sweep.yaml: clients split by kind, and one mixed pool), and an
open load with skewed lengths (scenarios/routing_skew.yaml, three Poisson rates).

Configurations: Orthrus and Unified-Hetero (every replica serves both kinds: the rule places
mixed work), Dedicated-1:3 (routing by kind; the rule acts within the generation side) and, on
Iter-RetGen, Disagg-PD-1:3 (the rule also picks the decode replica of each hand-off). With a
target: Orthrus with ``scheduler.tpot_target_s`` at 1.5x Dedicated-1:3's TPOT p50 at the same
point (the frontier's "decode-only step"; ``waiting_work`` is then prompt+output by default),
each rule and adaptive placement.

Every run goes through the sweep backend (``orthrus_sim.questions.sweep.run_sweep``: one point per rule,
local worker processes; its files under out/routing/). Writes docs/routing/routing.json (every
row) and the tables between the ``<!-- make_routing:NAME -->`` markers of docs/routing.md (the
prose around them is kept). Deterministic: the simulator is.

    python scripts/make_routing.py [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import yaml
from doc_sections import write_section  # beside this script
from rich.console import Console

from orthrus_sim.questions.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios"
DOC = ROOT / "docs" / "routing.md"
DATA = ROOT / "docs" / "routing" / "routing.json"
WORK = ROOT / "out" / "routing"
RULES = ["round-robin", "least-work", "least-predicted-time"]
TARGET_X = 1.5
SHARES = "workload.generation_share=0.1,0.5,0.9"
# name: scenario, overrides, grid (besides the rule), configurations
EXPERIMENTS = {
    "iter_retgen": ("iter_retgen", ["cluster.gpus=4"], [],
                    ["orthrus", "unified-hetero", "dedicated-1:3", "disagg-pd-1:3"]),
    "mix_per_kind": ("mix_sweep", ["cluster.gpus=4"], [SHARES],
                     ["orthrus", "unified-hetero", "dedicated-1:3"]),
    "mix_mixed_pool": ("mix_sweep", ["cluster.gpus=4", "workload.arrival.pools=mixed"], [SHARES],
                       ["orthrus", "unified-hetero", "dedicated-1:3"]),
    "skew": ("routing_skew", [], ["workload.arrival.rate=45,55,65"],
             ["orthrus", "unified-hetero", "dedicated-1:3"]),
}
POINT = {"mix_per_kind": "share", "mix_mixed_pool": "share", "skew": "req/s"}
console = Console()


def sweep(scenario: str, overrides: list[str], grid: list[str], out: Path, workers: int,
          quick: bool) -> dict:
    raw = yaml.safe_load((SCENARIOS / f"{scenario}.yaml").read_text())
    if quick:  # a smoke test: a sixth of the simulated time
        overrides = [f"duration_s={raw['duration_s'] / 6}", f"warmup_s={raw['warmup_s'] / 6}",
                     *overrides]
    shutil.rmtree(out, ignore_errors=True)  # a fresh sweep, not a resumed one
    return run_sweep(raw, overrides, grid, out, max_parallel=workers, console=console,
                     base_dir=SCENARIOS, source=scenario)


def rows_of(doc: dict, name: str, target_ms: float | None = None) -> list[dict]:
    rows = []
    for p in doc["points"]:
        over = p["overrides"]
        for run in p["runs"]:
            m = run["metrics"]
            lat, tp = m["latency_s"], m["throughput_rps"]
            rows.append({
                "experiment": name, "point": next((v for k, v in over.items()
                                                   if k != "cluster.router"), None),
                "configuration": run["configuration"], "rule": over["cluster.router"],
                "target_ms": target_ms, "embedding_rps": tp["embedding"],
                "generation_rps": tp["generation"], "workflow_rps": tp.get("workflow"),
                "embedding_p99_s": lat["embedding"]["p99"], "ttft_p99_s": lat["ttft"]["p99"],
                "tpot_p50_s": lat["tpot"]["p50"], "tpot_p99_s": lat["tpot"]["p99"],
                "workflow_p99_s": lat.get("workflow", {}).get("p99")})
    return rows


def compute(workers: int, quick: bool) -> list[dict]:
    rows = []
    for name, (scenario, overrides, grid, configurations) in EXPERIMENTS.items():
        over = [*overrides, f"configurations=[{', '.join(configurations)}]"]
        doc = sweep(scenario, over, [*grid, f"cluster.router={','.join(RULES)}"], WORK / name,
                    workers, quick)
        found = rows_of(doc, name)
        rows += found
        key = grid[0].split("=")[0] if grid else None
        for point in dict.fromkeys(r["point"] for r in found):  # one target per point
            ref = next(r for r in found if r["point"] == point and r["rule"] == "round-robin"
                       and r["configuration"] == "dedicated-1:3")
            target = TARGET_X * ref["tpot_p50_s"]
            at = [f"{key}={point}"] if key else []
            doc = sweep(scenario, [*overrides, *at, "configurations=[orthrus]",
                                   f"scheduler.tpot_target_s={target:.6f}"],
                        [f"cluster.router={','.join([*RULES, 'adaptive'])}"],
                        WORK / f"{name}_target_{point}", workers, quick)
            for r in rows_of(doc, name, round(target * 1e3, 2)):
                r["point"] = point
                rows.append(r)
    if not quick:
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps(rows, indent=1) + "\n")
        console.print(f"wrote {DATA}", highlight=False)
    return rows


def _num(v, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def table(rows: list[dict], name: str) -> list[str]:
    """One experiment's rows; in each group (point, configuration, target) the lowest p99 of
    each kind, as printed, is bold."""
    flow = name == "iter_retgen"
    head = [POINT.get(name, "point")] * (not flow) + ["configuration", "rule", "emb/s", "gen/s"] + \
        ["workflows/s"] * flow + ["emb E2E p99 (s)", "TTFT p99 (s)", "TPOT p99 (ms)"] + \
        ["workflow p99 (s)"] * flow
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mine = [r for r in rows if r["experiment"] == name]
    groups: dict[tuple, list[dict]] = {}
    for r in mine:
        groups.setdefault((r["point"], r["configuration"], r["target_ms"]), []).append(r)
    cols = [("embedding_p99_s", 1.0, 2), ("ttft_p99_s", 1.0, 2), ("tpot_p99_s", 1e3, 1)] + \
        [("workflow_p99_s", 1.0, 0)] * flow
    for (point, cfg, target), group in groups.items():
        best = {k: _num(min((r[k] for r in group if r[k] is not None), default=None), scale, d)
                for k, scale, d in cols}
        for r in group:
            label = cfg if target is None else f"{cfg} + target {target:g} ms"
            cells = [str(point)] * (not flow) + [label, r["rule"], _num(r["embedding_rps"], 1, 1),
                                                 _num(r["generation_rps"])]
            cells += [_num(r["workflow_rps"], 1, 3)] * flow
            for k, scale, digits in cols:
                text = _num(r[k], scale, digits)
                bold = len(group) > 1 and r[k] is not None and text == best[k]
                cells.append(f"**{text}**" if bold else text)
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_doc(rows: list[dict]) -> None:
    for name in EXPERIMENTS:
        write_section(DOC, f"<!-- make_routing:{name} -->", "<!-- /make_routing -->",
                      "\n".join(table(rows, name)))
    console.print(f"wrote {DOC}", highlight=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="durations shortened 6x, tables printed, nothing written (a smoke test)")
    ap.add_argument("--tables-only", action="store_true",
                    help="rewrite the tables from docs/routing/routing.json without simulating")
    args = ap.parse_args()
    rows = (json.loads(DATA.read_text()) if args.tables_only
            else compute(args.workers, args.quick))
    if args.quick:
        for name in EXPERIMENTS:
            print("\n".join([f"{name}:", *table(rows, name), ""]))
        return
    write_doc(rows)


if __name__ == "__main__":
    main()
