"""Which replica runs where, and the engine process of each.

The placement is the simulator's: ``plan_configuration`` (orthrus_sim.experiment.plan) gives
each replica's role, policy and ``SchedulerConfig`` for a configuration, exactly as the
simulated cluster gets them. Each replica is then one ``orthrus-real serve`` child process on
its own loopback port and device: the single-engine server unchanged (its drain, metrics,
errors), one interpreter per engine (no GIL or torch thread pool shared between replicas, one
CUDA context per GPU), and a replica that crashes takes only itself down; restarting it is
starting the process again.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields, replace
from types import SimpleNamespace

from orthrus_real.cluster.devices import Device, cpus_text
from orthrus_real.cluster.retry import RetryRules
from orthrus_real.engine.settings import EXECUTOR_FIELDS
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.experiment.plan import ReplicaPlan, plan_configuration
from orthrus_sim.experiment.scenario import Scenario, is_unified

log = logging.getLogger("orthrus")
PROBES = re.compile(r'"GET /(health|metrics|engine|v1/models) HTTP')  # the gateway's own calls
SERVES = {"unified": ("embedding", "generation"), "embedding": ("embedding",),
          "generation": ("generation",)}


def check_configuration(name: str) -> None:
    """The configurations real replicas can run (Disagg-PD would move KV between engines)."""
    if name.startswith("disagg-pd"):
        raise ValueError(f"--configuration {name}: Disagg-PD hands each prompt's KV cache from a "
                         "prefill engine to a decode engine, and KV transfer between engines is "
                         "not built; serve orthrus, unified-hetero, unified-homo, unified:<policy> "
                         "or dedicated-E:G")
    if not (is_unified(name) or name.startswith("dedicated")):
        raise ValueError(f"--configuration {name!r}: expected orthrus, unified-hetero, "
                         "unified-homo, unified:<policy> or dedicated-E:G")


@dataclass
class ReplicaSpec:
    """What one replica's engine process runs."""

    index: int
    plan: ReplicaPlan  # role, policy and SchedulerConfig, the simulator's
    device: Device
    threads: int  # torch threads (0: torch's default)
    adapter: str | None  # the embedding adapter this replica loads (none on generation replicas)

    @property
    def role(self) -> str:
        return self.plan.role


def plan_replicas(scenario: Scenario, configuration: str, devices: list[Device], threads: int,
                  adapter: str | None) -> list[ReplicaSpec]:
    """One spec per ``cluster.gpus`` replica, placed as the simulator places them.

    A dedicated embedding replica is given the embedding adapter and, serving embeddings
    only, folds it into its weights at load (the merged embedding model the plan prices:
    ``Decoder.merge_adapter``); a generation replica loads the base model alone."""
    check_configuration(configuration)
    plans = plan_configuration(scenario, configuration)
    if len(devices) != len(plans):
        raise ValueError(f"{len(plans)} replicas (cluster.gpus) but {len(devices)} devices")
    return [ReplicaSpec(i, plan, dev, threads or len(dev.cpus or ()),
                        adapter if plan.role != "generation" else None)
            for i, (plan, dev) in enumerate(zip(plans, devices))]


def scheduler_overrides(config: SchedulerConfig, model_limit_given: bool) -> list[str]:
    """``--set scheduler.FIELD=VALUE`` for every field a replica's config fixes (the engine
    sizes its KV cache and block size itself; the length limit only when the scenario set it)."""
    out = []
    for f in fields(SchedulerConfig):
        if f.name in EXECUTOR_FIELDS and not (f.name == "max_model_len" and model_limit_given):
            continue
        value = getattr(config, f.name)
        out += ["--set", f"scheduler.{f.name}={'null' if value is None else value}"]
    return out


@dataclass
class ServeOptions:
    """The single-engine server's options every replica shares."""

    model: str
    kv_cache_tokens: int = 32768
    max_queued: int = 1024
    max_body_bytes: int = 1 << 20
    served_model_name: str | None = None
    pooling: str = "mean"
    dtype: str | None = None
    backend: str = "torch"
    max_inputs_per_request: int = 256
    calibration: str | None = None
    model_limit_given: bool = False  # the scenario sets scheduler.max_model_len
    log_level: str = "info"
    api_key: str | None = None  # the gateway's; each replica requires it too
    attention: str | None = None  # the engine's hot path (serve --attention, ...): as given
    cuda_graphs: bool | None = None
    static_step: bool | None = None
    cpu_gemm: str | None = None
    retry: RetryRules = field(default_factory=RetryRules)  # the gateway's (serve --retries ...)


def child_command(spec: ReplicaSpec, opts: ServeOptions, port: int) -> list[str]:
    """The ``orthrus-real serve`` command line of one replica."""
    plan = spec.plan
    cmd = [sys.executable, "-m", "orthrus_real.cli", "serve", "--model", opts.model,
           "--port", str(port), "--policy", plan.policy,
           *scheduler_overrides(plan.config, opts.model_limit_given),
           "--kv-cache-tokens", str(opts.kv_cache_tokens), "--max-queued", str(opts.max_queued),
           "--max-body-bytes", str(opts.max_body_bytes), "--pooling", opts.pooling,
           "--device", spec.device.torch_device, "--threads", str(spec.threads),
           "--backend", opts.backend, "--max-inputs-per-request", str(opts.max_inputs_per_request),
           "--log-level", opts.log_level,
           "--served-model-name", opts.served_model_name or os.path.basename(opts.model.rstrip("/"))]
    if spec.device.cpus:
        cmd += ["--cpus", cpus_text(spec.device.cpus)]
    if spec.adapter:
        cmd += ["--embedding-adapter", spec.adapter]
    if opts.dtype:
        cmd += ["--dtype", opts.dtype]
    if opts.calibration and plan.config.tpot_target_s is not None:
        cmd += ["--calibration", opts.calibration]
    if opts.attention:
        cmd += ["--attention", opts.attention]
    if opts.cpu_gemm:
        cmd += ["--cpu-gemm", opts.cpu_gemm]
    for flag, value in (("cuda-graphs", opts.cuda_graphs), ("static-step", opts.static_step)):
        if value is not None:
            cmd.append(f"--{flag}" if value else f"--no-{flag}")
    return cmd


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the gateway process dies (Linux), so no engine
    outlives it; and a session of its own, so a terminal's Ctrl-C reaches the gateway only
    (which drains the replicas in order)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(eq=False)  # identity: the router compares replicas and keeps them in sets
class Replica:
    """One replica as the router and the gateway see it: what ``routing.Router`` reads
    (``index``, ``role``, ``outstanding_work``, and for the rules that predict, ``cost`` and
    ``policy.config``), its process and whether it is up."""

    spec: ReplicaSpec
    cost: object | None = None  # the plan's cost model (what the predicting rules read)
    port: int = 0
    process: subprocess.Popen | None = None
    up: bool = False
    draining: bool = False  # up, but routed nothing new (a drain, or it answered 503 draining)
    stalled: bool = False  # up, but late to answer /health: routed nothing until it answers
    last_heard: float = 0.0  # time.monotonic() of its last answer bytes to the gateway
    outstanding_work: int = 0  # tokens routed here and not finished
    flights: set = field(default_factory=set)  # the gateway's attempts (relay.Attempt) here now
    restarts: int = 0
    engine: dict = field(default_factory=dict)  # what the engine logged it loaded (/engine)
    last_exit: str | None = None
    _headers: dict = field(default_factory=dict)
    _log_thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.policy = SimpleNamespace(config=self.spec.plan.config)

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def routable(self) -> bool:
        """Up, and new requests may go to it."""
        return self.up and not self.draining and not self.stalled

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def ready(self, engine: dict) -> None:
        """The engine answered (``/engine``): routed to from now on, its own KV capacity in
        place of the plan's (the rules that count blocks)."""
        self.engine = engine
        self.policy.config = replace(self.spec.plan.config, num_blocks=engine["num_blocks"],
                                     block_size=engine["block_size"])
        self.up, self.draining, self.stalled = True, False, False

    # ----- the process ----------------------------------------------------------------------
    def start(self, opts: ServeOptions) -> None:
        """Start the engine process (on a fresh port); its log lines come out prefixed."""
        self.port = free_port()
        self.up = False
        self._headers = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        env = {**os.environ, "ORTHRUS_API_KEY": opts.api_key} if opts.api_key else None
        self.process = subprocess.Popen(child_command(self.spec, opts, self.port), env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        self._log_thread = threading.Thread(target=self._relay, args=(self.process,), daemon=True,
                                            name=f"replica-{self.index}-log")
        self._log_thread.start()

    def _relay(self, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line and not PROBES.search(line):
                sys.stderr.write(f"[replica {self.index}] {line}\n")
        sys.stderr.flush()

    def exited(self) -> int | None:
        """The exit code once the process has ended (None while it runs, or never started)."""
        return None if self.process is None else self.process.poll()

    def wait_ready(self, timeout: float) -> None:
        """Until the replica answers /health (raises if it exits or time runs out)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.exited()
            if code is not None:
                raise RuntimeError(f"replica {self.index} ({self.role} on {self.spec.device}) exited "
                                   f"with code {code} before it was ready; its log is above")
            try:
                r = httpx.get(self.url + "/engine", timeout=2, headers=self._headers)
                if r.status_code == 200:
                    self.ready(r.json())
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"replica {self.index} did not become ready within {timeout:.0f} s")

    def kill(self) -> None:
        """End a replica that stopped answering (before it is started again)."""
        if self.exited() is None:
            self.process.kill()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        """Signal the process and wait for it (SIGTERM drains it: requests in flight finish)."""
        self.up = False
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def describe(self) -> str:
        e = self.engine
        return (f"replica {self.index}: role {self.role}, device {self.spec.device}, "
                f"model {e.get('model', '?')}, policy {self.spec.plan.policy}, "
                f"kv_cache {e.get('kv_cache', '?')}, threads {e.get('threads', '?')}, "
                f"adapter {e.get('embedding_adapter', 'none')}, at {self.url}")

    def status(self) -> dict:
        return {"replica": self.index, "role": self.role, "device": str(self.spec.device),
                "policy": self.spec.plan.policy, "up": self.up, "draining": self.draining,
                "stalled": self.stalled,
                "pid": self.pid, "url": self.url,
                "outstanding_tokens": self.outstanding_work, "in_flight": len(self.flights),
                "restarts": self.restarts, "last_exit": self.last_exit,
                "kv_cache": self.engine.get("kv_cache")}


def stop_all(replicas: list[Replica]) -> None:
    """SIGTERM each replica (each drains) and wait for all."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(len(replicas), 1)) as pool:
        list(pool.map(lambda r: r.stop(), replicas))
