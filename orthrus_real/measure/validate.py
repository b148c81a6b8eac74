"""``orthrus-real validate``: run a scenario in the simulator (with a calibration) and for real
(the engine in this process, or a server process and HTTP) and compare every metric side by side.

Both sides run the same experiment: the scenario goes through the one plan
(``orthrus_sim.experiment.plan``: policy and ``SchedulerConfig``) and the one workload generator
(the same requests, token ids included).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from orthrus_real.cluster.machine_plan import real_scenario
from orthrus_real.measure.bench import bench, bench_in_process
from orthrus_real.server.serving import wait_healthy
from orthrus_sim import safe_name
from orthrus_sim.experiment.plan import engine_plan
from orthrus_sim.experiment.results import results_doc, write_json
from orthrus_sim.experiment.scenario import Scenario, load_scenario, scenario_dump

# metric paths compared (dotted into results.json metrics)
COMPARED = (
    [f"throughput_rps.{k}" for k in ("embedding", "generation", "combined")]
    + [f"latency_s.{k}.{q}" for k in ("embedding", "generation", "ttft", "tpot")
       for q in ("mean", "p50", "p95", "p99")]
    + [f"admission_wait_s.{k}.{q}" for k in ("embedding", "generation") for q in ("p50", "p99")]
    + ["utilization.busy", "budget_fill"]
    + ["slo.combined.goodput_rps", "slo.embedding.attainment", "slo.generation.attainment"]
)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_in_process(sc: Scenario, configuration: str, model_dir: str, adapter_dir: str | None,
                   kv_cache_tokens: int, threads: int, backend: str = "torch") -> dict:
    """The engine in this process, driven without HTTP: the replica the simulator models."""
    from orthrus_real.server.serving import build

    policy, sched = engine_plan(sc, configuration)
    app, runner = build(model_dir, adapter_dir, policy, sched, kv_cache_tokens, max_queued=10**6,
                        threads=threads, backend=backend, calibration=sc.calibration_file)
    try:
        doc, _ = asyncio.run(bench_in_process(runner, app.state.metrics, sc, label=configuration))
    finally:
        runner.stop()
    return doc["runs"][0]


def run_real(sc: Scenario, configuration: str, model_dir: str, adapter_dir: str | None,
             kv_cache_tokens: int, threads: int, out: Path, backend: str = "torch",
             engine_cpus: str | None = None) -> dict:
    """Start a server process for the scenario's configuration, bench it, stop it."""
    port = _free_port()
    scenario_file = out / "scenario.yaml"
    scenario_file.write_text(yaml.safe_dump(scenario_dump(sc), sort_keys=False))
    log = out / f"server_{safe_name(configuration)}.log"
    cmd = [sys.executable, "-m", "orthrus_real.cli", "serve", "--model", model_dir, "--port", str(port),
           "--scenario", str(scenario_file), "--configuration", configuration,
           "--kv-cache-tokens", str(kv_cache_tokens), "--max-queued", "100000",
           "--threads", str(threads), "--backend", backend]
    if adapter_dir:
        cmd += ["--embedding-adapter", adapter_dir]
    if sc.cluster.gpus > 1:  # a cluster: one engine process per replica behind one endpoint
        from orthrus_real.cluster.devices import split_cpus

        cmd += ["--replicas", str(sc.cluster.gpus)]
        if engine_cpus:
            cmd += ["--devices", split_cpus(engine_cpus, sc.cluster.gpus)]
    elif engine_cpus:
        cmd += ["--cpus", engine_cpus]
    return serve_and_bench(cmd, port, sc, configuration, log)[0]


def serve_and_bench(cmd: list[str], port: int, sc: Scenario, label: str, log: Path,
                    start_timeout: float = 120.0, env: dict | None = None,
                    repeat: int = 1, iterations: Path | None = None,
                    before_stop: Callable[[str], None] | None = None,
                    preexec_fn: Callable[[], None] | None = None) -> list[dict]:
    """Start the server ``cmd`` (listening on ``port``; ``env``: its environment;
    ``preexec_fn``: run in the child before it starts), bench it ``repeat`` times with the
    scenario's workload once it is healthy, stop it (SIGTERM); returns the measured runs,
    labelled ``label``. With ``iterations``, the server's iteration record (``GET
    /iterations``, where it has one) is written there as JSON lines; ``before_stop(url)`` runs
    after the benches, while the server is still up."""
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=preexec_fn)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(url, start_timeout, proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; see {log}") from None
            runs = [asyncio.run(bench(url, sc, label=label))[0]["runs"][0] for _ in range(repeat)]
            if iterations is not None:
                save_iterations(url, iterations)
            if before_stop is not None:
                before_stop(url)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return runs


def save_iterations(url: str, path: Path) -> int:
    """Page through a server's ``GET /iterations`` into ``path`` (JSON lines); returns the rows
    written (0, and no file, for a server without the endpoint: stock vLLM)."""
    rows = fetch_iterations(url)
    if rows is None:
        return 0
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def fetch_iterations(url: str) -> list[dict] | None:
    """A server's whole ``GET /iterations`` record, paged (None: it has no such endpoint)."""
    import httpx

    rows, since = [], 0
    with httpx.Client(base_url=url, timeout=60) as client:
        while True:
            r = client.get("/iterations", params={"since": since})
            if r.status_code == 404:
                return None
            r.raise_for_status()
            page = r.json()
            if not page["data"]:
                return rows
            rows += page["data"]
            since = page["next"]


def lookup(metrics: dict, path: str):
    node = metrics
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


# fidelity as other simulators report it: MAPE per metric family over every compared cell
MAPE_FAMILIES = {
    "throughput": [f"throughput_rps.{k}" for k in ("embedding", "generation")],
    "TTFT": [f"latency_s.ttft.{q}" for q in ("p50", "p99")],
    "TPOT": [f"latency_s.tpot.{q}" for q in ("p50", "p99")],
    "E2E": [f"latency_s.{k}.{q}" for k in ("embedding", "generation") for q in ("p50", "p99")],
}


def mape_summary(rows: list[dict]) -> dict[str, dict]:
    """``{family: {mape, cells}}`` over ``compare`` rows (cells with both sides measured)."""
    out = {}
    for family, metrics in MAPE_FAMILIES.items():
        errs = [abs(r["relative_error"]) for r in rows
                if r["metric"] in metrics and r["relative_error"] is not None]
        out[family] = {"mape": sum(errs) / len(errs) if errs else None, "cells": len(errs)}
    return out


def compare(simulated: list[dict], measured: list[dict]) -> list[dict]:
    rows = []
    for sim, real in zip(simulated, measured):
        for path in COMPARED:
            s, m = lookup(sim["metrics"], path), lookup(real["metrics"], path)
            if path.startswith("slo.") and sim["metrics"].get("slo") is None:
                continue  # the scenario gives no SLOs
            err = None if s is None or m in (None, 0) else (s - m) / m
            rows.append({"configuration": sim["configuration"], "metric": path, "simulated": s,
                         "measured": m, "relative_error": err})
    return rows


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def validate(scenario: str | Path, overrides: list[str], model_dir: str, adapter_dir: str | None,
             calibration: str, out: Path, kv_cache_tokens: int = 32768, threads: int = 2,
             progress=None, via_server: bool = False, backend: str = "torch",
             engine_cpus: str | None = None) -> dict:
    """``via_server``: measure through a server process and HTTP (adds the HTTP stack's CPU
    time, which the simulator does not model) instead of the engine in this process; a
    scenario with ``cluster.gpus`` > 1 always is (``serve --replicas``, one engine process per
    replica, ``engine_cpus`` shared out among them)."""
    from orthrus_real.engine.device import environment_check
    from orthrus_real.engine.model_files import adapter_rank
    from orthrus_sim.sim.run import simulate  # the simulator, only when validating

    base = load_scenario(scenario, overrides)
    rank = adapter_rank(adapter_dir) if adapter_dir else None
    sc = real_scenario(base, model_dir, rank, calibration, kv_cache_tokens, gpus=base.cluster.gpus)
    # a cluster of CPU replicas shares this machine: its calibration should have seen that
    crowd = sc.cluster.gpus if sc.cluster.gpus > 1 and not _cuda() else None
    warning = environment_check(calibration, model_dir, threads=threads or None, colocated=crowd)
    if warning and progress:
        progress(f"warning: {warning}")
    out.mkdir(parents=True, exist_ok=True)
    simulated, measured = [], []
    for cfg in sc.configurations:
        if progress:
            progress(f"simulating {cfg}")
        simulated.append({"configuration": cfg, "metrics": simulate(sc, cfg).metrics})
        if progress:
            progress(f"measuring {cfg} ({sc.duration_s or '?'} s)")
        if via_server or sc.cluster.gpus > 1:  # several replicas: through the cluster's gateway
            measured.append(run_real(sc, cfg, model_dir, adapter_dir, kv_cache_tokens, threads, out,
                                     backend, engine_cpus))
        else:
            measured.append(run_in_process(sc, cfg, model_dir, adapter_dir, kv_cache_tokens, threads,
                                           backend))
    data = scenario_dump(sc)
    for name, runs in (("simulated", simulated), ("measured", measured)):
        write_json(results_doc(data, runs), out / name / "results.json")
    rows = compare(simulated, measured)
    (out / "comparison.json").write_text(json.dumps(rows, indent=2) + "\n")
    return {"scenario": sc, "rows": rows, "warnings": [warning] if warning else []}
