"""PNG plots of a results set: throughput bars, latency CDFs, utilisation and queue over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _finish(fig, axes, path: Path, title: str) -> None:
    """Grid and legend on every axis, the title over the figure, written to ``path``."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput_bars(runs: list[dict], path: Path, title: str) -> None:
    names = [r["configuration"] for r in runs]
    emb = [r["metrics"]["throughput_rps"]["embedding"] for r in runs]
    gen = [r["metrics"]["throughput_rps"]["generation"] for r in runs]
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(names)), 4))
    x = np.arange(len(names))
    ax.bar(x, emb, label="embedding")
    ax.bar(x, gen, bottom=emb, label="generation")
    for i, (e, g) in enumerate(zip(emb, gen)):
        ax.text(i, e + g, f"{e + g:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set_ylabel("requests / s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_cdfs(runs: list[dict], requests: dict[str, list[dict]], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("embedding", "generation")):
        for run in runs:
            lat = sorted(r["latency_s"] for r in requests[run["configuration"]]
                         if r["kind"] == kind and r["latency_s"] is not None)
            if lat:
                ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=run["configuration"])
        ax.set_xscale("log")
        ax.set_xlabel(f"{kind} latency (s)")
        ax.set_ylabel("fraction of requests")
    _finish(fig, axes, path, title)


def timelines(runs: list[dict], timeline: dict[str, list[dict]], path: Path, title: str) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run in runs:
        rows = timeline[run["configuration"]]
        if not rows:
            continue
        t = [r["time_s"] for r in rows]
        busy_keys = [k for k in rows[0] if k.startswith("busy_")]
        axes[0].plot(t, [np.mean([r[k] for k in busy_keys]) for r in rows], label=run["configuration"])
        axes[1].plot(t, [r["queue_length"] for r in rows], label=run["configuration"])
    axes[0].set_ylabel("GPU busy (mean)")
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylabel("requests queued")
    axes[1].set_xlabel("simulated time (s)")
    _finish(fig, axes, path, title)


def sweep_plot(points: list[dict], key: str, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    configs = sorted({run["configuration"] for p in points for run in p["runs"]})
    xs = [str(p["overrides"].get(key)) for p in points]
    for cfg in configs:
        ys = [next((run["metrics"]["throughput_rps"]["combined"] for run in p["runs"]
                    if run["configuration"] == cfg), np.nan) for p in points]
        ax.plot(xs, ys, marker="o", label=cfg)
    ax.set_xlabel(key)
    ax.set_ylabel("combined throughput (requests / s)")
    _finish(fig, [ax], path, title)
