"""The co-serving map: on which GPU, model and mix does co-serving pay in steady state, and why.

Each cell is the mix sweep's load (`scenarios/mix_sweep.yaml`: 4 GPUs, 512 closed-loop clients
split by kind, 128-token embeddings, 128 -> 512-token generations, 180 s from a 20 s ramp, the
scenario's seed) on one GPU (its shipped calibration; A100-40GB and H200 are derived, not
fitted), one model (Mistral-7B + the e5 LoRA rank 16, Llama-3.1-8B + a rank-64 LoRA, Qwen2-7B +
a rank-32 LoRA: the brief's), one generation share (0.1, 0.5, 0.9) and one TPOT target (1.25x
and 2x Dedicated-1:3's TPOT p50 there, simulated). Per cell:

* the best static split (`orthrus-sim headroom`: Dedicated or Disagg-PD, capped or not, priced
  by the placement planner) and the bound on any placement over it, split into what the
  decodes' spread alone, riders, and offloaded prompts add (``routing.bound``'s parts);
* simulated: that split (``scheduler.max_num_seqs`` at its cap where capped) and the planner
  (Orthrus, ``cluster.router: adaptive``), each kind's throughput in the planner's units
  (normalised: over one replica dedicated to the kind), TPOT p99 and TTFT p99.

Writes docs/headroom/map.json and map.png and the generated part of docs/headroom.md (between
its ``<!-- map -->`` markers); prints the table. Deterministic: the simulator is.

    python scripts/make_headroom_map.py [--workers 2] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from make_frontier import SCENARIO, run_point  # beside this script

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "headroom"
PAGE = ROOT / "docs" / "headroom.md"
GPUS = ["a100-40gb", "a100-80gb", "h100-sxm", "a40", "h200"]
MODELS = {"mistral-7b-v0.1": 16, "llama-3.1-8b": 64, "qwen2-7b": 32}
SHARES = [0.1, 0.5, 0.9]
TARGETS = [1.25, 2.0]
QUICK = ["duration_s=60", "warmup_s=20"]


def cell_sets(gpu: str, model: str, share: float) -> list[str]:
    return [f"hardware={gpu}", f"calibration={gpu}", f"model={model}",
            f"embedding.lora_rank={MODELS[model]}", f"workload.generation_share={share}"]


def split_run(label: str, cap: int | None) -> tuple[str, list[str]] | None:
    """The configuration (and overrides) that runs a split the planner labels ``label``
    (``emb:dec``, ``capped``, ``offload``); None where one side has no replica."""
    m = re.match(r"(\d+):(\d+)", label)
    e, d = int(m.group(1)), int(m.group(2))
    if not e or not d:
        return None
    family = "disagg-pd" if "offload" in label else "dedicated"
    return f"{family}-{e}:{d}", ([f"scheduler.max_num_seqs={cap}"] if cap is not None else [])


def analyse(args: tuple[str, str, float, float, list[str]]) -> dict:
    """One cell's prediction: its planner's units, the bound's parts, the best split."""
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.questions.headroom import scenario_demand, scenario_planner
    from orthrus_sim.routing.bound import bound

    gpu, model, share, target_s, base = args
    sc = load_scenario(SCENARIO, [*base, *cell_sets(gpu, model, share),
                                  f"scheduler.tpot_target_s={target_s}"])
    planner = scenario_planner(sc)
    d = scenario_demand(sc, planner)
    full = bound(planner, d)
    parts = {"decodes": bound(planner, d, riders=False, offload=False).objective,
             "riders": bound(planner, d, offload=False).objective, "offload": full.objective}
    gen_ref, emb_ref = planner.references(d)
    return {"gen_ref": gen_ref, "emb_ref": emb_ref, "best_split": full.best_split,
            "best_split_label": full.best_split_label, "best_split_cap": full.best_split_cap,
            "bound": full.objective, "parts": parts, "derived": gpu in ("a100-40gb", "h200")}


def normalised(run: dict, cell: dict) -> float:
    return run["generation_rps"] / cell["gen_ref"] + run["embedding_rps"] / cell["emb_ref"]


def compute(workers: int = 2, quick: bool = False) -> list[dict]:
    """Every cell, simulated (module docstring)."""
    base = QUICK if quick else []
    keys = [(g, m, s) for g in GPUS for m in MODELS for s in SHARES]
    with ProcessPoolExecutor(workers) as pool:
        steps = list(pool.map(run_point, [(s, "dedicated-1:3", [*cell_sets(g, m, s)], base)
                                          for g, m, s in keys]))
        cells = [{"gpu": g, "model": m, "share": s, "target_x": x,
                  "step_s": step["tpot_p50_s"], "target_s": x * step["tpot_p50_s"]}
                 for (g, m, s), step in zip(keys, steps) for x in TARGETS]
        found = pool.map(analyse, [(c["gpu"], c["model"], c["share"], c["target_s"], base)
                                   for c in cells])
        for c, f in zip(cells, found):
            c.update(f)
        jobs, where = [], []
        for i, c in enumerate(cells):
            sets = [*cell_sets(c["gpu"], c["model"], c["share"]),
                    f"scheduler.tpot_target_s={c['target_s']:.6f}"]
            jobs.append((c["share"], "orthrus", [*sets, "cluster.router=adaptive"], base))
            where.append((i, "planner"))
            run = split_run(c["best_split_label"], c["best_split_cap"])
            if run is not None:
                jobs.append((c["share"], run[0], [*sets, *run[1]], base))
                where.append((i, "split"))
        for (i, kind), result in zip(where, pool.map(run_point, jobs)):
            cells[i][kind] = result
    for c in cells:
        for kind in ("planner", "split"):
            if kind in c:
                c[kind]["normalised"] = normalised(c[kind], c)
        c["gain"] = (c["planner"]["normalised"] / c["split"]["normalised"]
                     if "split" in c and c["split"]["normalised"] > 0 else None)
    return cells


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def table(cells: list[dict]) -> list[str]:
    """One row per cell: the split, the bound and its parts, both simulated."""
    lines = ["| GPU | model | share | target (ms) | best split (predicted) | bound: decodes / "
             "+ riders / + offload | split simulated: normalised, TPOT p99 | planner simulated: "
             "normalised, TPOT p99, TTFT p99 (s) | planner / split |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        gpu = c["gpu"] + (" (derived)" if c["derived"] else "")
        split = c["best_split_label"] + (f" at {c['best_split_cap']}" if c["best_split_cap"] else "")
        parts = " / ".join(f"{c['parts'][k] / c['best_split']:.3f}x"
                           for k in ("decodes", "riders", "offload"))
        s, p = c.get("split"), c["planner"]
        ttft = "-" if p["ttft_p99_s"] is None else f"{p['ttft_p99_s']:.2f}"
        lines.append(
            f"| {gpu} | {c['model']} | {c['share']} | {c['target_x']:g}x = {_ms(c['target_s'])} | "
            f"{split}: {c['best_split']:.2f} | {parts} | "
            + (f"{s['normalised']:.2f}, {_ms(s['tpot_p99_s'])} | " if s else "- | ")
            + f"{p['normalised']:.2f}, {_ms(p['tpot_p99_s'])}, {ttft} | "
            + ("-" if c["gain"] is None else f"{c['gain']:.3f}x") + " |")
    return lines


def plot(cells: list[dict], out: Path) -> None:
    """Heatmaps, GPU x (model, share), one per target: the planner simulated over the best
    split simulated, and the bound over the best split predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cols = [(m, s) for m in MODELS for s in SHARES]
    fig, axes = plt.subplots(2, len(TARGETS), figsize=(7 * len(TARGETS), 8), squeeze=False)
    for j, x in enumerate(TARGETS):
        for i, (name, value) in enumerate((
                ("planner / best split, simulated", lambda c: c["gain"]),
                ("bound / best split, predicted", lambda c: c["bound"] / c["best_split"]))):
            grid = np.full((len(GPUS), len(cols)), np.nan)
            for c in cells:
                if c["target_x"] == x and value(c) is not None:
                    grid[GPUS.index(c["gpu"]), cols.index((c["model"], c["share"]))] = value(c)
            ax = axes[i][j]
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0.9, vmax=1.1)
            for (r, k), v in np.ndenumerate(grid):
                if np.isfinite(v):
                    ax.text(k, r, f"{v:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(cols)), [f"{m.split('-')[0]}\n{s}" for m, s in cols], fontsize=7)
            ax.set_yticks(range(len(GPUS)), [g + (" *" if g in ("a100-40gb", "h200") else "")
                                             for g in GPUS], fontsize=8)
            ax.set_title(f"{name}, target {x:g}x", fontsize=9)
            fig.colorbar(im, ax=ax, shrink=0.7)
    fig.suptitle("co-serving map (* derived calibration, not fitted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "map.png", dpi=110)
    plt.close(fig)


def write_page(lines: list[str]) -> None:
    """The generated part of docs/headroom.md, between its markers."""
    text = PAGE.read_text()
    start, end = "<!-- map -->", "<!-- /map -->"
    head, rest = text.split(start, 1)
    PAGE.write_text(head + start + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="60-s runs (a smoke test: no page)")
    ap.add_argument("--out", type=Path, default=OUT, help="where map.json and map.png go")
    args = ap.parse_args()
    t0 = time.monotonic()
    cells = compute(args.workers, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "map.json").write_text(json.dumps(cells, indent=1) + "\n")
    plot(cells, args.out)
    lines = table(cells)
    print("\n".join(lines))
    print(f"{len(cells)} cells in {time.monotonic() - t0:.0f} s")
    if not args.quick and args.out == OUT:
        write_page(lines)


if __name__ == "__main__":
    main()
