"""What a server's iterations took against what the cost model predicts for the same batches
(``orthrus_sim/costmodel/iteration_check.py``): separates a simulator miss that comes from the
schedule from one that comes from the cost of the batches.

The iterations are a server's ``GET /iterations`` record, saved by ``scripts/fit_validation.py``
as ``iterations.jsonl`` beside each server's results (or by ``save_iterations`` in
``orthrus_real/measure/validate.py``); each is predicted from its shape with the calibration's cost
model, its fitted factors applied as the simulator applies them.

Run: python scripts/iteration_residuals.py LOG.jsonl [LOG.jsonl ...] --calibration CAL
     --model DIR [--adapter-rank R] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from orthrus_sim.costmodel import calibrated_predictor
from orthrus_sim.costmodel.iteration_check import iteration_residuals, load_iterations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--model", required=True, help="model directory or catalogue name")
    parser.add_argument("--adapter-rank", type=int, default=None,
                        help="the embedding adapter's rank (rows with lora_rows pay it)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        rows = [row for log in args.logs for row in load_iterations(log)]
        cost = calibrated_predictor(args.calibration, args.model, args.adapter_rank).cost
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    out = iteration_residuals(rows, cost)
    table = Table(title="iterations: measured against the cost model (same batches)")
    for col in ("server", "batch", "iterations", "measured ms", "predicted ms", "pred/meas",
                "median ratio"):
        table.add_column(col, justify="left" if col in ("server", "batch") else "right")
    for r in out:
        table.add_row(r["log"], r["batch"], str(r["iterations"]), f"{r['measured_mean_s'] * 1e3:.1f}",
                      f"{r['predicted_mean_s'] * 1e3:.1f}", f"{r['ratio']:.3f}",
                      f"{r['median_ratio']:.3f}")
    Console(width=120).print(table)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
