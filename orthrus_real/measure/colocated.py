"""Neighbours for a co-located calibration (``orthrus-real calibrate --colocated N``).

A cluster on one machine runs N engines side by side, and each iteration of one of them is
slower than the same iteration with the machine to itself: the engines share the chip's caches
and memory bandwidth, and their clients' and servers' per-token work takes cores. A
calibration measured alone prices that away (a neighbour engine cost the grid's iterations
about 3 % on the 2-core machine, serving behind the gateway about 10 %: docs/cluster.md). So
the profiled engine is given N-1 neighbours of the arrangement
the cluster will run: each an ``orthrus-real serve`` replica process on its own device (the
cluster's ``--devices`` entry for it, as ``serve --replicas N`` places it), started by the
cluster's own ``Replica`` class, and each driven through HTTP by an ``orthrus-real bench``
process with a steady mixed closed-loop load (``neighbour_load``) for as long as the
profile runs. A neighbour that dies meanwhile fails the calibration: it would not have seen
the load it claims.

The serving load that follows the grid (``served_load``) runs as the cluster itself: N unified
IBS replicas (``serve --replicas N``, one per device) behind the gateway, driven through its
endpoint by a bench client in this process, and every replica's iterations (``GET
/iterations``) are rows of the calibration. On a machine whose cores the engines share with the
gateway, the client and each replica's own HTTP server, those rows carry what that costs the
engines when every one of them is busy, which neither a lone profile nor neighbours alone see.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orthrus_real.cluster.devices import Device
from orthrus_real.cluster.replicas import (
    Replica,
    ReplicaSpec,
    ServeOptions,
    die_with_parent,
    free_port,
    scheduler_overrides,
    stop_all,
)
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.experiment.plan import ReplicaPlan

KV_CACHE_TOKENS = 32768  # each neighbour's and each served replica's (serve's default)
LOAD_CLIENTS = 8  # closed-loop clients on each neighbour: its share of the cluster's 16
WARM_S = 2.0  # after the loads start, before profiling: every neighbour iterating


def neighbour_load(seed: int, clients: int = LOAD_CLIENTS) -> dict:
    """The scenario a neighbour serves while the profile runs: half embeddings, half
    generations, the calibration load's lengths (``calibrate.LOAD_LENGTHS``), a day long (the
    load is stopped when the profile ends)."""
    from orthrus_real.measure.calibrate import LOAD_LENGTHS

    return {"name": f"calibration-neighbour-{seed}", "seed": seed, "duration_s": 86400,
            "workload": {"arrival": {"process": "closed-loop", "clients": clients},
                         "generation_share": 0.5, **LOAD_LENGTHS}}


class Neighbours:
    """N-1 serving engines on this machine for the length of a ``with`` block."""

    def __init__(self, devices: list[Device], model: str, adapter: str | None,
                 scheduler: SchedulerConfig, threads: int, kv_cache_tokens: int,
                 backend: str = "torch", clients: int = LOAD_CLIENTS) -> None:
        from orthrus_sim.costmodel import LoRASpec, get_model

        spec_model = get_model(model)
        lora = None
        if adapter:
            from orthrus_real.engine.model_files import adapter_rank

            lora = LoRASpec(adapter_rank(adapter))
        plan = ReplicaPlan("unified", "ibs", scheduler, spec_model, lora)
        self.replicas = [Replica(ReplicaSpec(i + 1, plan, dev, threads or len(dev.cpus or ()),
                                             adapter)) for i, dev in enumerate(devices)]
        self.options = ServeOptions(model, kv_cache_tokens=kv_cache_tokens, backend=backend,
                                    log_level="warning")
        self.clients = clients
        self.loads: list[tuple[subprocess.Popen, Path]] = []  # each load and its log
        self._dir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Neighbours:
        import yaml

        self._dir = tempfile.TemporaryDirectory(prefix="orthrus-neighbours-")
        try:
            for r in self.replicas:
                r.start(self.options)
            for r in self.replicas:
                r.wait_ready(300)
            for r in self.replicas:
                path = Path(self._dir.name) / f"load-{r.index}.yaml"
                path.write_text(yaml.safe_dump(neighbour_load(r.index, self.clients)))
                log_path = path.with_suffix(".log")
                with log_path.open("wb") as log:  # a file: a pipe could fill and stall the load
                    self.loads.append((subprocess.Popen(
                        [sys.executable, "-m", "orthrus_real.cli", "bench", str(path), "--url",
                         r.url, "--out", str(Path(self._dir.name) / f"out-{r.index}"),
                         "--format", "json"],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        preexec_fn=die_with_parent), log_path))
            time.sleep(WARM_S)
            self.check()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self) -> None:
        """Raise when a neighbour's engine or its load has stopped."""
        for r in self.replicas:
            code = r.exited()
            if code is not None:
                raise RuntimeError(f"neighbour replica {r.index} (on {r.spec.device}) exited with "
                                   f"code {code} during the co-located profile; its log is above")
        for r, (load, log_path) in zip(self.replicas, self.loads):
            code = load.poll()
            if code is not None:
                said = _last_line(log_path)
                raise RuntimeError(f"the load on neighbour replica {r.index} stopped (exit {code}) "
                                   f"during the co-located profile: {said}")

    def iterations(self) -> list[int]:
        """Forward passes each neighbour's engine has run (``orthrus_iterations_total`` of its
        /metrics; -1 where it did not answer): a neighbour that ran few was not much of a load."""
        import re

        import httpx

        out = []
        for r in self.replicas:
            try:
                text = httpx.get(r.url + "/metrics", timeout=5).text
                found = re.search(r"^orthrus_iterations_total(?:\{[^}]*\})? (\S+)$", text, re.M)
                out.append(int(float(found.group(1))) if found else -1)
            except httpx.HTTPError:
                out.append(-1)
        return out

    def close(self) -> None:
        for load, _ in self.loads:
            if load.poll() is None:
                load.kill()
            load.wait()
        self.loads = []
        stop_all(self.replicas)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def _last_line(log_path: Path) -> str:
    """The last line a neighbour's load wrote."""
    try:
        text = log_path.read_text(errors="replace").strip()
    except OSError:
        return "no message"
    return text.splitlines()[-1] if text else "no message"


def served_load(devices: list[Device], model: str, adapter: str | None,
                scheduler: SchedulerConfig, threads: int, kv_cache_tokens: int, seconds: float,
                backend: str = "torch") -> tuple[list[dict], list[int]]:
    """The calibration's mixed load (``calibrate.load_scenario_for``) served by a cluster of
    ``len(devices)`` unified IBS replicas behind the gateway, as ``serve --replicas N`` runs
    it; returns every replica's iterations as calibration rows (category ``load``) and how many
    each replica ran."""
    import httpx

    from orthrus_real.measure.calibrate import load_scenario_for
    from orthrus_real.measure.validate import fetch_iterations, serve_and_bench

    port = free_port()
    cmd = [sys.executable, "-m", "orthrus_real.cli", "serve", "--model", model, "--port", str(port),
           "--replicas", str(len(devices)), "--configuration", "orthrus",
           "--devices", ";".join(str(d) for d in devices),
           *scheduler_overrides(scheduler, False), "--kv-cache-tokens", str(kv_cache_tokens),
           "--max-queued", "100000", "--backend", backend, "--log-level", "warning"]
    if threads:
        cmd += ["--threads", str(threads)]
    if adapter:
        cmd += ["--embedding-adapter", adapter]
    rows: list[dict] = []
    counts: list[int] = []

    def collect(url: str) -> None:  # every replica's record, before the cluster stops
        for r in httpx.get(url + "/health", timeout=10).json()["replicas"]:
            got = fetch_iterations(r["url"]) or []
            counts.append(len(got))
            rows.extend({"category": "load", "point": -1, "seconds": it["seconds"], **it["shape"]}
                        for it in got)

    with tempfile.TemporaryDirectory(prefix="orthrus-served-load-") as tmp:
        log = Path(tmp) / "cluster.log"
        try:
            serve_and_bench(cmd, port, load_scenario_for(seconds), "calibration-load", log,
                            start_timeout=300, before_stop=collect, preexec_fn=die_with_parent)
        except RuntimeError as exc:
            raise RuntimeError(f"the calibration's cluster failed ({exc}): "
                               f"{_last_line(log)}") from None
    return rows, counts


def profile_colocated(devices: list[Device], model: str, adapter: str | None,
                      scheduler: SchedulerConfig, grid: list, repeats: int, load_seconds: float,
                      threads: int = 0, backend: str = "torch", progress=None,
                      status=None) -> tuple[list[dict], dict]:
    """``calibrate --colocated N``: the grid on an engine on ``devices[0]`` while neighbours
    serve a mixed load on the others, then ``load_seconds`` of the calibration's load served by
    a cluster of them all (``served_load``); returns the rows and where they were measured
    (``engine_environment`` plus ``colocated``, the neighbours' devices and iterations, and the
    served replicas' iterations)."""
    from contextlib import nullcontext

    from orthrus_real.engine.device import pin_process
    from orthrus_real.measure.calibrate import profile_engine

    with Neighbours(devices[1:], model, adapter, scheduler, threads, KV_CACHE_TOKENS,
                    backend) as near:
        everywhere = os.sched_getaffinity(0)
        pin_process(devices[0].cpus)  # the neighbours and their loads were started unpinned
        try:
            rows, env = profile_engine(model, adapter, scheduler, grid, repeats, 0, threads,
                                       backend, devices[0].torch_device, progress)
        finally:
            os.sched_setaffinity(0, everywhere)  # the served load's client runs anywhere
        near.check()  # every neighbour served through the whole profile
        env.update(colocated=len(devices), neighbour_devices=[str(d) for d in devices[1:]],
                   neighbour_iterations=near.iterations())
    if load_seconds > 0:
        with (status or nullcontext)(f"serving {load_seconds:.0f} s of mixed load on a cluster "
                                     f"of {len(devices)} replicas"):
            load, counts = served_load(devices, model, adapter, scheduler, threads,
                                       KV_CACHE_TOKENS, load_seconds, backend)
        rows += load
        env["served_iterations"] = counts
    return rows, env
