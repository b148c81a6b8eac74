"""PNG plots of a results set: throughput bars, latency / TTFT / TPOT CDFs, utilisation and
queue over time per GPU, and sweeps.

Each configuration keeps one colour, line style and marker in every plot, so lines that lie on
top of each other stay distinguishable; in the timeline each GPU has its own labelled line.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1)), "v"), ((0, (1, 1)), "P")]


def style(i: int) -> dict:
    line, marker = STYLES[i % len(STYLES)]
    return {"color": f"C{i % 10}", "linestyle": line, "marker": marker, "markevery": 0.1,
            "markersize": 5}


def _finish(fig, axes, path: Path, title: str) -> None:
    """Grid and legend on every axis, the title over the figure, written to ``path``."""
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _x_scale(ax, values: list[float]) -> None:
    """A log x-axis when the values span more than a decade, ticked at 1-2-5 steps and
    labelled as plain numbers (0.02, 0.05, 0.1); a linear one otherwise, so a narrow spread
    (TPOT: 0.02-0.04 s) still gets numbers on its axis."""
    positive = [v for v in values if v > 0]
    if not positive or max(positive) / min(positive) < 10:
        return
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def run_plots(name: str, runs: list[dict], requests: dict[str, list[dict]],
              timelines: dict[str, list[dict]], out: Path) -> None:
    throughput_bars(runs, out / "throughput.png", f"{name}: throughput")
    latency_cdfs(runs, requests, out / "latency_cdf.png", f"{name}: latency CDFs")
    timelines_plot(runs, timelines, out / "timeline.png", f"{name}: utilisation and queue")
    placed = [r for r in runs if r["metrics"].get("placement", {}).get("demand")]
    if placed:
        placement_plot(placed, out / "placement.png", f"{name}: placement plans and demand")


def placement_plot(runs: list[dict], path: Path, title: str) -> None:
    """Per run with the adaptive router: the demand it observed (work in flight per kind) and
    the replicas it put on the decoding side (riders marked), over time."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        log = run["metrics"]["placement"]["demand"]
        t = [r["time_s"] for r in log]
        ax.plot(t, [r["generations"] for r in log], label="generations in flight", color="C1")
        ax.plot(t, [r["embeddings"] for r in log], label="embeddings in flight", color="C0")
        ax.set_ylabel("in flight")
        side = ax.twinx()
        side.step(t, [r["decoding"] for r in log], where="post", color="k",
                  label="decoding replicas")
        ride = [(x, r["decoding"]) for x, r in zip(t, log) if r["riders"]]
        if ride:
            side.plot(*zip(*ride), "k.", markersize=3, label="with riders")
        side.set_ylabel("decoding replicas")
        side.set_ylim(-0.2, max(r["decoding"] for r in log) + 0.5)
        side.legend(fontsize=8, loc="upper right")
        ax.set_title(run["configuration"], fontsize=9)
        ax.set_xlabel("time (s)")
    _finish(fig, list(axes[:, 0]), path, title)


def throughput_bars(runs: list[dict], path: Path, title: str) -> None:
    names = [r["configuration"] for r in runs]
    emb = [r["metrics"]["throughput_rps"]["embedding"] for r in runs]
    gen = [r["metrics"]["throughput_rps"]["generation"] for r in runs]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(names)), 4))
    x = np.arange(len(names))
    ax.bar(x, emb, label="embedding")
    ax.bar(x, gen, bottom=emb, label="generation", hatch="//")
    for i, (e, g) in enumerate(zip(emb, gen)):
        ax.text(i, e + g, f"{e + g:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set_ylabel("requests / s")
    _finish(fig, [ax], path, title)


def _cdf(ax, values: list[float], i: int, label: str) -> None:
    if values:
        values = sorted(values)
        ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=label, **style(i))


def latency_cdfs(runs: list[dict], requests: dict[str, list[dict]], path: Path, title: str) -> None:
    """End-to-end latency per kind, and generation TTFT and TPOT (as Vidur reports them)."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [("embedding latency (s)", "embedding", "latency"),
              ("generation latency (s)", "generation", "latency"),
              ("time to first token (s)", "generation", "ttft"),
              ("time per output token (s)", "generation", "tpot")]
    for ax, (label, kind, what) in zip(axes.flat, panels):
        shown: list[float] = []
        for i, run in enumerate(runs):
            rows = [r for r in requests[run["configuration"]]
                    if r["kind"] == kind and r["latency_s"] is not None]
            if what == "latency":
                values = [r["latency_s"] for r in rows]
            elif what == "ttft":
                values = [r["first_token_s"] - r["arrival_s"] for r in rows]
            else:
                values = [(r["finished_s"] - r["first_token_s"]) / (r["output_tokens"] - 1)
                          for r in rows if r["output_tokens"] > 1]
            values = [v for v in values if v > 0]
            _cdf(ax, values, i, run["configuration"])
            shown += values
        _x_scale(ax, shown)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
    _finish(fig, list(axes.flat), path, title)


def timelines_plot(runs: list[dict], timeline: dict[str, list[dict]], path: Path, title: str) -> None:
    """One row per configuration: each GPU's busy fraction and MFU over time, a labelled line
    per GPU; the last row: requests waiting and mean KV-cache use, per configuration."""
    runs = [r for r in runs if timeline.get(r["configuration"])]
    n = max(1, len(runs))
    fig, axes = plt.subplots(n + 1, 2, figsize=(12, 2.2 * (n + 1)), sharex=True, squeeze=False)
    for row, run in enumerate(runs):
        rows = timeline[run["configuration"]]
        t = [r["time_s"] for r in rows]
        gpus = sorted(int(k.split("_")[1]) for k in rows[0] if k.startswith("busy_"))
        for g in gpus:
            kw = {"color": f"C{g % 10}", "linewidth": 1.0, "label": f"GPU {g}"}
            axes[row][0].plot(t, [r[f"busy_{g}"] for r in rows], **kw)
            axes[row][1].plot(t, [r.get(f"mfu_{g}", 0.0) for r in rows], **kw)
        axes[row][0].set_ylabel(f"{run['configuration']}\nbusy")
        axes[row][0].set_ylim(0, 1.05)
        axes[row][1].set_ylabel("MFU")
    for i, run in enumerate(runs):
        rows = timeline[run["configuration"]]
        t = [r["time_s"] for r in rows]
        kv = [[v for k, v in r.items() if k.startswith("kv_usage_")] for r in rows]
        st = dict(style(i), marker=None)
        axes[n][0].plot(t, [r["queue_length"] for r in rows], label=run["configuration"], **st)
        axes[n][1].plot(t, [sum(v) / len(v) if v else 0.0 for v in kv], label=run["configuration"],
                        **st)
    axes[n][0].set_ylabel("requests waiting")
    axes[n][1].set_ylabel("KV use (mean of GPUs)")
    axes[n][1].set_ylim(0, 1.05)
    for ax in axes[n]:
        ax.set_xlabel("time (s)")
    _finish(fig, list(axes.flat), path, title)


def _number(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def sweep_plot(points: list[dict], keys: list[str], path: Path, title: str) -> None:
    """Combined throughput against the first grid key (at its numeric values when they are
    numbers: 0, 0.1, 0.5, 0.9, 1 are not evenly spaced, else in grid order), one panel per
    combination of the other keys' values, so a 2-D grid shows all of it."""
    key, others = keys[0], keys[1:]
    panels: dict[tuple, list[dict]] = {}
    for p in points:
        panels.setdefault(tuple(p["overrides"].get(k) for k in others), []).append(p)
    configs = list(dict.fromkeys(run["configuration"] for p in points for run in p["runs"]))
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4 * nrows), squeeze=False)
    for ax, (values, pts) in zip(axes.flat, panels.items()):
        raw_x = [p["overrides"].get(key) for p in pts]
        nums = [_number(v) for v in raw_x]
        numeric = all(n is not None for n in nums)
        xs = nums if numeric else list(range(len(pts)))
        for i, cfg in enumerate(configs):
            pairs = [(x, next((run["metrics"]["throughput_rps"]["combined"] for run in p["runs"]
                               if run["configuration"] == cfg), np.nan)) for x, p in zip(xs, pts)]
            pairs.sort(key=lambda xy: xy[0])
            ax.plot([x for x, _ in pairs], [y for _, y in pairs], label=cfg,
                    **dict(style(i), markevery=1))
        if not numeric:
            ax.set_xticks(xs, [str(v) for v in raw_x], rotation=20, ha="right")
        if others:
            ax.set_title(", ".join(f"{k}={v}" for k, v in zip(others, values)), fontsize=9)
        ax.set_xlabel(key)
        ax.set_ylabel("combined throughput (requests / s)")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    _finish(fig, list(axes.flat)[:len(panels)], path, title)


def capacity_plot(doc: dict, path: Path, title: str) -> None:
    """SLO attainment against offered rate, one panel per kind the mix sends, one line per
    configuration (the rate search's runs), the required attainment dashed, each
    configuration's answer circled."""
    kinds = [k for k, r in doc["offered_rps_by_kind"].items() if r > 0]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for i, res in enumerate(doc["rate_search"]):
            pts = [(r["offered_rps"], r["attainment"][kind]) for r in res["runs"]
                   if r["attainment"][kind] is not None]
            if not pts:
                continue
            st = dict(style(i), markevery=1)
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=res["configuration"], **st)
            best = [y for x, y in pts if np.isclose(x, res["max_rate_rps"])]
            if best:
                ax.plot([res["max_rate_rps"]], best, marker="o", markersize=11, fillstyle="none",
                        color=st["color"], linestyle="none")
        ax.axhline(doc["required_attainment"], color="grey", linestyle="--", linewidth=1,
                   label=f"required {doc['required_attainment']:.0%}")
        ax.set_xlim(left=0)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("offered rate, both kinds (requests / s)")
        ax.set_ylabel(f"{kind} SLO attainment")
    _finish(fig, list(axes[0]), path, title)
