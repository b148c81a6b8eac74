"""Run a scenario's configurations (in parallel processes) and write the results set."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from orthrus_sim.experiment.results import (
    format_rows,
    print_runs,
    results_doc,
    write_csv,
    write_json,
)
from orthrus_sim.experiment.scenario import Scenario, parse_scenario, scenario_dump, split_gpus
from orthrus_sim.sim.run import RunResult, simulate


@dataclass(frozen=True)
class Task:
    """One simulation: a scenario as plain data (validated, paths resolved) and a configuration;
    ``requests_csv``: where its per-request rows stream (None: no rows are kept)."""

    scenario: dict
    configuration: str
    label: str
    requests_csv: str | None = None


def run_task(task: Task, progress=None) -> RunResult:
    scenario = parse_scenario(task.scenario, task.label)
    csv_path = Path(task.requests_csv) if task.requests_csv else None
    return simulate(scenario, task.configuration, progress=progress, requests_csv=csv_path,
                    keep_rows=False)


def _run_in_worker(args) -> RunResult:
    task, progress_q = args

    def progress(frac: float) -> None:
        progress_q.put((task.label, frac))

    return run_task(task, progress)


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent reports Ctrl-C once


def run_tasks(tasks: list[Task], workers: int | None = None,
              console: Console | None = None) -> list[RunResult]:
    """Run the tasks with a progress bar, in worker processes when there are several CPUs."""
    console = console or Console(stderr=True)
    workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    columns = (TextColumn("{task.description:<36}"), BarColumn(),
               TextColumn("{task.percentage:>5.1f}%"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        ids = {t.label: bar.add_task(t.label, total=1.0) for t in tasks}
        if workers == 1:
            results = []
            for t in tasks:
                results.append(run_task(t, lambda f, label=t.label: bar.update(ids[label], completed=f)))
                bar.update(ids[t.label], completed=1.0)
            return results
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager, ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=_ignore_sigint) as pool:
            q = manager.Queue()
            futures = [pool.submit(_run_in_worker, (t, q)) for t in tasks]
            try:
                while not all(f.done() for f in futures):
                    try:
                        label, frac = q.get(timeout=0.1)
                        bar.update(ids[label], completed=frac)
                    except queue.Empty:
                        pass
            except KeyboardInterrupt:
                for f in futures:
                    f.cancel()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            results = [f.result() for f in futures]
            for label in ids:
                bar.update(ids[label], completed=1.0)
            return results


def _safe(name: str) -> str:
    return name.replace(":", "_").replace("/", "_")


def run_scenario(scenario: Scenario, out: Path, workers: int | None = None,
                 console: Console | None = None, plots_too: bool = True,
                 fmt: str = "table") -> dict:
    console = console or Console()
    data = scenario_dump(scenario)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [Task(data, cfg, cfg, str(out / f"requests_{_safe(cfg)}.csv"))
             for cfg in scenario.configurations]
    results = run_tasks(tasks, workers)
    runs = [{"configuration": r.configuration, "metrics": r.metrics} for r in results]
    doc = results_doc(data, runs)
    write_json(doc, out / "results.json")
    for r in results:
        write_csv(out / f"timeline_{_safe(r.configuration)}.csv", r.timeline)
    if plots_too:
        from orthrus_sim import plots

        plots.run_plots(scenario.name, runs, {r.configuration: r.requests for r in results},
                        {r.configuration: r.timeline for r in results}, out)
    print_runs(console, runs, f"{scenario.name} ({scenario.cluster.gpus} GPU, {scenario.hardware}, "
                              f"{scenario.model})", fmt)
    console.print(f"results: {out / 'results.json'}", highlight=False)
    return doc


# ----- sweeps --------------------------------------------------------------------------------
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
               source: str = "scenario") -> tuple[Scenario, list[tuple[str, list[str]]], list[dict]]:
    """Every point of the grid, checked before anything runs: a bad key or value fails here
    with the scenario error that names it; only a configuration that a point cannot hold
    (dedicated-1:3 on 2 GPUs) is skipped, with its reason."""
    base = parse_scenario(raw, source, overrides, base_dir, check_fit=False)
    axes = parse_grid(grid)
    points = []
    for combo in itertools.product(*[vals for _, vals in axes]):
        point_over = [f"{k}={v}" for (k, _), v in zip(axes, combo)]
        label = ", ".join(point_over)
        sc = parse_scenario(raw, f"grid point {label}", overrides + point_over, base_dir,
                            check_fit=False)
        point = {"overrides": dict(zip((k for k, _ in axes), combo)), "tasks": [], "skipped": {}}
        for cfg in sc.configurations:
            try:
                split_gpus(cfg, sc.cluster.gpus)
            except ValueError as exc:
                point["skipped"][cfg] = str(exc)
                continue
            data = scenario_dump(sc) | {"configurations": [cfg]}
            point["tasks"].append(Task(data, cfg, f"{label} {cfg}"))
        points.append(point)
    return base, axes, points


def run_sweep(raw: dict, overrides: list[str], grid: list[str], out: Path,
              workers: int | None = None, console: Console | None = None,
              base_dir: Path | None = None, source: str = "scenario", fmt: str = "table") -> dict:
    console = console or Console()
    base, axes, points = plan_sweep(raw, overrides, grid, base_dir, source)
    for p in points:
        for cfg, reason in p["skipped"].items():
            console.print(f"skipped {cfg} at {p['overrides']}: {reason}", highlight=False)
    tasks = [t for p in points for t in p["tasks"]]
    if not tasks:
        raise ValueError("every point of the grid was skipped: nothing to run")
    results = iter(run_tasks(tasks, workers))
    doc_points = []
    for p in points:
        runs = [{"configuration": r.configuration, "metrics": r.metrics}
                for r in (next(results) for _ in p["tasks"])]
        doc_points.append({"overrides": p["overrides"], "runs": runs, "skipped": p["skipped"]})
    data = scenario_dump(base)
    doc = {**results_doc(data, []), "grid": dict(axes), "points": doc_points}
    doc.pop("runs")
    out.mkdir(parents=True, exist_ok=True)
    write_json(doc, out / "sweep.json")
    from orthrus_sim import plots

    sweep_summary(console, base.name, doc_points, fmt)
    plots.sweep_plot(doc_points, axes[0][0], out / "sweep.png", f"{base.name}: sweep over {axes[0][0]}")
    console.print(f"results: {out / 'sweep.json'}", highlight=False)
    return doc


def sweep_summary(console: Console, name: str, points: list[dict], fmt: str) -> None:
    """Combined throughput per point and configuration."""
    configs = list(dict.fromkeys(run["configuration"] for p in points for run in p["runs"]))
    rows = []
    for p in points:
        row = {"point": ", ".join(f"{k}={v}" for k, v in p["overrides"].items())}
        cells = {run["configuration"]: run["metrics"]["throughput_rps"]["combined"] for run in p["runs"]}
        row.update({c: cells.get(c) for c in configs})
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
        table.add_row(row["point"], *["-" if row[c] is None else f"{row[c]:.2f}" for c in configs])
    console.print(table)
