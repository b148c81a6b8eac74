"""Measured iterations against the cost model's prediction for the same batches.

A throughput miss of the simulator comes either from the schedule (the simulated policy chose
other batches than the engine did) or from the cost of the batches (the same batch, another
time). Setting each iteration a server recorded (``GET /iterations``: its time and its
``BatchShape``) beside what a calibration predicts for that shape separates the two, per kind
of batch.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from orthrus_sim.costmodel.shape import BatchShape


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


def load_iterations(path: Path, label: str | None = None) -> list[dict]:
    """The JSON-lines iteration record of one server; each row's ``shape`` a ``BatchShape``
    and its ``log`` the server's label (default: the file's folder). A bad row names the
    file and line."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            row["shape"] = BatchShape(**row["shape"])
            float(row["seconds"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}, line {i}: not an iteration row ({exc})") from None
        row["log"] = label or Path(path).parent.name
        rows.append(row)
    return rows


def iteration_residuals(rows: list[dict], cost) -> list[dict]:
    """Per (log, batch kind) and per log (``all``): iterations, measured and predicted seconds
    (sums and means), the ratio of the sums and the median per-iteration ratio. ``cost``: a
    cost model (``shape_time``), with the calibration's fitted factors applied."""
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for row in rows:
        pair = (row["seconds"], cost.shape_time(row["shape"]))
        for kind in (batch_kind(row["shape"]), "all"):
            groups.setdefault((row["log"], kind), []).append(pair)
    out = []
    for (log, kind), pairs in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] != "all", g[0][1])):
        measured = sum(m for m, _ in pairs)
        predicted = sum(p for _, p in pairs)
        ratios = [p / m for m, p in pairs if m > 0]
        out.append({"log": log, "batch": kind, "iterations": len(pairs),
                    "measured_s": measured, "predicted_s": predicted,
                    "measured_mean_s": measured / len(pairs),
                    "predicted_mean_s": predicted / len(pairs),
                    "ratio": predicted / measured if measured else None,
                    "median_ratio": statistics.median(ratios) if ratios else None})
    return out
