"""Fit the A100 calibration from the measured operator timings in calibration/data.

Run: python calibration/fit_a100.py   (writes calibration/a100-40gb.json, prints the fit error)
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from orthrus_sim.costmodel.calibration import (
    CalibrationFile,
    FitErrorModel,
    OperatorSample,
    SourceModel,
    coefficients_model,
    fit_operator,
    mape,
    save_calibration,
)
from orthrus_sim.costmodel.coefficients import Coefficients, default_ops
from orthrus_sim.costmodel.hardware import get_hardware
from orthrus_sim.costmodel.operators import OPERATORS
from orthrus_sim.costmodel.profiling_csv import load_operator_rows

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "a100-profiling"
FILES = ["llama-2-7b_a100_linear_ops.csv", "llama-3-8b_a100_linear_ops.csv"]
MAX_TOKENS = 4096
BANDS = [(1, 64), (65, 512), (513, 4096)]


def main(out: Path = HERE / "a100-40gb.json") -> CalibrationFile:
    hw = get_hardware("a100-40gb")
    rows = [r for f in FILES for r in load_operator_rows(DATA / f) if r["tokens"] <= MAX_TOKENS]
    by_op: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_op[r["op"]].append(r)
    ops = default_ops()
    op_mape, detail = {}, {}
    table = Table(title="A100 operator fit (TP=1, 1-4,096 tokens, Llama-2-7B + Llama-3-8B)")
    for col in ["operator", "points", "MAPE", *[f"MAPE {a}-{b} tok" for a, b in BANDS],
                "compute_eff", "memory_eff", "sharpness", "overhead µs"]:
        table.add_column(col, justify="right")
    for op, op_rows in by_op.items():
        samples = [OperatorSample(op, r["flops"], r["bytes"], r["seconds"]) for r in op_rows]
        coeffs, err = fit_operator(samples, hw, ops[op])
        ops[op] = coeffs
        op_mape[op] = round(err, 5)
        band_cells = []
        for lo, hi in BANDS:
            sel = [(r, s) for r, s in zip(op_rows, samples) if lo <= r["tokens"] <= hi]
            pred = [coeffs.time(s.flops, s.bytes, hw.peak_flops, hw.mem_bw) for _, s in sel]
            e = mape(pred, [s.seconds for _, s in sel])
            detail[f"{op}.tokens_{lo}_{hi}"] = round(e, 5)
            band_cells.append(f"{e:.1%}")
        for model in sorted({r["model"] for r in op_rows}):
            sel = [s for r, s in zip(op_rows, samples) if r["model"] == model]
            pred = [coeffs.time(s.flops, s.bytes, hw.peak_flops, hw.mem_bw) for s in sel]
            detail[f"{op}.{model}"] = round(mape(pred, [s.seconds for s in sel]), 5)
        table.add_row(op, str(len(samples)), f"{err:.1%}", *band_cells,
                      f"{coeffs.compute_eff:.3f}", f"{coeffs.memory_eff:.3f}",
                      f"{coeffs.sharpness:.2f}", f"{coeffs.overhead_s * 1e6:.2f}")
    # Whole layer: the sum of every measured operator against the sum of their predictions.
    totals: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        c = ops[r["op"]]
        key = (r["model"], r["tokens"])
        totals[key][0] += c.time(r["flops"], r["bytes"], hw.peak_flops, hw.mem_bw)
        totals[key][1] += r["seconds"]
    layer_mape = mape([p for p, _ in totals.values()], [m for _, m in totals.values()])
    table.add_row("whole layer", str(len(totals)), f"{layer_mape:.1%}", "", "", "", "", "", "", "")
    # The LM head is a dense matmul like gate_up: it takes gate_up's fitted coefficients.
    ops["lm_head"] = ops["gate_up"]
    ops["final_norm"] = ops["input_norm"]
    Console().print(table)
    measured = sorted(by_op) + ["lm_head (from gate_up)", "final_norm (from input_norm)"]
    assumed = [op for op in OPERATORS if op not in by_op and op not in ("lm_head", "final_norm")]
    cal = CalibrationFile(
        schema="orthrus.calibration/1",
        hardware=hw.name,
        model="llama-family (fitted on Llama-2-7B and Llama-3-8B; shapes enter through FLOPs/bytes)",
        coefficients=coefficients_model(Coefficients(ops=ops)),
        source=SourceModel(
            description=(
                "Linear and element-wise operators fitted to per-layer A100 timings (median, "
                "tensor-parallel 1, 1-4,096 tokens) from the Vidur project's profiling data. "
                "Attention (prefill and decode), LoRA, sampler, pooler and the per-iteration and "
                "per-sequence overheads are NOT measured here: they are roofline values with "
                "A100 specs and assumed efficiencies (orthrus_sim/costmodel/coefficients.py) "
                "until a measured source exists."
            ),
            files=[f"calibration/data/a100-profiling/{f}" for f in FILES],
            license="MIT (microsoft/vidur, commit 7d47513); see calibration/data/a100-profiling/LICENSE",
            measured=measured,
            assumed=assumed,
        ),
        fit_error=FitErrorModel(operator_mape=op_mape, points=len(rows),
                                detail={"whole_layer_mape": round(layer_mape, 5), **detail}),
        created=datetime.date.today().isoformat(),
    )
    save_calibration(cal, out)
    Console().print(f"wrote {out}")
    return cal


if __name__ == "__main__":
    main()
