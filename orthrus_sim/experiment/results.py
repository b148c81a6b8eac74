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
from orthrus_sim.experiment.quantiles import Quantiles
from orthrus_sim.experiment.slo import SloTally, request_tpot, slo_warnings

SCHEMA = "orthrus.results/1"
PERCENTILES = {"p50": 50, "p95": 95, "p99": 99}
KINDS = ("embedding", "generation")
MIN_COMPLETIONS = 30  # fewer in the window: a warning (a p99 needs more)
MIN_LIFETIMES = 3.0  # a window shorter than this many mean latencies: a warning
EPS = 1e-9


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


class RequestLog:
    """Requests accounted for as they end, over the window ``[start, end]``.

    The simulator's driver and the live bench both call ``sent`` when a request leaves and
    ``ended`` when it finished or was rejected; ``close(end, ...)`` counts what is still in
    flight and returns the metrics. So a run holds only the requests in flight: per-request rows
    go to ``rows`` (a CSV writer, say) as requests end, and percentiles come from ``Quantiles``
    (exact up to 100,000 values, then within 0.5 %). ``sample`` keeps that many rows (a uniform
    reservoir) for the plots. ``end_hint``: the window's end when it is known in advance (a run
    by duration): a request that ends after it counts as unfinished. ``slo``: the scenario's
    SLOs, tallied into attainment and goodput (``orthrus_sim.experiment.slo``).
    """

    def __init__(self, start: float, rows=None, sample: int | None = None, end_hint: float | None = None,
                 seed: int = 0, slo=None) -> None:
        self.start = start
        self.end_hint = end_hint
        self._rows = rows
        self._sample_cap = sample
        self.sample: list[dict] = []
        self._rng = np.random.default_rng(seed)
        self._row_count = 0
        self.issued = dict.fromkeys(KINDS, 0)
        self.completed = dict.fromkeys(KINDS, 0)
        self.rejected = dict.fromkeys(KINDS, 0)
        self.arrived = dict.fromkeys(KINDS, 0)
        self.latency = {k: Quantiles() for k in ("embedding", "generation", "ttft", "tpot")}
        self.admission = {k: Quantiles() for k in KINDS}
        self.outstanding: dict[str, Request] = {}
        self._phase_of: dict[str, int] = {}
        self.phases: dict[int, dict] = {}
        self.last_finish = 0.0
        self.slo = SloTally(slo, start, end_hint) if slo is not None else None

    def sent(self, req: Request, phase: int | None = None) -> None:
        kind = req.kind.value
        self.issued[kind] += 1
        if req.arrival_time >= self.start - EPS:
            self.arrived[kind] += 1
        self.outstanding[req.request_id] = req
        if phase is not None:
            self._phase_of[req.request_id] = phase
            ph = self.phases.setdefault(phase, {"issued": 0, "completed": 0, "start_s": None,
                                                "last_finish_s": None})
            ph["issued"] += 1
            if ph["start_s"] is None or req.arrival_time < ph["start_s"]:
                ph["start_s"] = req.arrival_time

    def ended(self, req: Request) -> None:
        """``req`` finished or was rejected."""
        if self.end_hint is not None and req.finished_at is not None \
                and req.finished_at > self.end_hint + EPS:
            return  # after the window: it stays outstanding, counted unfinished at the close
        self.outstanding.pop(req.request_id, None)
        kind = req.kind.value
        phase = self._phase_of.pop(req.request_id, None)
        if self.slo is not None:
            self.slo.ended(req)
        if req.state is RequestState.REJECTED:
            self.rejected[kind] += 1
        elif req.state is RequestState.FINISHED:
            self.last_finish = max(self.last_finish, req.finished_at)
            if phase is not None:
                ph = self.phases[phase]
                ph["completed"] += 1
                if ph["last_finish_s"] is None or req.finished_at > ph["last_finish_s"]:
                    ph["last_finish_s"] = req.finished_at
            if req.finished_at >= self.start - EPS:
                self.completed[kind] += 1
            if req.arrival_time >= self.start - EPS:
                self.latency[kind].add(req.finished_at - req.arrival_time)
                if req.admitted_at is not None:  # a live client does not see admission
                    self.admission[kind].add(req.admitted_at - req.arrival_time)
                if req.kind is RequestKind.GENERATION and req.first_token_at is not None:
                    self.latency["ttft"].add(req.first_token_at - req.arrival_time)
                    tpot = request_tpot(req)
                    if tpot is not None:
                        self.latency["tpot"].add(tpot)
        self._row(req, phase)

    def _row(self, req: Request, phase: int | None) -> None:
        slot = self._sample_slot()
        if self._rows is None and slot is None:
            return  # nobody reads this row: not even built
        row = request_row(req)
        if self.phases:
            row["phase"] = phase
        if self._rows is not None:
            self._rows(row)
        if slot == len(self.sample):
            self.sample.append(row)
        elif slot is not None:
            self.sample[slot] = row

    def _sample_slot(self) -> int | None:
        """Where the next row goes in ``sample`` (a uniform reservoir: every row kept with the
        same probability), or None when it is not kept."""
        cap = self._sample_cap
        if cap is None:
            return len(self.sample)
        if cap == 0:
            return None
        self._row_count += 1
        if len(self.sample) < cap:
            return len(self.sample)
        j = int(self._rng.integers(self._row_count))
        return j if j < cap else None

    def close(self, end: float, workflows: Sequence = ()) -> dict:
        """The metrics over ``[start, end]``; what is still in flight counts as unfinished
        (and gets its row)."""
        start = min(self.start, end)
        window = max(end - start, 1e-12)
        latency = {k: q.summary() for k, q in self.latency.items()}
        unfinished = dict.fromkeys(KINDS, 0)
        censored = dict.fromkeys(KINDS, 0)
        past_p99 = dict.fromkeys(KINDS, 0)
        for req in list(self.outstanding.values()):
            kind = req.kind.value
            unfinished[kind] += 1
            if req.arrival_time >= start - EPS:
                censored[kind] += 1
                p99 = latency[kind]["p99"]
                if p99 is None or end - req.arrival_time > p99:
                    past_p99[kind] += 1
            self._row(req, self._phase_of.get(req.request_id))
        completed = dict(self.completed)
        throughput = {k: completed[k] / window for k in KINDS}
        throughput["combined"] = sum(completed.values()) / window
        rejected = dict(self.rejected)
        if workflows:
            done_flows = [w for w in workflows if w.end is not None and w.end <= end + EPS]
            completed["workflow"] = sum(1 for w in done_flows if w.end >= start - EPS)
            throughput["workflow"] = completed["workflow"] / window
            latency["workflow"] = summary([w.end - w.start for w in done_flows
                                           if w.start >= start - EPS])
            unfinished["workflow"] = sum(1 for w in workflows
                                         if (w.end is None or w.end > end + EPS) and not w.failed)
            rejected["workflow"] = sum(1 for w in workflows if w.failed)
        return {"throughput_rps": throughput, "latency_s": latency,
                "admission_wait_s": {k: q.summary() for k, q in self.admission.items()},
                "completed": completed, "unfinished": unfinished, "rejected": rejected,
                "issued": dict(self.issued), "arrived_in_window": dict(self.arrived),
                "unfinished_in_window": censored, "unfinished_past_p99": past_p99,
                "slo": self.slo.close(list(self.outstanding.values()), end, window)
                if self.slo is not None else None,
                "window_s": [start, end]}

    def phase_metrics(self, phases: Sequence) -> list[dict]:
        """Per phase of the workload: its mix, what was issued and finished, and when its last
        request finished (completion time: last finish - first arrival, once all finished)."""
        out = []
        for i, phase in enumerate(phases):
            ph = self.phases.get(i, {"issued": 0, "completed": 0, "start_s": None,
                                     "last_finish_s": None})
            all_done = ph["issued"] > 0 and ph["completed"] == ph["issued"]
            out.append({"phase": i, "generation_share": phase.generation_share,
                        "issued": ph["issued"], "completed": ph["completed"],
                        "start_s": ph["start_s"],
                        "last_finish_s": ph["last_finish_s"] if all_done else None,
                        "completion_s": (ph["last_finish_s"] - ph["start_s"]) if all_done else None})
        return out


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
    return out + slo_warnings(metrics)


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


class CsvRows:
    """A callable that appends dict rows to a CSV file (header from the first row)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("w", newline="")
        self._writer: csv.DictWriter | None = None

    def __call__(self, row: dict) -> None:
        if self._writer is None:
            self._writer = csv.DictWriter(self._fh, fieldnames=list(row))
            self._writer.writeheader()
        self._writer.writerow(row)

    def close(self) -> None:
        self._fh.close()


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
# shown when the scenario gives SLOs: goodput (requests/s meeting them) and attainment per kind
SLO_COLUMNS = [
    ("goodput/s", "slo.combined.goodput_rps", ".2f"),
    ("SLO emb", "slo.embedding.attainment", ".1%"),
    ("SLO gen", "slo.generation.attainment", ".1%"),
]


def _columns(runs: list[dict]) -> list:
    return COLUMNS + (SLO_COLUMNS if any(r["metrics"].get("slo") for r in runs) else [])


def comparison_rows(runs: list[dict]) -> list[dict[str, Any]]:
    """One flat row per run: the figures the comparison table shows (raw numbers)."""
    out = []
    for run in runs:
        m = run["metrics"]
        row: dict[str, Any] = {"configuration": run["configuration"]}
        for col, path, _ in _columns(runs)[1:]:
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

    columns = _columns(runs)
    table = Table(title=title)
    for col, _, _ in columns:
        table.add_column(col, justify="right", overflow="fold")
    for row in comparison_rows(runs):
        table.add_row(*[_cell(row[col], fmt) for col, _, fmt in columns])
    table.caption = ("throughput in requests/s; latency and admission wait (adm) in seconds over "
                     "requests that arrived after the warm-up; busy and MFU over the window; "
                     "fill = mean token-budget use")
    if columns is not COLUMNS:
        table.caption += "; goodput: requests/s meeting the SLOs; SLO: attainment per kind"
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
