"""The co-serving trade-off, shown: normalised throughput against generation TPOT p99 on the
mix sweep (scenarios/mix_sweep.yaml), per generation share.

Points: the static splits, Dedicated (1:3, 2:2, 3:1) and Disagg-PD (the prompts offloaded to its
prefill replicas, which co-batch them with embeddings), each as it is and capped at each
target (``scheduler.max_num_seqs`` at the most decodes the placement planner finds within the
target, the rest of the clients waiting: ``PlacementPlanner.decode_cap``), and the Unified
baselines as the brief specifies them; Orthrus with an iteration-time target from 1x to 3x the
decode-only step (Dedicated-1:3's TPOT p50 at that share), with round-robin and with adaptive
placement. A split serves as the best split where its TPOT p99 is no worse. Writes
frontier.json and frontier.png (docs/reproduction/frontier/ by default) and prints the table;
``scripts/make_reproduction.py`` runs it for docs/reproduction.md's "Co-serving frontier".
Deterministic: the simulator is.

    python scripts/make_frontier.py [--workers 2] [--shares 0.1,0.5,0.9] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SPLITS = ["dedicated-1:3", "dedicated-2:2", "dedicated-3:1",
          "disagg-pd-1:3", "disagg-pd-2:2", "disagg-pd-3:1"]
CAP = "scheduler.max_num_seqs"
BASELINES = ["unified-hetero", "unified-homo", "orthrus"]
TARGETS = [1.0, 1.25, 1.5, 2.0, 3.0]
OUT = Path(__file__).resolve().parents[1] / "docs" / "reproduction" / "frontier"
SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "mix_sweep.yaml"
QUICK = ["duration_s=60", "warmup_s=10"]


def run_point(args: tuple[float, str, list[str], list[str]]) -> dict:
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.sim.run import simulate

    share, configuration, sets, base = args
    sc = load_scenario(SCENARIO, [*base, f"workload.generation_share={share}", *sets])
    m = simulate(sc, configuration, keep_rows=False).metrics
    return {"share": share, "configuration": configuration, "set": sets,
            "embedding_rps": m["throughput_rps"]["embedding"],
            "generation_rps": m["throughput_rps"]["generation"],
            "tpot_p50_s": m["latency_s"].get("tpot", {}).get("p50"),
            "tpot_p99_s": m["latency_s"].get("tpot", {}).get("p99"),
            "ttft_p99_s": m["latency_s"].get("ttft", {}).get("p99"),
            # the adaptive router's last plan (emb:dec, capped, riders)
            "plan": (m.get("placement") or {}).get("plans", [{}])[-1].get("assignment")}


def label(p: dict) -> str:
    if is_split(p) and p["set"]:
        return f"{p['configuration']} capped {p['set'][0].split('=')[1]}"
    if not p["set"]:
        return p["configuration"] if p["configuration"] != "orthrus" else "orthrus (brief's IBS)"
    router = "adaptive" if any("adaptive" in s for s in p["set"]) else "round-robin"
    return f"orthrus {p['target_x']:g}x {router}"


def is_split(p: dict) -> bool:
    """A static split, capped or not."""
    return p["configuration"] in SPLITS


def caps(share: float, target_s: float, base: list[str]) -> tuple[int, int]:
    """The most decodes a replica holds within the target with its prompts, and alone (its
    prompts offloaded): the placement planner's caps at the mix sweep's demand."""
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.questions.headroom import scenario_demand, scenario_planner

    sc = load_scenario(SCENARIO, [*base, f"workload.generation_share={share}",
                                  f"scheduler.tpot_target_s={target_s}"])
    planner = scenario_planner(sc)
    d = scenario_demand(sc, planner)
    return planner.decode_cap(d), planner.decode_cap(d, offload=True)


def normalised(p: dict, ref: dict) -> float:
    """Throughput per kind relative to one dedicated GPU of that kind, summed (the brief's
    normalised throughput: what share of a GPU each kind's rate would need on its own)."""
    return p["embedding_rps"] / ref["emb_per_gpu"] + p["generation_rps"] / ref["gen_per_gpu"]


def compute(shares: list[float], workers: int = 2, quick: bool = False, out: Path = OUT) -> list[dict]:
    """Every point of the frontier; writes frontier.json and frontier.png under ``out``."""
    base = QUICK if quick else []
    with ProcessPoolExecutor(workers) as pool:
        first = list(pool.map(run_point, [(s, c, [], base) for s in shares
                                          for c in SPLITS + BASELINES]))
        step = {p["share"]: p["tpot_p50_s"] for p in first if p["configuration"] == "dedicated-1:3"}
        jobs = []
        for s in shares:
            gens = round(512 * s)  # the scenario's generation clients
            capped = set()
            for x in TARGETS:
                # the target alone: waiting_work is prompt+output by default with it
                sets = [f"scheduler.tpot_target_s={x * step[s]:.6f}"]
                jobs += [(s, "orthrus", sets, base),
                         (s, "orthrus", sets + ["cluster.router=adaptive"], base)]
                with_prompts, alone = caps(s, x * step[s], base)
                for c in SPLITS:  # a cap that binds: below the split's generations per replica
                    cap = alone if c.startswith("disagg") else with_prompts
                    if cap < min(256, -(-gens // int(c.split(":")[1]))) and (c, cap) not in capped:
                        capped.add((c, cap))
                        jobs.append((s, c, [f"{CAP}={cap}"], base))
        second = list(pool.map(run_point, jobs))
    for p in second:
        if is_split(p):
            continue
        p["target_x"] = round(float(p["set"][0].split("=")[1]) / step[p["share"]], 2)
        if p["set"][-1] == "cluster.router=adaptive":
            p["headroom"] = headroom_at(p["share"], p["set"][0])
    points = first + second
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(points, indent=1) + "\n")
    _plots(points, shares, out)
    return points


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shares", default="0.1,0.5,0.9")
    ap.add_argument("--quick", action="store_true", help="60-s runs (a smoke test)")
    ap.add_argument("--out", type=Path, default=OUT, help="where frontier.json and .png go")
    args = ap.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    print("\n".join(table(compute(shares, args.workers, args.quick, args.out), shares)))


def headroom_at(share: float, target_set: str) -> dict:
    """What any placement could serve at this share and target, over the best static split,
    under the simulator's cost model (``orthrus-sim headroom``: the bound on every spread of
    decodes and riders over the replicas)."""
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.questions.headroom import headroom

    b = headroom(load_scenario(SCENARIO, [f"workload.generation_share={share}", target_set])).bound
    return b.as_dict()  # JSON: null where a figure is missing


def headroom_table(points: list[dict], shares: list[float]) -> list[str]:
    """The bound over the best split per share and target (adaptive points' ``headroom``)."""
    targets = sorted({p["target_x"] for p in points if "headroom" in p})
    lines = ["| share | " + " | ".join(f"{x:g}x" for x in targets) + " |",
             "|---|" + "---|" * len(targets)]
    for share in shares:
        cells = []
        for x in targets:
            h = next((p["headroom"]["headroom"] for p in points if "headroom" in p
                      and p["share"] == share and p["target_x"] == x), None)
            cells.append("-" if h is None else f"{h:.3f}")
        lines.append(f"| {share} | " + " | ".join(cells) + " |")
    return lines


def _reference(points: list[dict], share: float) -> dict:
    d13 = next(p for p in points if p["share"] == share and p["configuration"] == "dedicated-1:3")
    return {"emb_per_gpu": d13["embedding_rps"] / 1, "gen_per_gpu": d13["generation_rps"] / 3}


def _plots(points: list[dict], shares: list[float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(shares), figsize=(5 * len(shares), 4.2), squeeze=False)
    for ax, share in zip(axes[0], shares):
        ref = _reference(points, share)
        here = [p for p in points if p["share"] == share]
        for router, marker in (("round-robin", "o-"), ("adaptive", "s-")):
            line = sorted((p for p in here if p["set"] and label(p).endswith(router)),
                          key=lambda p: p["target_x"])
            ax.plot([p["tpot_p99_s"] * 1e3 for p in line], [normalised(p, ref) for p in line],
                    marker, label=f"orthrus + target, {router}")
            for p in line:
                ax.annotate(f"{p['target_x']:g}x", (p["tpot_p99_s"] * 1e3, normalised(p, ref)),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        splits = sorted((p["tpot_p99_s"] * 1e3, normalised(p, ref)) for p in here
                        if is_split(p) and p["tpot_p99_s"] is not None)
        xs, ys, top = [], [], 0.0
        for x, y in splits:  # the best split at a TPOT p99 no worse than x: a rising step
            top = max(top, y)
            xs.append(x)
            ys.append(top)
        xs.append(max(p["tpot_p99_s"] for p in here if p["tpot_p99_s"]) * 1e3 * 1.2)
        ys.append(top)
        ax.plot(xs, ys, "k--", drawstyle="steps-post", linewidth=1,
                label="best static split at TPOT p99 <= x")
        spots: dict[tuple, list[str]] = {}  # baselines at one spot share one label
        for p in here:
            if (p["set"] and not is_split(p)) or p["tpot_p99_s"] is None:
                continue
            x, y = p["tpot_p99_s"] * 1e3, normalised(p, ref)
            ax.plot(x, y, "k^" if "dedicated" in p["configuration"] else "rx", markersize=8)
            key = (round(math.log(x) * 20), round(y, 1))  # within ~5 % of each other
            spots.setdefault(key, (x, y, []))[2].append(label(p))
        for x, y, names in spots.values():
            ax.annotate(" = ".join(names), (x, y), fontsize=7, xytext=(4, -9),
                        textcoords="offset points")
        ax.set_xscale("log")
        ticks = [t for t in (10, 15, 20, 30, 50, 70, 100, 150, 200)
                 if min(p["tpot_p99_s"] * 1e3 for p in here if p["tpot_p99_s"]) * 0.8 <= t
                 <= max(p["tpot_p99_s"] * 1e3 for p in here if p["tpot_p99_s"]) * 1.25]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("generation TPOT p99 (ms, log)")
        ax.set_ylabel("normalised throughput (GPUs' worth)")
        ax.set_title(f"generation share {share}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)


def best_split(p: dict, points: list[dict]) -> dict | None:
    """The static split with the highest normalised throughput among those whose TPOT p99 is
    no worse than ``p``'s (None when every split's is worse)."""
    ref = _reference(points, p["share"])
    tpot = p["tpot_p99_s"]
    splits = [s for s in points if s["share"] == p["share"] and is_split(s)
              and tpot is not None and s["tpot_p99_s"] is not None and s["tpot_p99_s"] <= tpot]
    return max(splits, key=lambda s: normalised(s, ref), default=None)


def versus_best_split(p: dict, points: list[dict]) -> float | None:
    """``p``'s normalised throughput over the best split's at a TPOT p99 no worse."""
    best = best_split(p, points)
    if best is None:
        return None
    ref = _reference(points, p["share"])
    return normalised(p, ref) / normalised(best, ref)


def dominated_by(p: dict, points: list[dict]) -> list[str]:
    """The static splits that serve both kinds more than 2 % more at a TPOT p99 no worse."""
    tpot = p["tpot_p99_s"]
    return [label(s) for s in points
            if s["share"] == p["share"] and is_split(s) and s is not p
            and tpot is not None and s["tpot_p99_s"] is not None and s["tpot_p99_s"] <= tpot
            and s["embedding_rps"] > 1.02 * p["embedding_rps"]
            and s["generation_rps"] > 1.02 * p["generation_rps"]]


def table(points: list[dict], shares: list[float]) -> list[str]:
    """The markdown table of every point."""
    lines = ["| share | configuration | emb/s | gen/s | TPOT p99 (ms) | TTFT p99 (s) | normalised "
             "| x best split (TPOT p99 no worse) | dominated by a split |",
             "|---|---|---|---|---|---|---|---|---|"]
    for share in shares:
        ref = _reference(points, share)
        here = [p for p in points if p["share"] == share]
        for p in sorted(here, key=lambda p: (bool(p["set"]) and not is_split(p),
                                             p.get("target_x", 0), label(p))):
            tpot, ttft = p["tpot_p99_s"], p["ttft_p99_s"]
            lines.append(
                f"| {share} | {label(p)} | {p['embedding_rps']:.1f} | {p['generation_rps']:.2f} | "
                f"{'-' if tpot is None else f'{tpot * 1e3:.1f}'} | "
                f"{'-' if ttft is None else f'{ttft:.2f}'} | {normalised(p, ref):.2f} | "
                f"{_versus(p, points)} | {', '.join(dominated_by(p, points)) or 'no'} |")
    return lines


def _versus(p: dict, points: list[dict]) -> str:
    if is_split(p):
        return "-"
    ratio, best = versus_best_split(p, points), best_split(p, points)
    return "-" if ratio is None else f"{ratio:.2f} ({label(best).removeprefix('dedicated-')})"


if __name__ == "__main__":
    main()
