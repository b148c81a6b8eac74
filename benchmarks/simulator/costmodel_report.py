"""Cost-model report: A100-40GB + Mistral-7B iteration time against batch composition, and the
fitted operator model against the measured A100 points.

Run: python -m benchmarks.simulator.costmodel_report [--out out/costmodel]
Prints the table; writes heatmap.png and a100_fit.png.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402

from benchmarks.common import ROOT, parser, table  # noqa: E402
from orthrus_sim.costmodel import (  # noqa: E402
    BatchShape,
    CostModel,
    LoRASpec,
    get_hardware,
    get_model,
    load_calibration,
)
from orthrus_sim.costmodel.profiling_csv import load_operator_rows  # noqa: E402
from orthrus_sim.engine import ItemKind  # noqa: E402

DECODES = [0, 1, 8, 32, 64, 128, 256]
EMBED_TOKENS = [0, 128, 512, 1024, 2048, 4096]
CONTEXT = 640  # 128-token prompt + half of a 512-token output


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--out", default="out/costmodel")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    hw = get_hardware("a100-40gb")
    cal = load_calibration(ROOT / "calibration" / "a100-40gb.json")
    cost = CostModel(hw, get_model("mistral-7b-v0.1"), cal.to_coefficients(), LoRASpec(16))

    grid = np.zeros((len(DECODES), len(EMBED_TOKENS)))
    times = table(f"Iteration time (ms), A100-40GB, Mistral-7B + LoRA r16, decode context {CONTEXT}",
                  ["decodes \\ embed tokens", *map(str, EMBED_TOKENS)])
    for i, d in enumerate(DECODES):
        cells = []
        for j, e in enumerate(EMBED_TOKENS):
            items = [(ItemKind.DECODE, 1, CONTEXT)] * d
            items += [(ItemKind.EMBED_CHUNK, 512, 0)] * (e // 512) if e >= 512 else (
                [(ItemKind.EMBED_CHUNK, e, 0)] if e else [])
            grid[i, j] = cost.shape_time(BatchShape.from_items(items)) * 1e3 if items else np.nan
            cells.append("-" if not items else f"{grid[i, j]:.1f}")
        times.add_row(str(d), *cells)
    console = Console()
    console.print(times)

    # Gain of mixing: one mixed iteration against the decode-only and embedding-only ones.
    gain = table("Mixed iteration / (decode-only + embedding-only), lower is better",
                 ["decodes \\ embed tokens", *map(str, EMBED_TOKENS[1:])])
    for i, d in enumerate(DECODES[1:], start=1):
        gain.add_row(str(d), *[f"{grid[i, j] / (grid[i, 0] + grid[0, j]):.2f}"
                               for j in range(1, len(EMBED_TOKENS))])
    console.print(gain)

    fig, ax = plt.subplots(figsize=(7, 5))
    im = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(EMBED_TOKENS)), EMBED_TOKENS)
    ax.set_yticks(range(len(DECODES)), DECODES)
    ax.set_xlabel("embedding tokens in the batch")
    ax.set_ylabel(f"decodes in the batch (context {CONTEXT})")
    for i in range(len(DECODES)):
        for j in range(len(EMBED_TOKENS)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(im, label="iteration time (ms)")
    ax.set_title("A100-40GB, Mistral-7B: iteration time by batch composition")
    fig.tight_layout()
    fig.savefig(out / "heatmap.png", dpi=120)

    coeffs = cal.to_coefficients().ops
    rows = load_operator_rows(ROOT / "calibration/data/a100-profiling/llama-2-7b_a100_linear_ops.csv")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, op in zip(axes.flat, ("qkv", "o_proj", "gate_up", "down")):
        pts = sorted((r for r in rows if r["op"] == op and r["tokens"] <= 4096),
                     key=lambda r: r["tokens"])
        t = [r["tokens"] for r in pts]
        ax.loglog(t, [r["seconds"] * 1e3 for r in pts], ".", ms=3, label="A100 measured")
        ax.loglog(t, [coeffs[op].time(r["flops"], r["bytes"], hw.peak_flops, hw.mem_bw) * 1e3
                      for r in pts], "-", label="fitted roofline")
        ridge = hw.peak_flops * coeffs[op].compute_eff / (hw.mem_bw * coeffs[op].memory_eff)
        ax.set_title(f"{op} (Llama-2-7B, per layer); ridge at ~{ridge:.0f} FLOP/byte", fontsize=9)
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("tokens in batch")
    fig.tight_layout()
    fig.savefig(out / "a100_fit.png", dpi=120)
    console.print(f"wrote {out / 'heatmap.png'} and {out / 'a100_fit.png'}")


if __name__ == "__main__":
    main()
