"""Sweeps: every point of a parameter grid, one task per point, on local processes or Ray.

A point is the scenario with the grid's values set, all its configurations; its task returns
the same ``results.json`` document ``orthrus-sim run`` writes, stored under ``OUT/points/``
the moment it arrives. A sweep started again with the same ``--out`` skips the points stored
there, so an interrupted sweep resumes; a point that fails is reported with its error and the
others go on. ``sweep.json`` gathers every point at the end.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orthrus_sim.experiment.results import format_rows, results_doc, write_json
from orthrus_sim.experiment.scenario import Scenario, parse_scenario, scenario_dump, split_gpus
from orthrus_sim.questions.run import Task, in_processes, process_pool, run_task

BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class Point:
    """One grid point: its values, its scenario as plain data (validated, paths resolved, only
    the configurations it can hold) and the configurations skipped, with the reason."""

    name: str
    overrides: dict[str, str]
    scenario: dict
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class PointOutcome:
    point: Point
    doc: dict | None = None  # the point's results.json document
    error: str | None = None
    resumed: bool = False  # read back from an earlier run of the sweep


def parse_grid(grid: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for item in grid:
        if "=" not in item:
            raise ValueError(f"--grid {item!r}: expected key=v1,v2,...")
        key, _, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip() != ""]
        if not key.strip() or not vals:
            raise ValueError(f"--grid {item!r}: expected key=v1,v2,... with at least one value")
        out.append((key.strip(), vals))
    return out


def plan_sweep(raw: dict, overrides: list[str], grid: list[str], base_dir: Path | None = None,
               source: str = "scenario") -> tuple[Scenario, list[tuple[str, list[str]]], list[Point]]:
    """Every point of the grid, checked before anything runs: a bad key or value fails here
    with the scenario error that names it; only a configuration that a point cannot hold
    (dedicated-1:3 on 2 GPUs) is skipped, with its reason."""
    base = parse_scenario(raw, source, overrides, base_dir, check_fit=False)
    axes = parse_grid(grid)
    points = []
    for i, combo in enumerate(itertools.product(*[vals for _, vals in axes])):
        point_over = [f"{k}={v}" for (k, _), v in zip(axes, combo)]
        sc = parse_scenario(raw, f"{source} at grid point {', '.join(point_over)}", overrides,
                            base_dir, check_fit=False, grid=point_over)
        fits, skipped = [], {}
        for cfg in sc.configurations:
            try:
                split_gpus(cfg, sc.cluster.gpus)
                fits.append(cfg)
            except ValueError as exc:
                skipped[cfg] = str(exc)
        data = scenario_dump(sc) | {"configurations": fits}
        points.append(Point(f"point-{i:04d}", dict(zip((k for k, _ in axes), combo)), data, skipped))
    return base, axes, points


def run_point(point: Point) -> dict:
    """Simulate every configuration of a point, in order: its results.json document."""
    runs = [{"configuration": cfg, "metrics": run_task(Task(point.scenario, cfg, point.name)).metrics}
            for cfg in point.scenario["configurations"]]
    return {**results_doc(point.scenario, runs), "overrides": point.overrides,
            "skipped": point.skipped}


def _error_text(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a Ray task error carries the task's own exception
    exc = cause if isinstance(cause, BaseException) else exc
    return f"{type(exc).__name__}: {exc}"


# ----- backends: each yields outcomes as points finish -----------------------------------------
def run_local(points: list[Point], max_parallel: int) -> Iterator[PointOutcome]:
    """Worker processes (or this one, for a bound of 1), at most ``max_parallel`` at a time."""
    if max_parallel == 1:
        for p in points:
            try:
                yield PointOutcome(p, doc=run_point(p))
            except Exception as exc:  # a point's failure is reported; the others go on
                yield PointOutcome(p, error=_error_text(exc))
        return
    yield from _outcomes(in_processes(run_point, points, max_parallel))


def _outcomes(finished) -> Iterator[PointOutcome]:
    for p, future in finished:
        exc = future.exception()
        yield PointOutcome(p, error=_error_text(exc)) if exc else PointOutcome(p, doc=future.result())


@contextmanager
def _ray_session(address: str, max_parallel: int | None):
    """Ray, initialised for the block: ``address`` "auto" joins a running cluster, "local"
    starts one here; a session already up is used as it is (and left up)."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'orthrus[ray]'") from None
    started = not ray.is_initialized()
    if started:
        kwargs = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if address == "local":
            ray.init(num_cpus=max_parallel or os.cpu_count(), **kwargs)
        else:
            try:
                ray.init(address="auto", **kwargs)
            except ConnectionError as exc:
                raise ValueError(f"--ray auto: no running Ray cluster to join ({exc}); start one "
                                 "with `ray start --head`, or use --ray local") from None
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def run_ray(points: list[Point], max_parallel: int | None, address: str) -> Iterator[PointOutcome]:
    """One Ray task per point, at most ``max_parallel`` in flight (None: as many as the
    cluster has CPUs). ``address`` "auto" joins a running cluster, "local" starts one here."""
    with _ray_session(address, max_parallel) as ray:
        bound = max_parallel or max(1, int(ray.cluster_resources().get("CPU", 1)))
        task = ray.remote(num_cpus=1, max_retries=0)(run_point)
        queued = iter(points)
        in_flight: dict = {}
        try:
            while True:
                while len(in_flight) < bound and (p := next(queued, None)) is not None:
                    in_flight[task.remote(p)] = p
                if not in_flight:
                    return
                done, _ = ray.wait(list(in_flight), num_returns=1)
                for ref in done:
                    p = in_flight.pop(ref)
                    try:
                        yield PointOutcome(p, doc=ray.get(ref))
                    except Exception as exc:
                        yield PointOutcome(p, error=_error_text(exc))
        finally:
            for ref in in_flight:
                ray.cancel(ref, force=True)


@contextmanager
def point_runner(max_parallel: int | None = None, ray: str | None = None):
    """A function ``points -> outcomes as they finish`` on one pool of local processes, or one
    Ray session (``ray``: "auto" or "local"), kept for the whole block: a search that runs
    points in rounds (``orthrus_sim.questions.capacity``) starts its workers once."""
    if ray is not None:
        with _ray_session(ray, max_parallel):
            yield lambda points: run_ray(points, max_parallel, ray)
        return
    workers = max(1, max_parallel or os.cpu_count() or 1)
    if workers == 1:
        yield lambda points: run_local(points, 1)
        return
    with process_pool(workers) as pool:
        yield lambda points: _outcomes(in_processes(run_point, points, workers, pool=pool))


# ----- the sweep ------------------------------------------------------------------------------
def _stored(path: Path, point: Point) -> dict | None:
    """The results of ``point`` from an earlier run of this sweep, if there are any; an error
    if the directory holds a different sweep's point."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # written half when the sweep stopped: run it again
    planned = json.loads(json.dumps(point.scenario))  # as stored
    if doc.get("overrides") != point.overrides or doc.get("scenario") != planned:
        raise ValueError(f"{path} holds results of a different sweep (point values "
                         f"{doc.get('overrides')}, not {point.overrides}, or another scenario): "
                         "use another --out")
    return doc


def run_sweep(raw: dict, overrides: list[str], grid: list[str], out: Path,
              max_parallel: int | None = None, console: Console | None = None,
              base_dir: Path | None = None, source: str = "scenario", fmt: str = "table",
              ray: str | None = None) -> dict:
    """Run (or resume) a sweep and write ``sweep.json``; ``ray``: None (local processes),
    "auto" or "local"."""
    console = console or Console()
    notes = console if fmt == "table" else Console(stderr=True)  # csv/json: stdout is only that
    base, axes, points = plan_sweep(raw, overrides, grid, base_dir, source)
    if not any(p.scenario["configurations"] for p in points):
        raise ValueError("every point of the grid was skipped: nothing to run")
    for p in points:
        for cfg, reason in p.skipped.items():
            notes.print(f"skipped {cfg} at {p.overrides}: {reason}", highlight=False)
    point_dir = out / "points"
    outcomes: dict[str, PointOutcome] = {}
    for p in points:
        doc = _stored(point_dir / p.name / "results.json", p)
        if doc is not None:
            outcomes[p.name] = PointOutcome(p, doc=doc, resumed=True)
    todo = [p for p in points if p.name not in outcomes]
    if outcomes:
        notes.print(f"{len(outcomes)} of {len(points)} points already in {point_dir}: skipped",
                      highlight=False)
    if todo:
        if ray is not None:
            finished = run_ray(todo, max_parallel, ray)
        else:
            finished = run_local(todo, max(1, min(max_parallel or os.cpu_count() or 1, len(todo))))
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("points"), TimeElapsedColumn())
        with Progress(*columns, console=notes) as bar:
            task = bar.add_task(f"sweep on {'Ray' if ray else 'local processes'}", total=len(todo))
            for outcome in finished:
                p = outcome.point
                if outcome.error is not None:
                    notes.print(f"[red]point {p.name} {p.overrides} failed:[/] {outcome.error}",
                                  highlight=False)
                    write_json({"overrides": p.overrides, "error": outcome.error},
                               point_dir / p.name / "error.json")
                else:
                    write_json(outcome.doc, point_dir / p.name / "results.json")
                    (point_dir / p.name / "error.json").unlink(missing_ok=True)
                outcomes[p.name] = outcome
                bar.advance(task)
    doc = sweep_doc(base, axes, [outcomes[p.name] for p in points])
    write_json(doc, out / "sweep.json")
    sweep_summary(console, base.name, doc["points"], fmt)
    if any(p["runs"] for p in doc["points"]):
        from orthrus_sim.questions import plots

        keys = [k for k, _ in axes]
        plots.sweep_plot([p for p in doc["points"] if p["runs"]], keys, out / "sweep.png",
                         f"{base.name}: sweep over {' x '.join(keys)}")
    notes.print(f"results: {out / 'sweep.json'}", highlight=False)
    failed = doc["failed"]
    if failed:
        notes.print(f"[red]{len(failed)} of {len(points)} points failed[/] (listed in sweep.json; "
                      "run the same command again to retry them)", highlight=False)
    return doc


def sweep_doc(base: Scenario, axes: list[tuple[str, list[str]]],
              outcomes: list[PointOutcome]) -> dict:
    points, failed = [], []
    for o in outcomes:
        entry = {"name": o.point.name, "overrides": o.point.overrides,
                 "runs": o.doc["runs"] if o.doc else [], "skipped": o.point.skipped}
        if o.error is not None:
            entry["error"] = o.error
            failed.append({"name": o.point.name, "overrides": o.point.overrides, "error": o.error})
        points.append(entry)
    doc = {**results_doc(scenario_dump(base), []), "grid": dict(axes), "points": points,
           "failed": failed}
    doc.pop("runs")
    return doc


def sweep_summary(console: Console, name: str, points: list[dict], fmt: str) -> None:
    """Combined throughput per point and configuration."""
    configs = list(dict.fromkeys(run["configuration"] for p in points for run in p["runs"]))
    rows = []
    for p in points:
        row = {"point": ", ".join(f"{k}={v}" for k, v in p["overrides"].items())}
        cells = {run["configuration"]: run["metrics"]["throughput_rps"]["combined"] for run in p["runs"]}
        row.update({c: cells.get(c) for c in configs})
        if any("error" in q for q in points):
            row["error"] = p.get("error", "")
        rows.append(row)
    if fmt != "table":
        console.print(format_rows(rows, fmt), markup=False, highlight=False, soft_wrap=True)
        return
    from rich.table import Table

    table = Table(title=f"{name}: sweep (combined requests/s)")
    table.add_column("point", overflow="fold")
    for cfg in configs:
        table.add_column(cfg, justify="right", overflow="fold")
    for row in rows:
        cells = ["failed" if "error" in row else "-" if row[c] is None else f"{row[c]:.2f}"
                 for c in configs]
        table.add_row(row["point"], *cells)
    console.print(table)
