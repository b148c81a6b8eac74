"""``orthrus-real validate``: run a scenario in the simulator (with a calibration) and for real
(a server process + the bench client) and compare every metric side by side."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from orthrus_real.bench import bench, bench_in_process
from orthrus_real.serving import wait_healthy
from orthrus_sim.files import read_structured
from orthrus_sim.runner import SCHEMA, scenario_dump
from orthrus_sim.scenario import Scenario, parse_scenario
from orthrus_sim.sim.cluster import unified_policy
from orthrus_sim.sim.run import simulate

UNIFIED = ("orthrus", "unified-hetero", "unified-homo")
# metric paths compared (dotted into results.json metrics)
COMPARED = (
    [f"throughput_rps.{k}" for k in ("embedding", "generation", "combined")]
    + [f"latency_s.{k}.{q}" for k in ("embedding", "generation", "ttft", "tpot")
       for q in ("mean", "p50", "p95", "p99")]
    + ["utilization.busy", "budget_fill"]
)


def real_scenario(raw: dict, overrides: list[str], model_dir: str, adapter_dir: str | None,
                  calibration: str, kv_cache_tokens: int) -> Scenario:
    """The scenario as the simulator must see this machine: one CPU 'device', this model,
    this calibration, the server's KV capacity."""
    rank = None
    if adapter_dir:
        rank = read_structured(Path(adapter_dir) / "adapter_config.json", "adapter config")["r"]
    block = raw.get("scheduler", {}).get("block_size", 16)
    forced = ["hardware=cpu-2core", f"model={model_dir}", f"calibration={calibration}",
              "cluster.gpus=1", f"embedding.lora_rank={rank if rank else 'null'}",
              f"scheduler.num_blocks={kv_cache_tokens // block}"]
    configs = parse_scenario(raw, "scenario", overrides).configurations
    bad = [c for c in configs if not (c in UNIFIED or c.startswith("unified:"))]
    if bad:
        raise ValueError(f"validate runs one engine on this machine; configurations {bad} need "
                         "several devices (use orthrus, unified-hetero, unified-homo or unified:<policy>)")
    return parse_scenario(raw, "scenario", overrides + forced)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_in_process(sc: Scenario, configuration: str, model_dir: str, adapter_dir: str | None,
                   kv_cache_tokens: int, threads: int, backend: str = "torch") -> dict:
    """The engine in this process, driven without HTTP: the replica the simulator models."""
    from orthrus_real.serving import build
    from orthrus_sim.engine import SchedulerConfig

    policy = unified_policy(configuration, sc.scheduler.policy)
    s = sc.scheduler
    sched = SchedulerConfig(token_budget=s.token_budget, chunk_size=s.chunk_size,
                            max_num_seqs=s.max_num_seqs, block_size=s.block_size)
    app, runner = build(model_dir, adapter_dir, policy, sched, kv_cache_tokens, max_queued=10**6,
                        threads=threads, backend=backend)
    try:
        doc = asyncio.run(bench_in_process(runner, app.state.metrics, sc, label=configuration))
    finally:
        runner.stop()
    return doc["runs"][0]


def run_real(sc: Scenario, configuration: str, model_dir: str, adapter_dir: str | None,
             kv_cache_tokens: int, threads: int, log: Path, backend: str = "torch") -> dict:
    """Start a server process with the configuration's policy, bench it, stop it."""
    policy = unified_policy(configuration, sc.scheduler.policy)
    port = _free_port()
    s = sc.scheduler
    cmd = [sys.executable, "-m", "orthrus_real.cli", "serve", "--model", model_dir, "--port", str(port),
           "--policy", policy, "--token-budget", str(s.token_budget),
           "--chunk-size", str(s.chunk_size or s.token_budget), "--max-num-seqs", str(s.max_num_seqs),
           "--kv-cache-tokens", str(kv_cache_tokens), "--max-queued", "100000",
           "--threads", str(threads), "--backend", backend]
    if adapter_dir:
        cmd += ["--embedding-adapter", adapter_dir]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(url, 120.0, proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; see {log}") from None
            doc = asyncio.run(bench(url, sc, label=configuration))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return doc["runs"][0]


def lookup(metrics: dict, path: str):
    node = metrics
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def compare(simulated: list[dict], measured: list[dict]) -> list[dict]:
    rows = []
    for sim, real in zip(simulated, measured):
        for path in COMPARED:
            s, m = lookup(sim["metrics"], path), lookup(real["metrics"], path)
            err = None if s is None or m in (None, 0) else (s - m) / m
            rows.append({"configuration": sim["configuration"], "metric": path, "simulated": s,
                         "measured": m, "relative_error": err})
    return rows


def validate(raw: dict, overrides: list[str], model_dir: str, adapter_dir: str | None,
             calibration: str, out: Path, kv_cache_tokens: int = 32768, threads: int = 2,
             progress=None, via_server: bool = False, backend: str = "torch") -> dict:
    """``via_server``: measure through a server process and HTTP (adds the HTTP stack's CPU
    time, which the simulator does not model) instead of the engine in this process."""
    sc = real_scenario(raw, overrides, model_dir, adapter_dir, calibration, kv_cache_tokens)
    out.mkdir(parents=True, exist_ok=True)
    simulated, measured = [], []
    for cfg in sc.configurations:
        if progress:
            progress(f"simulating {cfg}")
        simulated.append({"configuration": cfg, "metrics": simulate(sc, cfg).metrics})
        if progress:
            progress(f"measuring {cfg} ({sc.duration_s or '?'} s)")
        if via_server:
            measured.append(run_real(sc, cfg, model_dir, adapter_dir, kv_cache_tokens, threads,
                                     out / f"server_{cfg.replace(':', '_')}.log", backend))
        else:
            measured.append(run_in_process(sc, cfg, model_dir, adapter_dir, kv_cache_tokens, threads,
                                           backend))
    for name, runs in (("simulated", simulated), ("measured", measured)):
        (out / name).mkdir(exist_ok=True)
        (out / name / "results.json").write_text(json.dumps(
            {"schema": SCHEMA, "scenario": scenario_dump(sc), "runs": runs}, indent=2) + "\n")
    rows = compare(simulated, measured)
    (out / "comparison.json").write_text(json.dumps(rows, indent=2) + "\n")
    return {"scenario": sc, "rows": rows}
