"""Measured serving metrics to fit the simulator to: ``results.json`` files (``orthrus.results/1``)
in which only the metrics that were measured need be present (docs/fitting.md).

What ``orthrus-real bench`` and ``validate`` write is read as it is; a hand-written file needs
only ``runs: [{configuration, metrics}]`` with a few of the fitted metrics (``FIT_METRICS``;
``iterations_per_s``, the engine's steps per second, from ``iterations`` and ``window_s``).
A throughput of 0 or a percentile over no requests counts as not measured (a bench of one
kind's server reports the other kind as 0), and so does a run's ``combined`` throughput when
only one kind's is there (that server's total is not the configuration's).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
from dataclasses import dataclass
from pathlib import Path

from orthrus_sim import read_structured
from orthrus_sim.experiment.quantiles import PERCENTILES
from orthrus_sim.experiment.results import KINDS, SCHEMA
from orthrus_sim.experiment.scenario import (
    apply_overrides,
    load_scenario,
    pool_stream,
    scenario_dump,
)

THROUGHPUT_KEYS = (*KINDS, "combined", "workflow")
LATENCY_KEYS = (*KINDS, "ttft", "tpot", "workflow")
STATS = ("mean", *PERCENTILES)
ITERATION_RATE = "iterations_per_s"
FIT_METRICS = tuple([f"throughput_rps.{k}" for k in THROUGHPUT_KEYS]
                    + [f"latency_s.{k}.{q}" for k in LATENCY_KEYS for q in STATS]
                    + ["utilization.busy", ITERATION_RATE])


@dataclass(frozen=True)
class MeasuredRun:
    """One measured configuration: the fitted metrics it has (dotted path -> value)."""

    configuration: str
    metrics: dict[str, float]
    source: str
    kind: str | None = None  # the one kind measured (a single-kind server of a split), if so
    overrides: tuple[str, ...] = ()  # the scenario overrides it was measured under (--set form)


def _number(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if value < 0:
        raise ValueError(f"{where}: must be >= 0, got {value!r}")
    return float(value)


def iteration_rate(metrics: dict, role: str | None = None) -> float | None:
    """Engine steps per second over a run's window: its ``iterations`` over ``window_s``
    (both in every ``results.json``: an Orthrus server's own counter, stock vLLM's steps, the
    simulator's iterations), or a hand-written ``iterations_per_s``. ``role``: only the
    replicas of that role (one kind's servers of a simulated split), summed. None if not there.

    A saturated server's steps pin its mean iteration time (busy time / steps), which its
    request latencies only show mixed with the time requests spend outside the forward pass."""
    if metrics.get(ITERATION_RATE) is not None:
        return metrics[ITERATION_RATE]
    window = metrics.get("window_s")
    count = metrics.get("iterations")
    if role is not None:
        rows = [g for g in (metrics.get("utilization") or {}).get("per_gpu") or []
                if g.get("role") == role]
        if rows:
            count = sum(g.get("iterations") or 0 for g in rows)
    if count is None or not isinstance(window, list) or len(window) != 2:
        return None
    span = window[1] - window[0]
    return count / span if span > 0 else None


def run_metrics(metrics: dict, where: str) -> dict[str, float]:
    """The fitted metrics of one run's ``metrics`` mapping; an unknown kind or statistic under
    ``throughput_rps`` or ``latency_s`` is an error naming it (other sections are not fitted
    and are left alone)."""
    if not isinstance(metrics, dict):
        raise ValueError(f"{where}.metrics: expected a mapping")
    out: dict[str, float] = {}
    thr = metrics.get("throughput_rps") or {}
    if not isinstance(thr, dict):
        raise ValueError(f"{where}.metrics.throughput_rps: expected a mapping of kind -> requests/s")
    for key, value in thr.items():
        path = f"throughput_rps.{key}"
        if key not in THROUGHPUT_KEYS:
            raise ValueError(f"{where}.metrics.{path}: unknown kind {key!r}; known: "
                             f"{', '.join(THROUGHPUT_KEYS)}")
        v = _number(value, f"{where}.metrics.{path}")
        if v:  # 0: not measured
            out[path] = v
    kinds = [k for k in KINDS if f"throughput_rps.{k}" in out]
    if 0 < len(kinds) < len(KINDS):  # one kind's server: its "combined" is not the split's
        out.pop("throughput_rps.combined", None)
    busy = (metrics.get("utilization") or {}).get("busy") \
        if isinstance(metrics.get("utilization"), dict) else None
    busy = _number(busy, f"{where}.metrics.utilization.busy")
    if busy:  # the device's busy share: a front end that limits the server leaves it idle
        out["utilization.busy"] = busy
    for key in ("iterations", ITERATION_RATE):
        _number(metrics.get(key), f"{where}.metrics.{key}")
    window = metrics.get("window_s")
    if window is not None and not (isinstance(window, list) and len(window) == 2
                                   and all(_number(w, f"{where}.metrics.window_s") is not None
                                           for w in window)):
        raise ValueError(f"{where}.metrics.window_s: expected [start, end] in seconds")
    rate = iteration_rate(metrics)
    if rate:  # 0: a server that does not expose its steps
        out[ITERATION_RATE] = rate
    lat = metrics.get("latency_s") or {}
    if not isinstance(lat, dict):
        raise ValueError(f"{where}.metrics.latency_s: expected a mapping of kind -> statistics")
    for key, stats in lat.items():
        if key not in LATENCY_KEYS:
            raise ValueError(f"{where}.metrics.latency_s.{key}: unknown kind {key!r}; known: "
                             f"{', '.join(LATENCY_KEYS)}")
        if not isinstance(stats, dict):
            raise ValueError(f"{where}.metrics.latency_s.{key}: expected a mapping such as "
                             "{p50: 0.12, p99: 0.4} (seconds)")
        if stats.get("count") == 0:
            continue
        for stat, value in stats.items():
            if stat == "count":
                continue
            path = f"latency_s.{key}.{stat}"
            if stat not in STATS:
                raise ValueError(f"{where}.metrics.{path}: unknown statistic {stat!r}; known: "
                                 f"{', '.join(STATS)}")
            v = _number(value, f"{where}.metrics.{path}")
            if v:
                out[path] = v
    return out


def scenario_overrides(value, where: str) -> tuple[str, ...]:
    """A run's ``scenario_overrides``: a mapping ``{dotted.key: value}`` or a list of
    ``dotted.key=value`` strings (the ``--set`` form), as ``--set`` strings."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = []
        for key, v in value.items():
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"{where}.scenario_overrides: keys must be dotted scenario "
                                 f"fields such as workload.generation_share, got {key!r}")
            items.append(f"{key}={json.dumps(v)}")
        return tuple(items)
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        return tuple(value)
    raise ValueError(f"{where}.scenario_overrides: expected a mapping of scenario fields "
                     "({workload.generation_share: 0.1}) or a list of 'field=value' strings")


SCENARIO_OVERRIDE = "scenario"  # ``scenario=NAME`` among a run's overrides: measured under that file


def measured_under(base: dict, overrides: tuple[str, ...] | list[str],
                   flag: str = "scenario_overrides") -> dict:
    """The scenario (plain data) a run was measured under: ``base`` (the fit's own scenario)
    with the run's overrides, or, where one of them is ``scenario=NAME`` (a scenario file or a
    shipped name, ``paper/iter_retgen``), that scenario with the others: one joint fit across
    experiments whose workloads differ in more than a few fields."""
    named = [o for o in overrides if o.partition("=")[0].strip() == SCENARIO_OVERRIDE]
    if len(named) > 1:
        raise ValueError(f"{flag}: {SCENARIO_OVERRIDE}= given {len(named)} times "
                         f"({', '.join(named)}); a run is measured under one scenario")
    if named:
        name = named[0].partition("=")[2].strip().strip("'\"")
        try:
            base = scenario_dump(load_scenario(name))
        except ValueError as exc:
            raise ValueError(f"{flag} {named[0]!r}: {exc}") from None
    return apply_overrides(base, [o for o in overrides if o not in named], flag)


def load_measured(paths: list[str | Path], patterns: list[str] | None = None,
                  at: list[list[str]] | None = None) -> list[MeasuredRun]:
    """Every run of every file, with its fitted metrics (those matching one of ``patterns``,
    shell-style: ``latency_s.*.p50``; all by default); a run without any is an error.

    ``at``: per file, the scenario overrides its runs were measured under (``--at``), after
    those a run carries itself (``runs[].scenario_overrides``, written by ``bench``)."""
    if not paths:
        raise ValueError("--measured: give at least one results file")
    if at is not None and len(at) != len(paths):
        raise ValueError(f"--at: give one per --measured file, in the same order ({len(paths)} "
                         f"files, {len(at)} --at; '-' for a file measured under the scenario as "
                         "it is)")
    runs: list[MeasuredRun] = []
    for index, path in enumerate(paths):
        doc = read_structured(path, "measured results file")
        if not isinstance(doc, dict):
            raise ValueError(f"measured results file {path}: expected a mapping with 'runs'")
        if doc.get("schema", SCHEMA) != SCHEMA:
            raise ValueError(f"measured results file {path}: schema must be {SCHEMA!r}, got "
                             f"{doc.get('schema')!r}")
        items = doc.get("runs")
        if not isinstance(items, list) or not items:
            raise ValueError(f"measured results file {path}: 'runs' must be a non-empty list of "
                             "{configuration, metrics}")
        for i, run in enumerate(items):
            where = f"{path}: runs[{i}]"
            if not isinstance(run, dict) or not isinstance(run.get("configuration"), str):
                raise ValueError(f"{where}: needs 'configuration' (the configuration's name, "
                                 "e.g. dedicated-1:3 or orthrus) and 'metrics'")
            metrics = run_metrics(run.get("metrics"), where)
            # the run's kind from all it measured, before the patterns pick the fitted metrics
            kinds = [k for k in KINDS if f"throughput_rps.{k}" in metrics
                     or any(m.startswith(f"latency_s.{k}.") for m in metrics)]
            if patterns:
                metrics = {k: v for k, v in metrics.items()
                           if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
            if not metrics:
                raise ValueError(f"{where}: no fitted metric is present (any of "
                                 "throughput_rps.<kind>, latency_s.<kind>.<p50|p95|p99|mean>, "
                                 "utilization.busy, iterations_per_s"
                                 + (f", matching {', '.join(patterns)}" if patterns else "") + ")")
            overrides = scenario_overrides(run.get("scenario_overrides"), where)
            overrides += tuple(at[index]) if at else ()
            runs.append(MeasuredRun(run["configuration"], metrics, str(path),
                                    kinds[0] if len(kinds) == 1 else None, overrides))
    return runs


def only_kind(raw: dict, kind: str) -> dict:
    """A scenario mapping whose load sends requests of ``kind`` only: its per-kind pools of the
    other kind are left out (what a dedicated single-kind server is benched with). A kept pool
    keeps its stream (its position in the whole list, unless named): it sends the very requests
    it sends in the whole scenario, so that a fit of the scenario to these measurements
    simulates the requests that were measured."""
    if kind not in KINDS:
        raise ValueError(f"--only must be one of {', '.join(KINDS)}, got {kind!r}")
    raw = copy.deepcopy(raw)
    pools = (raw.get("workload") or {}).get("pools")
    if not pools or any(p.get("kind", "mixed") not in KINDS for p in pools):
        raise ValueError("--only needs a scenario whose workload lists per-kind pools "
                         "(workload.pools with kind: embedding / generation)")
    kept = [{**p, "stream": pool_stream(p.get("stream"), i)} for i, p in enumerate(pools)
            if p.get("kind") == kind]
    if not kept:
        raise ValueError(f"--only {kind}: the scenario has no {kind} pool")
    raw["workload"]["pools"] = kept
    return raw
