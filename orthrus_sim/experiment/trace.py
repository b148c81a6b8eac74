"""Request traces: JSONL or CSV rows ``arrival_time, kind, input_tokens, output_tokens``.

Every row is checked when the scenario is validated; an error names the file and the row
(JSONL syntax errors included). An empty trace and a negative arrival time are refused.
"""

from __future__ import annotations

import csv
import functools
import json
import math
from pathlib import Path

FIELDS = ("arrival_time", "kind", "input_tokens", "output_tokens")


def _row(raw: object, path: Path, line: int) -> dict:
    where = f"trace {path}, row {line}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with {', '.join(FIELDS)}, got {raw!r}")
    missing = [k for k in ("arrival_time", "kind", "input_tokens") if raw.get(k) in (None, "")]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    kind = str(raw["kind"]).strip()
    if kind not in ("embedding", "generation"):
        raise ValueError(f"{where}: kind must be embedding or generation, got {kind!r}")
    try:
        arrival = float(raw["arrival_time"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: arrival_time must be a number, got {raw['arrival_time']!r}") from None
    if not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"{where}: arrival_time must be a finite number >= 0, got {arrival}")

    def count(key: str, minimum: int) -> int:
        value = raw.get(key)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {key} must be an integer, got {value!r}") from None
        if number != int(number) or number < minimum:
            raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
        return int(number)

    out_tokens = count("output_tokens", 1) if kind == "generation" else 0
    return {"arrival_time": arrival, "kind": kind, "input_tokens": count("input_tokens", 1),
            "output_tokens": out_tokens}


@functools.lru_cache(maxsize=8)
def _load(path: Path, mtime: float) -> tuple[dict, ...]:
    if not path.is_file():
        raise ValueError(f"trace {path} does not exist")
    rows: list[dict] = []
    if path.suffix == ".jsonl":
        for i, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"trace {path}, row {i}: not valid JSON ({exc.msg})") from None
            rows.append(_row(raw, path, i))
    elif path.suffix == ".csv":
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [k for k in FIELDS[:3] if k not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"trace {path}: the CSV header lacks {', '.join(missing)}")
            for i, raw in enumerate(reader, start=2):
                rows.append(_row(raw, path, i))
    else:
        raise ValueError(f"trace {path}: use a .jsonl or .csv file")
    if not rows:
        raise ValueError(f"trace {path} holds no requests")
    return tuple(sorted(rows, key=lambda r: r["arrival_time"]))


def load_trace(path: str | Path) -> list[dict]:
    """The trace's rows, sorted by arrival time (parsed once per file version)."""
    p = Path(path).resolve()
    mtime = p.stat().st_mtime if p.exists() else 0.0
    return [dict(r) for r in _load(p, mtime)]
