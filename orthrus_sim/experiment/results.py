"""Results: the ``orthrus.results/1`` schema, its request metrics, warnings and tables.

One definition for simulated and measured runs alike (docs/results.md). The window is
``[warmup_s, end]``: throughput counts requests that *finished* in it; latency percentiles count
requests that *arrived* in it and finished by its end. Those still unfinished at the end are
counted in ``unfinished_in_window``; the ones among them already older than the reported p99
(``unfinished_past_p99``) would raise it, and make a warning when they are more than 1 %.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orthrus_sim.engine.request import Request, RequestKind, RequestState

SCHEMA = "orthrus.results/1"
PERCENTILES = {"p50": 50, "p95": 95, "p99": 99}
KINDS = ("embedding", "generation")
MIN_COMPLETIONS = 30  # fewer in the window: a warning (a p99 needs more)
MIN_LIFETIMES = 3.0  # a window shorter than this many mean latencies: a warning


def summary(values: Sequence[float]) -> dict[str, float | None]:
    if len(values) == 0:
        return {"mean": None, "p50": None, "p95": None, "p99": None, "count": 0}
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for name, q in PERCENTILES.items():
        out[name] = float(np.percentile(arr, q))
    out["count"] = int(arr.size)
    return out


def request_row(req: Request) -> dict:
    """One row of the per-request CSV."""
    return {
        "request_id": req.request_id, "kind": req.kind.value, "state": req.state.value,
        "arrival_s": req.arrival_time, "admitted_s": req.admitted_at,
        "first_chunk_s": req.first_chunk_at, "first_token_s": req.first_token_at,
        "finished_s": req.finished_at, "input_tokens": req.input_len,
        "output_tokens": req.num_generated, "preemptions": req.num_preemptions,
        "latency_s": (req.finished_at - req.arrival_time)
        if req.state is RequestState.FINISHED else None,
        "reject_reason": req.reject_reason,
    }


def request_metrics(issued: Iterable[Request], workflows: Sequence, start: float,
                    end: float) -> dict:
    """Throughput, latency, admission wait and counts over the window ``[start, end]``."""
    eps = 1e-9
    window = max(end - start, 1e-12)
    lat: dict[str, list[float]] = {"embedding": [], "generation": [], "ttft": [], "tpot": []}
    admission: dict[str, list[float]] = {k: [] for k in KINDS}
    completed = dict.fromkeys(KINDS, 0)
    unfinished = dict.fromkeys(KINDS, 0)
    rejected = dict.fromkeys(KINDS, 0)
    issued_n = dict.fromkeys(KINDS, 0)
    arrived = dict.fromkeys(KINDS, 0)
    censored = dict.fromkeys(KINDS, 0)
    ages: dict[str, list[float]] = {k: [] for k in KINDS}  # of requests unfinished at the end
    finished_state = RequestState.FINISHED
    for r in issued:
        kind = r.kind.value
        issued_n[kind] += 1
        in_window = start - eps <= r.arrival_time <= end + eps
        if r.state is RequestState.REJECTED:
            rejected[kind] += 1
            continue
        done = r.state is finished_state and r.finished_at <= end + eps
        if not done:
            unfinished[kind] += 1
        elif r.finished_at >= start - eps:
            completed[kind] += 1
        if not in_window:
            continue
        arrived[kind] += 1
        if not done:
            censored[kind] += 1
            ages[kind].append(end - r.arrival_time)
            continue
        lat[kind].append(r.finished_at - r.arrival_time)
        if r.admitted_at is not None:  # a live client does not see admission
            admission[kind].append(r.admitted_at - r.arrival_time)
        if r.kind is RequestKind.GENERATION and r.first_token_at is not None:
            lat["ttft"].append(r.first_token_at - r.arrival_time)
            if r.num_generated > 1:
                lat["tpot"].append((r.finished_at - r.first_token_at) / (r.num_generated - 1))
    throughput = {k: completed[k] / window for k in KINDS}
    throughput["combined"] = sum(completed.values()) / window
    latency = {k: summary(v) for k, v in lat.items()}
    past_p99 = {k: sum(1 for a in ages[k] if latency[k]["p99"] is None or a > latency[k]["p99"])
                for k in KINDS}
    counts = {"completed": completed, "unfinished": unfinished, "rejected": rejected,
              "issued": issued_n, "arrived_in_window": arrived, "unfinished_in_window": censored,
              "unfinished_past_p99": past_p99}
    if workflows:
        done_flows = [w for w in workflows if w.end is not None and w.end <= end + eps]
        throughput["workflow"] = sum(1 for w in done_flows if w.end >= start - eps) / window
        latency["workflow"] = summary([w.end - w.start for w in done_flows
                                       if w.start >= start - eps])
        completed["workflow"] = sum(1 for w in done_flows if w.end >= start - eps)
        unfinished["workflow"] = sum(1 for w in workflows
                                     if (w.end is None or w.end > end + eps) and not w.failed)
        rejected["workflow"] = sum(1 for w in workflows if w.failed)
    return {"throughput_rps": throughput, "latency_s": latency,
            "admission_wait_s": {k: summary(v) for k, v in admission.items()},
            **counts, "window_s": [start, end]}


def window_warnings(metrics: dict) -> list[str]:
    """What makes a run's figures untrustworthy: too few completions, a window shorter than a
    few request lifetimes, many requests still unfinished at the end, nothing completed."""
    out = []
    start, end = metrics["window_s"]
    length = end - start
    if not sum(v for k, v in metrics["completed"].items() if k in KINDS):
        out.append("no request completed in the measurement window")
    kinds = list(KINDS) + (["workflow"] if "workflow" in metrics["latency_s"] else [])
    for kind in kinds:
        lat = metrics["latency_s"][kind]
        arrived = metrics["arrived_in_window"].get(kind, lat["count"])
        if arrived == 0:
            continue
        if lat["count"] < MIN_COMPLETIONS:
            out.append(f"only {lat['count']} {kind} requests arrived in the window and finished: "
                       f"its percentiles rest on too few samples (want >= {MIN_COMPLETIONS})")
        if lat["mean"] and length < MIN_LIFETIMES * lat["mean"]:
            out.append(f"the window ({length:.0f} s) is shorter than {MIN_LIFETIMES:.0f} mean {kind} "
                       f"latencies ({lat['mean']:.1f} s each): lengthen duration_s")
        stuck = metrics["unfinished_past_p99"].get(kind, 0)
        if kind in KINDS and stuck > 0.01 * arrived:
            out.append(f"{stuck} of {arrived} {kind} requests that arrived in the window were still "
                       "unfinished at its end, already older than the reported p99: the latency "
                       "percentiles leave them out and are optimistic")
    return out


# ----- provenance ----------------------------------------------------------------------------
def provenance(scenario_doc: dict) -> dict:
    """Project version, git commit (when run from a checkout) and a hash of the scenario."""
    from orthrus_sim import __version__

    commit = None
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                    capture_output=True, text=True, timeout=5).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    text = json.dumps(scenario_doc, sort_keys=True)
    return {"version": __version__, "commit": commit,
            "scenario_sha256": hashlib.sha256(text.encode()).hexdigest()}


def results_doc(scenario_doc: dict, runs: list[dict]) -> dict:
    return {"schema": SCHEMA, **provenance(scenario_doc), "scenario": scenario_doc, "runs": runs}


def write_json(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def write_csv(path: Path, rows: Iterable[dict]) -> None:
    rows = iter(rows)
    first = next(rows, None)
    with path.open("w", newline="") as fh:
        if first is None:
            return
        writer = csv.DictWriter(fh, fieldnames=list(first))
        writer.writeheader()
        writer.writerow(first)
        writer.writerows(rows)


# ----- comparison tables -----------------------------------------------------------------------
def _get(metrics: dict, path: str) -> Any:
    node: Any = metrics
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


# (column, metrics path, format); throughput in requests/s, times in seconds
COLUMNS = [
    ("configuration", None, None),
    ("emb/s", "throughput_rps.embedding", ".2f"),
    ("gen/s", "throughput_rps.generation", ".2f"),
    ("total/s", "throughput_rps.combined", ".2f"),
    ("emb p50", "latency_s.embedding.p50", ".3f"),
    ("emb p99", "latency_s.embedding.p99", ".3f"),
    ("gen p99", "latency_s.generation.p99", ".2f"),
    ("TTFT p99", "latency_s.ttft.p99", ".3f"),
    ("adm e p99", "admission_wait_s.embedding.p99", ".3f"),
    ("adm g p99", "admission_wait_s.generation.p99", ".3f"),
    ("busy", "utilization.busy", ".0%"),
    ("MFU", "utilization.mfu", ".0%"),
    ("fill", "budget_fill", ".0%"),
    ("preempt", None, None),
    ("rejected", None, None),
    ("unfin.", None, None),
]


def comparison_rows(runs: list[dict]) -> list[dict[str, Any]]:
    """One flat row per run: the figures the comparison table shows (raw numbers)."""
    out = []
    for run in runs:
        m = run["metrics"]
        row: dict[str, Any] = {"configuration": run["configuration"]}
        for col, path, _ in COLUMNS[1:]:
            if path is not None:
                row[col] = _get(m, path)
        pre = m.get("preemptions")
        row["preempt"] = sum(pre.values()) if isinstance(pre, dict) else pre
        row["rejected"] = sum(v for k, v in m["rejected"].items() if k in KINDS)
        row["unfin."] = sum(v for k, v in m["unfinished"].items() if k in KINDS)
        out.append(row)
    return out


def _cell(value: Any, fmt: str | None) -> str:
    if value is None:
        return "-"
    if fmt is None:
        return str(value)
    return format(value, fmt)


def format_rows(rows: list[dict], fmt: str) -> str:
    """``csv`` or ``json`` text of comparison rows."""
    if fmt == "json":
        return json.dumps(rows, indent=2)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["configuration"])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def comparison_table(runs: list[dict], title: str):
    """A rich table of the runs (every column folds rather than being cut off)."""
    from rich.table import Table

    table = Table(title=title)
    for col, _, _ in COLUMNS:
        table.add_column(col, justify="right", overflow="fold")
    for row in comparison_rows(runs):
        table.add_row(*[_cell(row[col], fmt) for col, _, fmt in COLUMNS])
    table.caption = ("throughput in requests/s; latency and admission wait (adm) in seconds over "
                     "requests that arrived after the warm-up; busy and MFU over the window; "
                     "fill = mean token-budget use")
    return table


def print_runs(console, runs: list[dict], title: str, fmt: str = "table") -> None:
    """The comparison of ``runs`` as a table (never cut: columns fold), CSV or JSON, then each
    run's warnings."""
    if fmt == "table":
        console.print(comparison_table(runs, title))
    else:
        console.print(format_rows(comparison_rows(runs), fmt), markup=False, highlight=False,
                      soft_wrap=True)
    for run in runs:
        for w in run["metrics"].get("warnings", []):
            console.print(f"[yellow]warning:[/yellow] {run['configuration']}: {w}", markup=True,
                          highlight=False)
