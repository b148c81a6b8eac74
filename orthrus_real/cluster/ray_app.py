"""The cluster as a Ray Serve application (``orthrus-real serve --ray local|auto``).

Each replica of the plan is one Ray Serve deployment of one replica, ``EngineServer``: it holds
one engine (the single-engine server of ``orthrus_real.server.serving``, in the deployment replica's
own process, on the node Ray placed it on: a GPU each with ``num_gpus=1``). The ingress
deployment is the gateway (``orthrus_real.cluster.gateway``) with the project's router in front
of them, serving the OpenAI routes unchanged through Ray Serve's HTTP proxy.

Why in front and not as Ray Serve's ``RequestRouter``: a request router picks among the
replicas of *one* deployment, which Ray assumes interchangeable, and sees a request only as
its call arguments and queue lengths; the project's router places requests on replicas with
different roles (a dedicated split's embedding and generation replicas are different engines),
counts each request's tokens from arrival to end (``route`` and ``release``) and, for the rules
that predict, reads each replica's cost model. An ingress that routes is that, with no second
routing rule: Ray Serve places, health-checks and restarts the replicas, the gateway routes.

The gateway streams to each engine over HTTP (the engine's own server, on its node's address),
so a token reaches the client as soon as the engine emits it. A replica that dies is taken out
of routing by the gateway as in a local cluster, its requests in flight end with an error, and
Ray Serve starts a new one, which the gateway routes to once it answers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from orthrus_real.cluster.machine_plan import make_replicas
from orthrus_real.cluster.replicas import Replica, ReplicaSpec, ServeOptions
from orthrus_sim.routing.rules import RouterRule

log = logging.getLogger("orthrus")
APP_NAME = "orthrus"


class EngineServer:
    """One replica's engine and its HTTP server, inside a Ray Serve deployment replica."""

    def __init__(self, spec: ReplicaSpec, opts: ServeOptions) -> None:
        import ray

        from orthrus_real.engine.device import pin_process
        from orthrus_real.server.serving import bind_socket, build, serve, setup_logging, wait_healthy

        setup_logging(opts.log_level)
        pin_process(set(spec.device.cpus) if spec.device.cpus else None)
        device = "cuda" if spec.device.kind == "cuda" else "cpu"  # Ray's GPU: cuda:0 here
        calibration = opts.calibration if spec.plan.config.tpot_target_s is not None else None
        self.app, self.runner = build(
            opts.model, spec.adapter, spec.plan.policy, spec.plan.config, opts.kv_cache_tokens,
            opts.max_queued, opts.max_body_bytes,
            opts.served_model_name or os.path.basename(opts.model.rstrip("/")), device,
            opts.dtype, opts.pooling, spec.threads, opts.backend, opts.api_key,
            opts.max_inputs_per_request, calibration=calibration,
            engine_options={"attention": opts.attention, "cuda_graphs": opts.cuda_graphs,
                            "static_step": opts.static_step, "cpu_gemm": opts.cpu_gemm})
        host = ray.util.get_node_ip_address()
        sock = bind_socket(host, 0)
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.server = threading.Thread(target=serve, args=(self.app, self.runner, host),
                                       kwargs=dict(sock=sock, log_level="warning"), daemon=True)
        self.server.start()
        wait_healthy(self.url, 60.0)
        log.info("replica %d: %s engine at %s (pid %d)", spec.index, spec.role, self.url,
                 os.getpid())

    def info(self) -> dict:
        return {"url": self.url, "pid": os.getpid()}

    def check_health(self) -> None:
        """Ray Serve's health check: a failed engine or a stopped server gets replaced."""
        if self.runner.failed:
            raise RuntimeError(f"engine failed: {self.runner.failed}")
        if not self.server.is_alive():
            raise RuntimeError("the engine's HTTP server stopped")

    def exit(self, pid: int) -> None:
        """Restart: the process ``pid`` ends (Ray Serve starts a new replica); a newer one
        ignores it."""
        if pid == os.getpid():
            threading.Timer(0.1, os._exit, args=(1,)).start()


@dataclass(eq=False)
class RayReplica(Replica):
    """A replica that Ray Serve runs: the gateway reaches it through its deployment handle for
    where it listens, and over HTTP for requests."""

    handle: Any = None
    _url: str = ""
    _pid: int | None = None

    @property
    def url(self) -> str:
        return self._url

    @property
    def pid(self) -> int | None:
        return self._pid

    def exited(self) -> int | None:
        return None  # Ray Serve watches the process; the gateway sees a dead one by /health

    def kill(self) -> None:
        """Ray Serve's health check replaces a replica that hangs."""

    def start(self, opts: ServeOptions) -> None:
        """Ray Serve starts the replacement itself."""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        self.up = False
        if self._pid is not None:
            self.handle.exit.remote(self._pid)

    def wait_ready(self, timeout: float) -> None:
        """Until a replica process other than the one before answers (its URL, then /engine)."""
        import httpx

        old = self._pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                info = self.handle.info.remote().result(timeout_s=10)
            except Exception:  # noqa: BLE001 - Ray is replacing it: ask again
                time.sleep(0.5)
                continue
            if info["pid"] == old:
                time.sleep(0.2)
                continue
            try:
                r = httpx.get(info["url"] + "/engine", timeout=5, headers=self._headers)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if r.status_code == 200:
                self._url, self._pid = info["url"], info["pid"]
                self.ready(r.json())
                return
        raise RuntimeError(f"replica {self.index} did not become ready within {timeout:.0f} s")


class GatewayIngress:
    """The ingress deployment: the gateway over the engine deployments' handles."""

    def __init__(self, engines: list, replicas: list[RayReplica], opts: ServeOptions,
                 rule: RouterRule) -> None:
        from orthrus_real.cluster.gateway import Gateway
        from orthrus_real.server.serving import setup_logging

        setup_logging(opts.log_level)
        for replica, handle in zip(replicas, engines):
            replica.handle = handle
            replica._headers = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.opts = opts
        self.gateway = Gateway(replicas, opts, rule, auto_restart=True, api_key=opts.api_key)
        self.gateway.owns_replicas = False

    def __serve_build_asgi_app__(self):
        from orthrus_real.cluster.gateway_app import create_gateway_app

        return create_gateway_app(self.gateway, self.opts.max_body_bytes, self.opts.api_key)

    async def drain(self, timeout: float = 300.0) -> int:
        return await self.gateway.drain(timeout)


def ray_resources(spec: ReplicaSpec) -> dict:
    """What Ray reserves for one engine: its GPU, or its threads' cores."""
    if spec.device.kind == "cuda":
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": max(spec.threads, 1)}


def build_app(replicas: list[RayReplica], opts: ServeOptions, router: RouterRule):
    """The Ray Serve application: one engine deployment per replica, the gateway in front."""
    from ray import serve

    engine = serve.deployment(EngineServer, health_check_period_s=2, health_check_timeout_s=30,
                              graceful_shutdown_timeout_s=60, max_ongoing_requests=16)
    ingress = serve.deployment(serve.ingress()(GatewayIngress), ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000, graceful_shutdown_timeout_s=300)
    engines = [engine.options(name=f"replica-{r.index}", ray_actor_options=ray_resources(r.spec))
               .bind(r.spec, opts) for r in replicas]
    return ingress.options(name="gateway").bind(engines, replicas, opts, router)


def prepare_ray(address: str, scenario, configuration: str, args, opts: ServeOptions, host: str,
                port: int, sock) -> Any:
    """The replicas of the plan as a Ray Serve application on a local Ray instance
    (``local``) or a running Ray cluster (``auto`` or its address); returns what runs it until
    SIGTERM/SIGINT (then the gateway drains and the application shuts down)."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise ValueError("--ray needs Ray Serve: pip install -e '.[serve]' (ray[serve])") from None
    replicas = make_replicas(scenario, configuration, args, RayReplica)
    router = RouterRule.of(scenario, replicas[0].spec.plan.config.tpot_target_s)
    sock.close()  # Ray Serve's proxy listens there

    def run() -> None:
        import ray
        from ray import serve

        local = address == "local"
        # a local instance offers this machine's cores, or as many as the replicas ask for
        # (replicas given the same core share it, as without Ray)
        cpus = max(os.cpu_count() or 1, sum(ray_resources(r.spec)["num_cpus"] for r in replicas))
        ray.init(address=None if local else address, num_cpus=cpus if local else None,
                 include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
        # right after ray.init (whose core worker installs a handler that ends the process): a
        # SIGTERM while the application still starts must drain it, not kill the driver
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
        log.info("cluster: %s on %d Ray Serve replica(s), router %s", configuration,
                 len(replicas), scenario.cluster.router)
        gateway = serve.run(build_app(replicas, opts, router), name=APP_NAME, route_prefix="/")
        for r in replicas:
            log.info("replica %d: role %s, device %s, policy %s (a Ray Serve deployment)",
                     r.index, r.role, r.spec.device, r.spec.plan.policy)
        log.info("orthrus ready: http://%s:%d", host, port)
        stop.wait()
        log.info("draining: new requests get 503")
        left = gateway.drain.remote().result(timeout_s=400)
        if left:
            log.warning("%d request(s) still in flight after the drain timeout", left)
        serve.shutdown()
        ray.shutdown()
        log.info("stopped")

    return run
