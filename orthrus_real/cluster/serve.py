"""``orthrus-real serve --replicas N``: the scenario's plan on N replicas, behind one gateway."""

from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor

from orthrus_real.cluster.machine_plan import ClusterArgs, make_replicas, real_scenario
from orthrus_real.cluster.replicas import (
    Replica,
    ServeOptions,
    check_configuration,
    stop_all,
)
from orthrus_real.cluster.retry import RetryRules
from orthrus_sim.experiment.scenario import Scenario, load_scenario, parse_scenario

log = logging.getLogger("orthrus")


def cluster_from_cli(o: dict, chunk: int | str | None):
    """``serve``'s options (by name) -> a function that runs the cluster: the replicas are
    started and ready when this returns (errors raise ValueError/RuntimeError first)."""
    if o["replicas"] is not None and o["replicas"] < 1:
        raise ValueError(f"--replicas must be >= 1, got {o['replicas']}")
    if o["retries"] < 0:
        raise ValueError(f"--retries must be >= 0, got {o['retries']}")
    if not 0 <= o["retry_budget"] <= 1:
        raise ValueError(f"--retry-budget must be in [0, 1], got {o['retry_budget']}")
    opts = ServeOptions(str(o["model"]), o["kv_cache_tokens"], o["max_queued"], o["max_body_bytes"],
                        o["served_model_name"], o["pooling"], o["dtype"], o["backend"],
                        o["max_inputs_per_request"], o["calibration"],
                        model_limit_given=o["max_model_len"] is not None,
                        log_level=o["log_level"], api_key=o["api_key"],
                        attention=o["attention"], cuda_graphs=o["cuda_graphs"],
                        static_step=o["static_step"], cpu_gemm=o["cpu_gemm"],
                        retry=RetryRules(per_request=o["retries"], budget=o["retry_budget"]))
    adapter = o["embedding_adapter"]
    args = ClusterArgs(o["replicas"], o["configuration"], o["devices"] or o["device"], o["router"],
                       o["threads"], str(adapter) if adapter else None, o["auto_restart"])
    knobs = [f"scheduler.{k}={v}" for k, v in (("token_budget", o["token_budget"]),
                                               ("chunk_size", chunk),
                                               ("max_num_seqs", o["max_num_seqs"]))
             if v is not None]
    scenario, configuration = cluster_scenario(o["scenario"], o["set_"], knobs, o["policy"], args,
                                               opts)
    opts.calibration = opts.calibration or scenario.calibration_file
    if o["ray"]:
        from orthrus_real.cluster.ray_app import prepare_ray

        return prepare_ray(o["ray"], scenario, configuration, args, opts, o["host"], o["port"],
                           o["sock"])
    gateway = build_cluster(scenario, configuration, args, opts)
    return lambda: serve_cluster(gateway, o["host"], o["port"], o["sock"], o["log_level"],
                                 opts.max_body_bytes, opts.api_key)


def cluster_scenario(scenario: str | None, set_: list[str], knobs: list[str], policy: str,
                     args: ClusterArgs, opts: ServeOptions) -> tuple[Scenario, str]:
    """The scenario whose plan the replicas run (``--scenario``, or one made of the command
    line's knobs), with this model, its engines' KV capacity and ``--replicas`` GPUs; and the
    configuration served."""
    from orthrus_real.engine.model_files import adapter_rank

    if scenario is None:
        # the clients are not known: open-loop arrivals, so the adaptive planner weighs the
        # rates it observes (routing.closed_loop) rather than clients that wait for answers
        raw = {"name": "serve", "num_requests": 1, "model": opts.model,
               "workload": {"arrival": {"process": "poisson", "rate": 1.0}},
               "scheduler": {"policy": policy} if policy != "ibs" else {},
               "configurations": [args.configuration or "orthrus"]}
        if args.replicas:
            raw["cluster"] = {"gpus": args.replicas}
        sc = parse_scenario(raw, "serve", [*knobs, *set_], check_fit=False)
    else:
        sc = load_scenario(scenario, set_)
    configuration = args.configuration or sc.configurations[0]
    check_configuration(configuration)
    rank = adapter_rank(args.adapter) if args.adapter else None
    return real_scenario(sc, opts.model, rank, opts.calibration, opts.kv_cache_tokens,
                         gpus=args.replicas or sc.cluster.gpus, configurations=[configuration],
                         router=args.router), configuration


def start_replicas(replicas: list[Replica], opts: ServeOptions, timeout: float) -> None:
    """Start every engine process, wait until all are ready (any failure stops them all)."""
    for r in replicas:
        r.start(opts)
    try:
        with ThreadPoolExecutor(len(replicas)) as pool:
            for future in [pool.submit(r.wait_ready, timeout) for r in replicas]:
                future.result()
    except BaseException:
        stop_all(replicas)
        raise


def make_gateway(scenario: Scenario, replicas: list[Replica], opts: ServeOptions,
                 auto_restart: bool, start_timeout: float):
    """The gateway over ``replicas`` with the scenario's routing rule."""
    from orthrus_real.cluster.gateway import Gateway
    from orthrus_sim.routing.rules import RouterRule

    rule = RouterRule.of(scenario, replicas[0].spec.plan.config.tpot_target_s)
    return Gateway(replicas, opts, rule, auto_restart, opts.api_key, start_timeout)


def build_cluster(scenario: Scenario, configuration: str, args: ClusterArgs, opts: ServeOptions):
    """The replicas (started and ready) and their gateway."""
    replicas = make_replicas(scenario, configuration, args)
    gateway = make_gateway(scenario, replicas, opts, args.auto_restart, args.start_timeout)
    log.info("cluster: %s on %d replica(s), router %s", configuration, len(replicas),
             gateway.router.rule)
    start_replicas(replicas, opts, args.start_timeout)
    gateway.reroute()
    for r in replicas:
        log.info("%s", r.describe())
    return gateway


def serve_cluster(gateway, host: str, port: int, sock: socket.socket, log_level: str,
                  max_body_bytes: int, api_key: str | None, drain_timeout: float = 300.0) -> None:
    """Run the gateway until SIGTERM/SIGINT: drain it (new requests 503, those in flight
    finish), then drain and stop every replica."""
    import uvicorn

    from orthrus_real.cluster.gateway_app import create_gateway_app
    from orthrus_real.server.serving import KEEP_ALIVE_S, MAX_HEAD, DrainingServer

    app = create_gateway_app(gateway, max_body_bytes, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http="h11",
                            timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEAD,
                            timeout_graceful_shutdown=drain_timeout)
    try:
        DrainingServer(config, gateway, drain_timeout).run(sockets=[sock])
    finally:  # the app's shutdown stopped them; this only when it never started
        stop_all(gateway.replicas)
