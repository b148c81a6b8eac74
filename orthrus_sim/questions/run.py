"""Run a scenario's configurations (in parallel processes) and write the results set
(sweeps: ``orthrus_sim.questions.sweep``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from orthrus_sim import safe_name
from orthrus_sim.experiment.results import print_runs, results_doc, write_csv, write_json
from orthrus_sim.experiment.scenario import Scenario, parse_scenario, scenario_dump
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


def ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent reports Ctrl-C once


def process_pool(workers: int) -> ProcessPoolExecutor:
    """The one process pool of runs, sweeps and searches: spawned workers that leave Ctrl-C to
    the parent."""
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=ignore_sigint)


def in_processes(fn: Callable[[Any], Any], items: list, workers: int,
                 poll: Callable[[], None] | None = None,
                 pool: ProcessPoolExecutor | None = None) -> Iterator[tuple[Any, Future]]:
    """``fn(item)`` for every item in ``workers`` worker processes (``pool``: an open
    ``process_pool`` kept by the caller across calls), yielding ``(item, future)`` as each
    finishes; ``poll()`` runs every 0.1 s while they work (progress). What has not started when
    the caller stops (or Ctrl-C) is cancelled."""
    if pool is None:
        with process_pool(workers) as own:
            yield from in_processes(fn, items, workers, poll, own)
        return
    futures = {pool.submit(fn, item): item for item in items}
    try:
        while futures:
            done, _ = wait(futures, timeout=0.1 if poll else None, return_when=FIRST_COMPLETED)
            if poll is not None:
                poll()
            for f in done:
                yield futures.pop(f), f
    finally:
        for f in futures:
            f.cancel()


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
        with mp.get_context("spawn").Manager() as manager:
            q = manager.Queue()

            def drain() -> None:
                while True:
                    try:
                        label, frac = q.get_nowait()
                    except queue.Empty:
                        return
                    bar.update(ids[label], completed=frac)

            done = {}
            for (task, _), future in in_processes(_run_in_worker, [(t, q) for t in tasks],
                                                  workers, drain):
                done[task.label] = future.result()
                bar.update(ids[task.label], completed=1.0)
            return [done[t.label] for t in tasks]


def run_scenario(scenario: Scenario, out: Path, workers: int | None = None,
                 console: Console | None = None, plots_too: bool = True,
                 fmt: str = "table", wide: bool = False) -> dict:
    """Run every configuration, write the results set, print the comparison: with ``fmt``
    csv or json, stdout carries that alone (notes and warnings go to stderr)."""
    console = console or Console()
    notes = console if fmt == "table" else Console(stderr=True)
    data = scenario_dump(scenario)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [Task(data, cfg, cfg, str(out / f"requests_{safe_name(cfg)}.csv"))
             for cfg in scenario.configurations]
    results = run_tasks(tasks, workers)
    runs = [{"configuration": r.configuration, "metrics": r.metrics} for r in results]
    doc = results_doc(data, runs)
    write_json(doc, out / "results.json")
    for r in results:
        write_csv(out / f"timeline_{safe_name(r.configuration)}.csv", r.timeline)
    if plots_too:
        from orthrus_sim.questions import plots

        plots.run_plots(scenario.name, runs, {r.configuration: r.requests for r in results},
                        {r.configuration: r.timeline for r in results}, out)
    print_runs(console, runs, f"{scenario.name} ({scenario.cluster.gpus} GPU, {scenario.hardware}, "
                              f"{scenario.model})", fmt, wide, notes)
    notes.print(f"results: {out / 'results.json'}", highlight=False)
    return doc
