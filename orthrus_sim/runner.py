"""Run a scenario's configurations (in parallel processes) and write the results set."""

from __future__ import annotations

import csv
import itertools
import json
import multiprocessing as mp
import os
import queue
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orthrus_sim import plots
from orthrus_sim.scenario import Scenario, parse_scenario
from orthrus_sim.sim.run import RunResult, simulate

SCHEMA = "orthrus.results/1"


def _run_task(args) -> RunResult:
    raw, overrides, configuration, key, progress_q = args
    scenario = parse_scenario(raw, overrides=overrides)

    def progress(frac: float) -> None:
        if progress_q is not None:
            progress_q.put((key, frac))

    return simulate(scenario, configuration, progress=progress)


def run_tasks(tasks: list[tuple[dict, list[str], str, str]], workers: int | None = None,
              console: Console | None = None) -> list[RunResult]:
    """Run ``(raw scenario, overrides, configuration, label)`` tasks with a progress bar."""
    console = console or Console(stderr=True)
    workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    columns = (TextColumn("{task.description:<36}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        ids = {label: bar.add_task(label, total=1.0) for *_, label in tasks}
        if workers == 1:
            results = []
            for raw, overrides, cfg, label in tasks:
                scenario = parse_scenario(raw, overrides=overrides)
                results.append(simulate(scenario, cfg, progress=lambda f, label=label: bar.update(
                    ids[label], completed=f)))
                bar.update(ids[label], completed=1.0)
            return results
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager, ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            q = manager.Queue()
            futures = [pool.submit(_run_task, (raw, ov, cfg, label, q)) for raw, ov, cfg, label in tasks]
            while not all(f.done() for f in futures):
                try:
                    label, frac = q.get(timeout=0.1)
                    bar.update(ids[label], completed=frac)
                except queue.Empty:
                    pass
            results = [f.result() for f in futures]
            for label in ids:
                bar.update(ids[label], completed=1.0)
            return results


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def comparison_table(runs: list[dict], title: str) -> Table:
    table = Table(title=title)
    for col in ("configuration", "emb/s", "gen/s", "total/s", "emb p50", "emb p99", "gen p99",
                "TTFT p99", "busy", "fill", "unfin."):
        table.add_column(col, justify="right")
    for run in runs:
        m = run["metrics"]
        lat = m["latency_s"]
        table.add_row(
            run["configuration"], _fmt(m["throughput_rps"]["embedding"]),
            _fmt(m["throughput_rps"]["generation"]), _fmt(m["throughput_rps"]["combined"]),
            _fmt(lat["embedding"]["p50"], 3), _fmt(lat["embedding"]["p99"], 3),
            _fmt(lat["generation"]["p99"]), _fmt(lat["ttft"]["p99"], 3),
            f"{m['utilization']['busy']:.0%}", f"{m['budget_fill']:.0%}",
            str(sum(m["unfinished"].values())),
        )
    table.caption = "throughput in requests/s, latencies in seconds; fill = mean token-budget use"
    return table


def scenario_dump(scenario: Scenario) -> dict:
    return scenario.model_dump(mode="json", by_alias=True)


def run_scenario(raw: dict, overrides: list[str], out: Path, workers: int | None = None,
                 console: Console | None = None, plots_too: bool = True) -> dict:
    console = console or Console()
    scenario = parse_scenario(raw, overrides=overrides)
    tasks = [(raw, overrides, cfg, cfg) for cfg in scenario.configurations]
    results = run_tasks(tasks, workers)
    runs = [{"configuration": r.configuration, "metrics": r.metrics} for r in results]
    doc = {"schema": SCHEMA, "scenario": scenario_dump(scenario), "runs": runs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        safe = r.configuration.replace(":", "_").replace("/", "_")
        _write_csv(out / f"requests_{safe}.csv", r.requests)
        _write_csv(out / f"timeline_{safe}.csv", r.timeline)
    if plots_too:
        title = scenario.name
        plots.throughput_bars(runs, out / "throughput.png", f"{title}: throughput")
        plots.latency_cdfs(runs, {r.configuration: r.requests for r in results},
                           out / "latency_cdf.png", f"{title}: latency CDF")
        plots.timelines(runs, {r.configuration: r.timeline for r in results},
                        out / "timeline.png", f"{title}: utilisation and queue")
    console.print(comparison_table(runs, f"{scenario.name} ({scenario.cluster.gpus} GPU, "
                                         f"{scenario.hardware}, {scenario.model})"))
    console.print(f"results: {out / 'results.json'}")
    return doc


def parse_grid(grid: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for item in grid:
        if "=" not in item:
            raise ValueError(f"--grid {item!r}: expected key=v1,v2,...")
        key, _, values = item.partition("=")
        vals = [v for v in values.split(",") if v != ""]
        if not vals:
            raise ValueError(f"--grid {item!r}: no values")
        out.append((key.strip(), vals))
    return out


def run_sweep(raw: dict, overrides: list[str], grid: list[str], out: Path,
              workers: int | None = None, console: Console | None = None) -> dict:
    console = console or Console()
    axes = parse_grid(grid)
    points = []
    tasks = []
    for combo in itertools.product(*[vals for _, vals in axes]):
        point_over = [f"{k}={v}" for (k, _), v in zip(axes, combo)]
        label_base = ",".join(point_over)
        point = {"overrides": {k: v for (k, _), v in zip(axes, combo)}, "runs": [], "skipped": {}}
        points.append(point)
        configs = parse_scenario(raw, overrides=overrides).configurations
        for cfg in configs:
            try:  # a configuration may not fit this point (e.g. dedicated-1:3 on 2 GPUs)
                parse_scenario(raw,
                               overrides=overrides + point_over + [f"configurations=[{cfg}]"])
            except ValueError as exc:
                point["skipped"][cfg] = str(exc).splitlines()[-1].strip()
                continue
            point["runs"].append(None)
            tasks.append((raw, overrides + point_over + [f"configurations=[{cfg}]"], cfg,
                          f"{label_base} {cfg}"))
    results = iter(run_tasks(tasks, workers))
    for point in points:
        point["runs"] = [
            {"configuration": r.configuration, "metrics": r.metrics}
            for r in (next(results) for _ in point["runs"])
        ]
    base = parse_scenario(raw, overrides=overrides)
    doc = {"schema": SCHEMA, "scenario": scenario_dump(base), "grid": dict(axes), "points": points}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    table = Table(title=f"{base.name}: sweep (combined requests/s)")
    table.add_column("point")
    configs = list(dict.fromkeys(run["configuration"] for p in points for run in p["runs"]))
    for cfg in configs:
        table.add_column(cfg, justify="right")
    for p in points:
        cells = {run["configuration"]: run["metrics"]["throughput_rps"]["combined"] for run in p["runs"]}
        table.add_row(", ".join(f"{k}={v}" for k, v in p["overrides"].items()),
                      *[_fmt(cells.get(c)) for c in configs])
    console.print(table)
    plots.sweep_plot(points, axes[0][0], out / "sweep.png", f"{base.name}: sweep over {axes[0][0]}")
    console.print(f"results: {out / 'sweep.json'}")
    return doc
