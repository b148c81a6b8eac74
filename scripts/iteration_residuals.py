"""What a server's iterations took against what the cost model predicts for the same batches.

A throughput miss of the simulator can come from the schedule (the simulated policy chose
other batches than the engine did) or from the cost of the batches (the same batch, another
time). This script separates the two: it takes the iterations a server recorded (``GET
/iterations``, saved by ``scripts/fit_validation.py`` as ``iterations.jsonl``), predicts each
one's time from its shape with a calibration (the fitted factors applied, as the simulator
does), and reports measured against predicted per kind of batch.

Run: python scripts/iteration_residuals.py LOG.jsonl [LOG.jsonl ...] --calibration CAL
     --model DIR [--adapter-rank R] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from orthrus_sim.costmodel import BatchShape, calibrated_predictor


def batch_kind(shape: BatchShape) -> str:
    """What the batch carried: embedding chunks, prompt chunks, decodes, or a mix of them."""
    parts = []
    if shape.pooled_rows:
        parts.append("embedding")
    if shape.chunk_tokens > shape.pooled_rows:
        parts.append("prefill")
    if shape.decodes:
        parts.append("decode")
    return "+".join(parts) or "empty"


def load_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
                row["shape"] = BatchShape(**row["shape"])
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"{path}, line {i}: not an iteration row ({exc})") from None
            row["log"] = path.parent.name
            rows.append(row)
    return rows


def residuals(rows: list[dict], calibration: str, model: str, adapter_rank: int | None) -> list[dict]:
    """Per (log, batch kind): iterations, measured and predicted seconds (sums and means), the
    ratio of the sums, and the median per-iteration ratio."""
    cost = calibrated_predictor(calibration, model, adapter_rank).cost
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for row in rows:
        key = (row["log"], batch_kind(row["shape"]))
        groups.setdefault(key, []).append((row["seconds"], cost.shape_time(row["shape"])))
    for row in rows:  # every log's total
        groups.setdefault((row["log"], "all"), []).append(
            (row["seconds"], cost.shape_time(row["shape"])))
    out = []
    for (log, kind), pairs in sorted(groups.items()):
        measured = sum(m for m, _ in pairs)
        predicted = sum(p for _, p in pairs)
        out.append({"log": log, "batch": kind, "iterations": len(pairs),
                    "measured_s": measured, "predicted_s": predicted,
                    "measured_mean_s": measured / len(pairs),
                    "predicted_mean_s": predicted / len(pairs),
                    "ratio": predicted / measured if measured else None,
                    "median_ratio": statistics.median(p / m for m, p in pairs if m > 0)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--model", required=True, help="model directory or catalogue name")
    parser.add_argument("--adapter-rank", type=int, default=None,
                        help="the embedding adapter's rank (rows with lora_rows pay it)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    out = residuals(load_rows(args.logs), args.calibration, args.model, args.adapter_rank)
    table = Table(title="iterations: measured against the cost model (same batches)")
    for col in ("server", "batch", "iterations", "measured ms", "predicted ms", "pred/meas",
                "median ratio"):
        table.add_column(col, justify="left" if col in ("server", "batch") else "right")
    for r in out:
        table.add_row(r["log"], r["batch"], str(r["iterations"]), f"{r['measured_mean_s'] * 1e3:.1f}",
                      f"{r['predicted_mean_s'] * 1e3:.1f}", f"{r['ratio']:.3f}",
                      f"{r['median_ratio']:.3f}")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
