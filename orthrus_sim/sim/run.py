"""Simulate one configuration of a scenario."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import simpy

from orthrus_sim.experiment.results import CsvRows, MeasurementWindow, RequestLog, window_warnings
from orthrus_sim.experiment.scenario import Scenario
from orthrus_sim.sim.cluster import Cluster, placement_log
from orthrus_sim.sim.driver import SimDriver
from orthrus_sim.sim.metrics import replica_metrics

PLOT_SAMPLE = 50_000  # rows kept for the plots when the rows stream to a CSV file


@dataclass
class RunResult:
    configuration: str
    metrics: dict
    requests: list[dict]  # every row, or a uniform sample of them when streamed to a CSV
    timeline: list[dict]
    specs: list = field(default_factory=list)  # the workload's RequestSpecs (keep_specs)


def _monitor(env: simpy.Environment, cluster: Cluster, interval: float, rows: list[dict],
             progress: Callable[[float], None] | None, horizon: float | None):
    """Every ``interval``: waiting requests, and per GPU its busy fraction, MFU and MBU over the
    interval, KV use (all, and embeddings' share) and requests holding blocks."""
    hw = cluster.hardware
    replicas = cluster.replicas
    last = [rep.progress() for rep in replicas]
    # each replica's column names, made once (a row is written every interval)
    columns = [tuple(f"{name}_{i}" for name in ("busy", "mfu", "mbu", "kv_usage", "kv_embedding",
                                                 "running")) for i in range(len(replicas))]
    flops_s, bytes_s = hw.peak_flops * interval, hw.mem_bw * interval
    while True:
        yield env.timeout(interval)
        snaps = [rep.snapshot() for rep in replicas]
        row = {"time_s": env.now, "queue_length": sum(s.waiting for s in snaps)}
        for i, rep in enumerate(replicas):
            snap, now = snaps[i], rep.progress()
            d = now.minus(last[i])
            busy, mfu, mbu, kv_usage, kv_embedding, running = columns[i]
            row[busy] = min(1.0, d.busy_s / interval)
            row[mfu] = d.flops / flops_s
            row[mbu] = d.bytes / bytes_s
            row[kv_usage] = snap.kv_usage
            row[kv_embedding] = snap.kv_blocks_embedding / snap.kv_blocks_total
            row[running] = snap.embeddings_running + snap.generations_running
            last[i] = now
        rows.append(row)
        if progress is not None and horizon:
            progress(min(1.0, env.now / horizon))


def simulate(scenario: Scenario, configuration: str, cost_factory=None, fast_forward: bool = True,
             progress: Callable[[float], None] | None = None, keep_specs: bool = False,
             requests_csv: Path | None = None, keep_rows: bool = True) -> RunResult:
    """Run ``configuration`` of ``scenario`` to its end; deterministic for a given seed.

    With ``requests_csv``, per-request rows stream to that file as requests end (memory stays
    bounded however long the run) and ``RunResult.requests`` is a uniform sample of them;
    without it, ``RunResult.requests`` holds every row, or none with ``keep_rows=False``.
    """
    wall = time.perf_counter()
    env = simpy.Environment()
    sink = CsvRows(requests_csv) if requests_csv is not None else None
    sample = PLOT_SAMPLE if sink else (None if keep_rows else 0)
    log = RequestLog(scenario.warmup_s, sink, sample, scenario.duration_s, scenario.seed,
                     scenario.slo)
    cluster = Cluster(env, scenario, configuration, None, cost_factory, fast_forward)
    driver = SimDriver(env, scenario, cluster.submit, log, keep_specs)
    cluster.on_done = driver.request_done  # the two know each other: set once both exist
    driver.start()
    timeline: list[dict] = []
    env.process(_monitor(env, cluster, scenario.timeline_interval_s, timeline, progress,
                         scenario.duration_s))
    window = MeasurementWindow(scenario.warmup_s, [type(rep.stats)() for rep in cluster.replicas])

    def open_window():
        yield env.timeout(scenario.warmup_s)
        window.open([rep.progress() for rep in cluster.replicas])

    env.process(open_window())
    # stop_below_attainment: the run ends where the driver says it fails (processing the
    # event raises SimPy's own stop); a run it does not stop is the run without it
    stop = driver.stopped
    stop.callbacks.append(simpy.core.StopSimulation.callback)
    if scenario.duration_s is not None:
        env.run(until=scenario.duration_s)
        stopped = stop.triggered  # read before the flush below
        end = env.now if stopped else scenario.duration_s
    else:
        cap = env.timeout(scenario.max_sim_time_s)
        env.run(until=env.any_of([driver.all_done, cap]))
        stopped = stop.triggered  # read before the flush below
        end = env.now
    if scenario.duration_s is not None or stopped:
        for replica in cluster.replicas:
            replica.flush()  # (requests it completes may pass the stop's limit: not a stop)
    if progress is not None:
        progress(1.0)
    start = window.start(end)
    counters = [rep.progress().minus(s) for rep, s in zip(cluster.replicas, window.opening)]
    metrics = log.close(end, driver.workflows)
    if sink is not None:
        sink.close()
    metrics.update(replica_metrics(cluster.replicas, counters, end - start, cluster.hardware))
    metrics.update({"kv_transfers": cluster.kv_transfers, "kv_transfer_s": cluster.kv_transfer_s,
                    "sim_end_s": end, "sim_wall_s": time.perf_counter() - wall})
    if stopped:
        metrics["stopped_early"] = stop.value
    placement = placement_log(cluster.router)
    if placement is not None:
        metrics["placement"] = placement
    if scenario.workload.phases:
        metrics["phases"] = log.phase_metrics(scenario.workload.phases)
    metrics["warnings"] = driver.workload.warnings + window_warnings(metrics)
    if driver.workload.notes:
        metrics["workload_notes"] = driver.workload.notes
    return RunResult(configuration, metrics, log.sample, timeline, driver.workload.specs or [])
