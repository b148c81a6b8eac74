"""Simulate one configuration of a scenario."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from orthrus_sim.costmodel import get_hardware
from orthrus_sim.scenario import Scenario
from orthrus_sim.sim.cluster import Cluster
from orthrus_sim.sim.metrics import compute_metrics, request_row
from orthrus_sim.sim.workload import Driver


@dataclass
class RunResult:
    configuration: str
    metrics: dict
    requests: list[dict]
    timeline: list[dict]


def _monitor(env: simpy.Environment, cluster: Cluster, interval: float, rows: list[dict],
             progress: Callable[[float], None] | None, horizon: float | None):
    last_busy = [0.0] * len(cluster.replicas)
    while True:
        yield env.timeout(interval)
        snaps = [rep.policy.snapshot() for rep in cluster.replicas]
        row = {"time_s": env.now, "queue_length": sum(s.waiting for s in snaps)}
        for i, (rep, snap) in enumerate(zip(cluster.replicas, snaps)):
            busy = rep.busy_time()
            row[f"busy_{i}"] = min(1.0, (busy - last_busy[i]) / interval)
            row[f"kv_usage_{i}"] = snap.kv_usage
            row[f"running_{i}"] = snap.embeddings_running + snap.generations_running
            last_busy[i] = busy
        rows.append(row)
        if progress is not None and horizon:
            progress(min(1.0, env.now / horizon))


def simulate(scenario: Scenario, configuration: str, cost_factory=None, fast_forward: bool = True,
             progress: Callable[[float], None] | None = None) -> RunResult:
    """Run ``configuration`` of ``scenario`` to its end; deterministic for a given seed."""
    wall = time.perf_counter()
    env = simpy.Environment()
    driver_box: list[Driver] = []
    cluster = Cluster(env, scenario, configuration, lambda r: driver_box[0].request_done(r),
                      cost_factory, fast_forward)
    driver = Driver(env, scenario, cluster.submit)
    driver_box.append(driver)
    driver.start()
    timeline: list[dict] = []
    horizon = scenario.duration_s
    env.process(_monitor(env, cluster, scenario.timeline_interval_s, timeline, progress, horizon))
    if scenario.duration_s is not None:
        env.run(until=scenario.duration_s)
        end = scenario.duration_s
        for replica in cluster.replicas:
            replica.flush()
    else:
        cap = env.timeout(scenario.max_sim_time_s)
        env.run(until=env.any_of([driver.all_done, cap]))
        end = env.now
    if progress is not None:
        progress(1.0)
    metrics = compute_metrics(
        driver.issued, driver.workflows, cluster.replicas, min(scenario.warmup_s, end), end,
        get_hardware(scenario.hardware).peak_flops, time.perf_counter() - wall,
        {"kv_transfers": cluster.kv_transfers, "kv_transfer_s": cluster.kv_transfer_s,
         "sim_end_s": end},
    )
    if scenario.workload.phases:
        metrics["phases"] = phase_metrics(driver, scenario)
    rows = [request_row(r) for r in driver.issued]
    if driver.phase_of:
        for row in rows:
            row["phase"] = driver.phase_of.get(row["request_id"])
    return RunResult(configuration, metrics, rows, timeline)


def phase_metrics(driver: Driver, scenario: Scenario) -> list[dict]:
    """Per phase: its mix, what was issued and finished, and when its last request finished."""
    out = []
    for i, phase in enumerate(scenario.workload.phases):
        reqs = [r for r in driver.issued if driver.phase_of.get(r.request_id) == i]
        done = [r for r in reqs if r.finished_at is not None and r.state.value == "finished"]
        start = min((r.arrival_time for r in reqs), default=None)
        end = max((r.finished_at for r in done), default=None)
        out.append({
            "phase": i, "generation_share": phase.generation_share, "issued": len(reqs),
            "completed": len(done), "start_s": start,
            "last_finish_s": end if len(done) == len(reqs) else None,
            "completion_s": (end - start) if reqs and len(done) == len(reqs) else None,
        })
    return out
