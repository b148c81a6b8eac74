"""Fit a GPU's calibration from measured operator timings in calibration/data/<gpu>-profiling.

Each fitted GPU is fitted on its Llama-2-7B file only (tensor-parallel 1, 1-4,096 tokens): other
models' files of the same source are kept for an independent check of how the fit carries to
other shapes (the A100's Llama-3-8B file is that check here). Cards with no profile of their
own but the same die as a fitted one are *derived*: the fitted card's efficiencies with their
own spec sheet (memory bandwidth and size), marked "derived, not fitted" in the file.

Run: python calibration/fit_gpu.py [GPU ...]   (default: every one; writes calibration/<gpu>.json
for each fitted GPU and each card derived from it, and prints each fit's error)
"""

from __future__ import annotations

import argparse
import datetime
from collections import defaultdict
from dataclasses import dataclass
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
from orthrus_sim.costmodel.coefficients import Coefficients, OpCoeffs, default_ops
from orthrus_sim.costmodel.hardware import Hardware, get_hardware
from orthrus_sim.costmodel.operators import ELEMENTWISE_OPS, OPERATORS
from orthrus_sim.costmodel.profiling_csv import load_operator_rows

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 4096
# the decode regime, where co-serving is decided, and the prompt and embedding chunks'
BANDS = [(1, 256), (257, 4096)]
SOURCE = "microsoft/vidur, commit 7d47513"


@dataclass(frozen=True)
class Profile:
    """Where a GPU's timings are: its profiling folder, the file it is fitted on, and the
    files kept out of the fit to check it."""

    folder: str
    fitted: str
    held_out: tuple[str, ...] = ()
    card: str = ""  # which card the timings were measured on, and how we know


PROFILES = {
    # Vidur's A100 compute profiles come from 80 GB cards (its docs/profiling.md: an A100 DGX
    # with 8 80GB A100s, or Azure's NC96ads_A100_v4 with 80GB A100s; its device config: 80 GB):
    # fitted against the 40 GB card's 1,555 GB/s, the 180 MB gate/up projection at one token
    # streams at ~1.62 TB/s (memory efficiency 1.04), above what that card can; against the
    # 80 GB card's 2,039 GB/s it is 0.80, as on the other GPUs
    "a100-80gb": Profile("a100-profiling", "llama-2-7b_a100_linear_ops.csv",
                         ("llama-3-8b_a100_linear_ops.csv",),
                         "A100 80GB (Vidur profiles its A100s on 80 GB cards; the data's one-token "
                         "projections stream faster than the 40 GB card's 1,555 GB/s)"),
    "h100-sxm": Profile("h100-profiling", "llama-2-7b_h100_linear_ops.csv",
                        card="H100 SXM (80 GB HBM3)"),
    "a40": Profile("a40-profiling", "llama-2-7b_a40_linear_ops.csv", card="A40 (48 GB GDDR6)"),
}
# card -> the fitted card of the same die whose efficiencies it takes with its own specs
DERIVED = {"a100-40gb": "a100-80gb", "h200": "h100-sxm"}


def rows_of(path: Path) -> list[dict]:
    return [r for r in load_operator_rows(path) if r["tokens"] <= MAX_TOKENS]


def predict(c: OpCoeffs, r: dict, hw: Hardware) -> float:
    return c.time(r["flops"], r["bytes"], hw.peak_flops, hw.mem_bw, hw.cache_bytes)


def layer_mape(rows: list[dict], ops: dict[str, OpCoeffs], hw: Hardware, lo: int = 1,
               hi: int = MAX_TOKENS) -> float:
    """MAPE of a layer's linear and element-wise time (the sum of every measured operator) per
    token count in ``lo..hi``."""
    totals: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        if lo <= r["tokens"] <= hi:
            key = (r["model"], r["tokens"])
            totals[key][0] += predict(ops[r["op"]], r, hw)
            totals[key][1] += r["seconds"]
    return mape([p for p, _ in totals.values()], [m for _, m in totals.values()])


def op_mape(rows: list[dict], c: OpCoeffs, hw: Hardware, lo: int = 1, hi: int = MAX_TOKENS) -> float:
    sel = [r for r in rows if lo <= r["tokens"] <= hi]
    return mape([predict(c, r, hw) for r in sel], [r["seconds"] for r in sel])


def fit_gpu(name: str, console: Console) -> CalibrationFile:
    """Fit ``name``'s measured operators; print the table; return the calibration."""
    profile, hw = PROFILES[name], get_hardware(name)
    data = HERE / "data" / profile.folder
    rows = rows_of(data / profile.fitted)
    by_op: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_op[r["op"]].append(r)
    ops, assumed = default_ops(), default_ops()
    errors, detail = {}, {}
    table = Table(title=f"{name}: operator fit (TP 1, 1-4,096 tokens, {profile.fitted})")
    for col in ["operator", "points", "MAPE", *[f"MAPE {a}-{b} tok" for a, b in BANDS],
                "compute_eff", "memory_eff", "sharpness", "overhead µs", "floor µs", "cache gain"]:
        table.add_column(col, justify="right")
    for op, op_rows in by_op.items():
        samples = [OperatorSample(op, r["flops"], r["bytes"], r["seconds"]) for r in op_rows]
        coeffs, err = fit_operator(samples, hw, ops[op], op in ELEMENTWISE_OPS)
        ops[op] = coeffs
        errors[op] = round(err, 5)
        bands = []
        for lo, hi in BANDS:
            e = op_mape(op_rows, coeffs, hw, lo, hi)
            detail[f"{op}.tokens_{lo}_{hi}"] = round(e, 5)
            bands.append(f"{e:.1%}")
        table.add_row(op, str(len(samples)), f"{err:.1%}", *bands, f"{coeffs.compute_eff:.3f}",
                      f"{coeffs.memory_eff:.3f}", f"{coeffs.sharpness:.2f}",
                      f"{coeffs.overhead_s * 1e6:.2f}", f"{coeffs.floor_s * 1e6:.2f}",
                      f"{coeffs.cache_gain:.2f}")
    # the whole layer, fitted and with the roofline's assumed efficiencies (what a scenario on
    # this GPU got before it had a calibration), over all tokens and per band
    for label, coeffs in (("whole layer", ops), ("whole layer, assumed efficiencies", assumed)):
        cells = [f"{layer_mape(rows, coeffs, hw, lo, hi):.1%}" for lo, hi in BANDS]
        whole = layer_mape(rows, coeffs, hw)
        key = "whole_layer" if coeffs is ops else "assumed_whole_layer"
        detail[f"{key}_mape"] = round(whole, 5)
        for lo, hi in BANDS:
            detail[f"{key}.tokens_{lo}_{hi}"] = round(layer_mape(rows, coeffs, hw, lo, hi), 5)
        table.add_row(label, str(len(rows) // len(by_op)), f"{whole:.1%}", *cells, *[""] * 6)
    console.print(table)
    for held in profile.held_out:  # the independent check: another model's shapes, not fitted on
        other = rows_of(data / held)
        per_op = {op: op_mape([r for r in other if r["op"] == op], ops[op], hw) for op in by_op}
        whole = layer_mape(other, ops, hw)
        model = held.split("_")[0]
        for op, e in per_op.items():
            detail[f"held_out.{model}.{op}"] = round(e, 5)
        detail[f"held_out.{model}.whole_layer_mape"] = round(whole, 5)
        console.print(f"held out, {held}: whole layer {whole:.1%}; per operator "
                      + ", ".join(f"{op} {e:.1%}" for op, e in per_op.items()))
    # the LM head is a dense matmul like gate_up; the final norm is the input norm's kernel
    ops["lm_head"] = ops["gate_up"]
    ops["final_norm"] = ops["input_norm"]
    measured = sorted(by_op) + ["lm_head (from gate_up)", "final_norm (from input_norm)"]
    return CalibrationFile(
        schema="orthrus.calibration/1",
        hardware=name,
        model="llama-family (fitted on Llama-2-7B; shapes enter through FLOPs/bytes)",
        coefficients=coefficients_model(Coefficients(ops=ops)),
        source=SourceModel(
            description=(
                f"Linear and element-wise operators fitted to per-layer timings measured on "
                f"{profile.card} (median, tensor-parallel 1, 1-4,096 tokens, Llama-2-7B) from "
                "the Vidur project's profiling data. Attention (prefill and decode), LoRA, "
                "sampler, pooler and the per-iteration and per-sequence overheads are NOT "
                f"measured here: they are roofline values with {name} specs and assumed "
                "efficiencies (orthrus_sim/costmodel/coefficients.py) until a measured source "
                "exists."),
            files=[f"calibration/data/{profile.folder}/{profile.fitted}"],
            license=f"MIT ({SOURCE}); see calibration/data/{profile.folder}/LICENSE",
            measured=measured,
            assumed=[op for op in OPERATORS if op not in by_op and op not in ("lm_head", "final_norm")],
        ),
        fit_error=FitErrorModel(operator_mape=errors, points=len(rows), detail=detail),
        created=datetime.date.today().isoformat(),
    )


def derive(card: str, fitted: CalibrationFile) -> CalibrationFile:
    """``card``'s calibration from a fitted one of the same die: its efficiencies, applied by the
    simulator to ``card``'s own peak, bandwidth and cache (not fitted: the error it carries is
    the fitted card's)."""
    source = fitted.source
    return fitted.model_copy(update={
        "hardware": card,
        "source": source.model_copy(update={
            "description": (f"Derived, not fitted: the {fitted.hardware} fit's efficiencies "
                            f"(same die), applied to {card}'s own spec sheet "
                            f"({get_hardware(card).source}). {source.description}"),
            "derived_from": fitted.hardware}),
    })


def main(argv: list[str] | None = None) -> list[CalibrationFile]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gpus", nargs="*", metavar="GPU",
                        help=f"fitted GPUs to fit (default: all of {', '.join(PROFILES)})")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the JSON files")
    args = parser.parse_args(argv)
    unknown = [g for g in args.gpus if g not in PROFILES]
    if unknown:
        parser.error(f"no profile for {', '.join(unknown)}; fitted GPUs: {', '.join(PROFILES)} "
                     f"(derived from them: {', '.join(DERIVED)})")
    console = Console()
    out = []
    for name in args.gpus or list(PROFILES):
        cal = fit_gpu(name, console)
        made = [cal] + [derive(card, cal) for card, base in DERIVED.items() if base == name]
        for c in made:
            path = args.out / f"{c.hardware}.json"
            save_calibration(c, path)
            console.print(f"wrote {path}" + (" (derived, not fitted)" if c.source.derived_from else ""))
        out += made
    return out


if __name__ == "__main__":
    main()
