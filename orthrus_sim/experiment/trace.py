"""Request traces: the project's own rows and the common public formats, and a window of one.

A trace is a JSONL or CSV file. Its format is named or detected from the header (a JSONL file's
first object); each format says which column holds the arrival time (and its unit), the input
and output token counts, and, in the project's own format only, the kind:

=========== ======================================================= =============================
format      columns                                                 arrival time
=========== ======================================================= =============================
orthrus     ``arrival_time, kind, input_tokens, output_tokens``     seconds
splitwise   ``arrived_at, num_prefill_tokens, num_decode_tokens``   seconds (Vidur's Azure traces)
azure       ``TIMESTAMP, ContextTokens, GeneratedTokens``           ISO date-time
burstgpt    ``Timestamp, Model, Request tokens, Response tokens``   seconds
mooncake    ``timestamp, input_length, output_length``              milliseconds
=========== ======================================================= =============================

A kindless trace is one kind's stream (a pool's ``kind`` says which); times of every format but
the project's own count from its first request. Every row is checked when the scenario is
validated; an error names the file, the line and the column (JSONL syntax errors included).
An empty trace and a negative arrival time are refused. ``window`` cuts a stretch out of a
trace and scales its time to reach a mean rate.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

FIELDS = ("arrival_time", "kind", "input_tokens", "output_tokens")


@dataclass(frozen=True)
class TraceFormat:
    """Where a format keeps a request's arrival time, kind and token counts."""

    name: str
    time: str
    input: str
    output: str
    kind: str | None = None  # a kindless format is one kind's stream
    time_unit: str = "s"  # s | ms | iso
    relative: bool = True  # times count from the first request

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(c for c in (self.time, self.kind, self.input) if c)


FORMATS = {f.name: f for f in (
    TraceFormat("orthrus", "arrival_time", "input_tokens", "output_tokens", kind="kind",
                relative=False),
    TraceFormat("splitwise", "arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    TraceFormat("azure", "TIMESTAMP", "ContextTokens", "GeneratedTokens", time_unit="iso"),
    TraceFormat("burstgpt", "Timestamp", "Request tokens", "Response tokens"),
    TraceFormat("mooncake", "timestamp", "input_length", "output_length", time_unit="ms"),
)}
FORMAT_NAMES = ("auto", *FORMATS)


def detect_format(columns: list[str], path: Path) -> TraceFormat:
    """The format whose columns the header holds (the project's own first)."""
    for fmt in FORMATS.values():
        if all(c in columns for c in fmt.required):
            return fmt
    known = "; ".join(f"{f.name}: {', '.join(f.required)}" for f in FORMATS.values())
    raise ValueError(f"trace {path}: no known format has the columns {', '.join(columns)} "
                     f"(known: {known})")


_FRACTION = re.compile(r"(\.\d{6})\d+")  # Azure writes 7 fractional digits; Python reads 6


def _seconds(value: object, fmt: TraceFormat, where: str) -> float:
    if fmt.time_unit == "iso":
        try:
            t = datetime.fromisoformat(_FRACTION.sub(r"\1", str(value).strip()))
        except ValueError:
            raise ValueError(f"{where}: must be an ISO date-time, got {value!r}") from None
        # one without a zone is read as UTC, not as this machine's zone (a clock change inside
        # the trace would shift its gaps by an hour on some machines)
        return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: must be a number, got {value!r}") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"{where}: must be a finite number >= 0, got {value!r}")
    return t / 1000.0 if fmt.time_unit == "ms" else t


def _row(raw: object, fmt: TraceFormat, path: Path, line: int) -> dict:
    where = f"trace {path}, line {line}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object with {', '.join(fmt.required)}, got {raw!r}")
    for column in fmt.required:
        if raw.get(column) in (None, ""):
            raise ValueError(f"{where}, column {column}: missing")
    kind = None
    if fmt.kind:
        kind = str(raw[fmt.kind]).strip()
        if kind not in ("embedding", "generation"):
            raise ValueError(f"{where}, column {fmt.kind}: must be embedding or generation, "
                             f"got {kind!r}")
    arrival = _seconds(raw[fmt.time], fmt, f"{where}, column {fmt.time}")

    def count(column: str, minimum: int) -> int:
        value = raw.get(column)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}, column {column}: must be an integer, got {value!r}") from None
        if number != int(number) or number < minimum:
            raise ValueError(f"{where}, column {column}: must be an integer >= {minimum}, "
                             f"got {value!r}")
        return int(number)

    # A kindless trace's generations may hold 0 output tokens (BurstGPT's failed requests):
    # kept, and sent as one-token generations (``window``).
    out_min = 1 if kind == "generation" else 0
    out_tokens = 0 if kind == "embedding" else count(fmt.output, out_min)
    return {"arrival_time": arrival, "kind": kind, "input_tokens": count(fmt.input, 1),
            "output_tokens": out_tokens}


def _format_named(name: str, columns: list[str], path: Path) -> TraceFormat:
    if name == "auto":
        return detect_format(columns, path)
    if name not in FORMATS:
        raise ValueError(f"trace {path}: unknown format {name!r}; use one of {', '.join(FORMAT_NAMES)}")
    fmt = FORMATS[name]
    missing = [c for c in fmt.required if c not in columns]
    if missing:
        raise ValueError(f"trace {path}: format {name} needs the columns {', '.join(missing)}")
    return fmt


@functools.lru_cache(maxsize=8)
def _load(path: Path, mtime: float, name: str) -> tuple[str, tuple[dict, ...]]:
    if not path.is_file():
        raise ValueError(f"trace {path} does not exist")
    rows: list[dict] = []
    if path.suffix == ".jsonl":
        fmt = None
        for i, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"trace {path}, line {i}: not valid JSON ({exc.msg})") from None
            if fmt is None:
                fmt = _format_named(name, list(raw) if isinstance(raw, dict) else [], path)
            rows.append(_row(raw, fmt, path, i))
    elif path.suffix == ".csv":
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            fmt = _format_named(name, [c.strip() for c in reader.fieldnames or []], path)
            reader.fieldnames = [c.strip() for c in reader.fieldnames or []]
            for raw in reader:  # the file's line (blank lines skipped, quoted ones spanned)
                rows.append(_row(raw, fmt, path, reader.line_num))
    else:
        raise ValueError(f"trace {path}: use a .jsonl or .csv file")
    if not rows:
        raise ValueError(f"trace {path} holds no requests")
    rows.sort(key=lambda r: r["arrival_time"])
    if fmt.relative:
        first = rows[0]["arrival_time"]
        for r in rows:
            r["arrival_time"] -= first
    return fmt.name, tuple(rows)


def _cached(path: str | Path, fmt: str) -> tuple[str, tuple[dict, ...]]:
    p = Path(path).resolve()
    mtime = p.stat().st_mtime if p.exists() else 0.0
    return _load(p, mtime, fmt)


def load_trace(path: str | Path, fmt: str = "auto") -> list[dict]:
    """The trace's rows, sorted by arrival time (parsed once per file version); ``kind`` is
    None in a kindless format."""
    return [dict(r) for r in _cached(path, fmt)[1]]


def trace_format(path: str | Path, fmt: str = "auto") -> str:
    """The format of the trace (``fmt`` when named, else the one its header shows)."""
    return _cached(path, fmt)[0]


@dataclass(frozen=True)
class Window:
    """A stretch of a trace as replayed: its rows' times from the stretch's start, divided by
    ``speedup``, which brings the stretch's mean rate to the rate asked for."""

    rows: tuple[dict, ...]
    start_s: float
    length_s: float  # in the trace's own time
    speedup: float

    @property
    def rate(self) -> float:
        """Mean arrivals per second as replayed."""
        return len(self.rows) * self.speedup / self.length_s if self.length_s > 0 else 0.0


def window(path: str | Path, fmt: str = "auto", start_s: float = 0.0,
           length_s: float | None = None, rate: float | None = None,
           scale: float = 1.0, tokens_scale: float = 1.0) -> Window:
    """The requests of ``[start_s, start_s + length_s)`` (to the end by default), time scaled
    so that their mean rate is ``rate`` (the trace's own by default), times ``scale``; every
    row's input and output tokens times ``tokens_scale`` (rounded, at least 1)."""
    rows = _cached(path, fmt)[1]
    end = math.inf if length_s is None else start_s + length_s
    kept = [r for r in rows if start_s <= r["arrival_time"] < end]
    if not kept:
        raise ValueError(f"trace {path}: no request arrives in the window [{start_s:g}, "
                         f"{end:g}) s (the trace spans 0-{rows[-1]['arrival_time']:g} s)")
    length = length_s if length_s is not None else kept[-1]["arrival_time"] - start_s
    speedup = scale
    if rate is not None:
        if length <= 0:
            raise ValueError(f"trace {path}: the window holds one instant; give length_s to "
                             "scale it to a rate")
        speedup *= rate * length / len(kept)
    def tokens(n: int) -> int:
        return max(1, round(n * tokens_scale))

    out = tuple({**r, "arrival_time": (r["arrival_time"] - start_s) / speedup,
                 "input_tokens": tokens(r["input_tokens"]),
                 "output_tokens": tokens(r["output_tokens"]) if r["kind"] != "embedding" else 0}
                for r in kept)
    return Window(out, start_s, length, speedup)
