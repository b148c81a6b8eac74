"""PNG plots of a results set: throughput bars, latency / TTFT / TPOT CDFs, utilisation and
queue over time per GPU, and sweeps.

Each configuration keeps one colour, line style and marker in every plot, so lines that lie on
top of each other (Orthrus and Unified-Hetero often do) stay distinguishable.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

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


def _log_x(ax) -> None:
    """A log x-axis labelled 0.1, 1, 10 (not 10^0 or 2x10^0)."""
    ax.set_xscale("log")
    fmt = ScalarFormatter()
    fmt.set_scientific(False)
    ax.xaxis.set_major_formatter(fmt)
    ax.xaxis.set_minor_formatter(NullFormatter())


def run_plots(name: str, runs: list[dict], requests: dict[str, list[dict]],
              timelines: dict[str, list[dict]], out: Path) -> None:
    throughput_bars(runs, out / "throughput.png", f"{name}: throughput")
    latency_cdfs(runs, requests, out / "latency_cdf.png", f"{name}: latency CDFs")
    timelines_plot(runs, timelines, out / "timeline.png", f"{name}: utilisation and queue")


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
        _log_x(ax)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
    _finish(fig, list(axes.flat), path, title)


def timelines_plot(runs: list[dict], timeline: dict[str, list[dict]], path: Path, title: str) -> None:
    """Per configuration: each GPU's busy fraction and MFU over time, and requests waiting."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for i, run in enumerate(runs):
        rows = timeline[run["configuration"]]
        if not rows:
            continue
        t = [r["time_s"] for r in rows]
        gpus = sorted(int(k.split("_")[1]) for k in rows[0] if k.startswith("busy_"))
        st = style(i)
        for g in gpus:
            kw = dict(st, marker=None, alpha=0.35 + 0.65 / len(gpus), linewidth=1.0)
            axes[0].plot(t, [r[f"busy_{g}"] for r in rows],
                         label=run["configuration"] if g == gpus[0] else None, **kw)
            axes[1].plot(t, [r.get(f"mfu_{g}", 0.0) for r in rows], **kw)
        axes[2].plot(t, [r["queue_length"] for r in rows], label=run["configuration"], **st)
    axes[0].set_ylabel("busy, per GPU")
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylabel("MFU, per GPU")
    axes[2].set_ylabel("requests waiting")
    axes[2].set_xlabel("time (s)")
    _finish(fig, axes, path, title)


def _number(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def sweep_plot(points: list[dict], key: str, path: Path, title: str) -> None:
    """Combined throughput against the first grid key: at its numeric values when they are
    numbers (0, 0.1, 0.5, 0.9, 1 are not evenly spaced), else in grid order."""
    fig, ax = plt.subplots(figsize=(7, 4))
    configs = list(dict.fromkeys(run["configuration"] for p in points for run in p["runs"]))
    raw_x = [p["overrides"].get(key) for p in points]
    nums = [_number(v) for v in raw_x]
    numeric = all(n is not None for n in nums)
    xs = nums if numeric else list(range(len(points)))
    for i, cfg in enumerate(configs):
        pairs = [(x, next((run["metrics"]["throughput_rps"]["combined"] for run in p["runs"]
                           if run["configuration"] == cfg), np.nan)) for x, p in zip(xs, points)]
        pairs.sort(key=lambda xy: xy[0])
        ax.plot([x for x, _ in pairs], [y for _, y in pairs], label=cfg, **dict(style(i), markevery=1))
    if not numeric:
        ax.set_xticks(xs, [str(v) for v in raw_x], rotation=20, ha="right")
    ax.set_xlabel(key)
    ax.set_ylabel("combined throughput (requests / s)")
    _finish(fig, [ax], path, title)


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
