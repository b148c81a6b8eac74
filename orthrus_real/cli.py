"""``orthrus-real``: run the shared scheduler on real hardware."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from orthrus_real import serve_options as opt
from orthrus_real.serve_options import BACKEND_HELP, KNOB_HELP
from orthrus_sim.console import fail, interrupted, make_console, version_option

app = typer.Typer(help="Orthrus real executors.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None)
console = make_console()

SCENARIO_HELP = "scenario YAML file, or the name of a shipped scenario"


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=version_option("orthrus-real"),
                                      is_eager=True, help="print the version and exit")) -> None:
    """Orthrus real executors."""


@app.command()
def policies() -> None:
    """List the built-in scheduling policies (the names --policy accepts)."""
    from orthrus_sim.engine import POLICIES

    table = Table("name", "serves", "what it does")
    for name, cls in POLICIES.items():
        serves = ", ".join(k.value for k in cls.serves)
        table.add_row(name, serves, escape((cls.__doc__ or "").strip().split("\n")[0]))
    console.print(table)


@app.command("init-model")
def init_model_cmd(
    out_dir: Path = typer.Argument(..., help="directory to write the model into"),
    family: str = typer.Option("llama", help="llama | mistral | qwen2"),
    size: str = typer.Option("tiny", help="tiny (tests) | tiny64 (vLLM tests: head_dim 64) | small "
                                          "(CPU benchmark, ~100 M, bf16) | 1b (GPU benchmark)"),
    seed: int = typer.Option(0),
    dtype: str = typer.Option(None, help="float32 | bfloat16 (default: the size's)"),
    shards: int = typer.Option(1, help="split the weights into this many safetensors files"),
    adapter_rank: int = typer.Option(0, help="also write a PEFT LoRA adapter of this rank to DIR/adapter"),
) -> None:
    """Write a seeded random model (config.json, safetensors, tokenizer.json) in HF layout."""
    from orthrus_real.engine.init_model import init_model

    try:
        path = init_model(out_dir, family, size, seed, dtype, shards, adapter_rank or None)
    except ValueError as exc:
        fail(exc)
    console.print(f"wrote {family}/{size} model to {path}"
                  + (f" with a rank-{adapter_rank} adapter in {path / 'adapter'}" if adapter_rank else ""),
                  highlight=False)


def _chunk(value: str | None) -> int | None | str:
    """``--chunk-size``: tokens, or none/null for atomic embeddings (None: not given)."""
    if value is None:
        return None
    if value.lower() in ("none", "null"):
        return "null"
    try:
        return int(value)
    except ValueError:
        fail(f"--chunk-size must be a number of tokens or 'none', got {value!r}")


def scheduler_settings(scenario: str | None, configuration: str | None, set_: list[str],
                       policy: str, token_budget: int | None = None, chunk_size: str | None = None,
                       max_num_seqs: int | None = None):
    """The policy and ``SchedulerConfig`` to serve: from a scenario through the plan (the same
    mapping the simulator uses), or from the command-line knobs and ``--set scheduler.FIELD=V``
    (every field of ``SchedulerConfig``, its defaults the core's)."""
    return _settings(scenario, configuration, set_, policy, token_budget, chunk_size,
                     max_num_seqs)[:2]


def _settings(scenario, configuration, set_, policy, token_budget=None, chunk_size=None,
              max_num_seqs=None):
    """``scheduler_settings`` plus the scenario's calibration (None without a scenario)."""
    from orthrus_real.engine.settings import cli_config

    if scenario is None:
        if configuration is not None:
            raise ValueError("--configuration needs --scenario")
        chunk = _chunk(chunk_size)
        knobs = [f"scheduler.{k}={v}" for k, v in (("token_budget", token_budget),
                                                   ("chunk_size", chunk),
                                                   ("max_num_seqs", max_num_seqs)) if v is not None]
        return policy, cli_config(knobs + list(set_)), None
    from orthrus_sim.experiment.plan import engine_plan
    from orthrus_sim.experiment.scenario import load_scenario

    sc = load_scenario(scenario, set_)
    return (*engine_plan(sc, configuration or sc.configurations[0]), sc.calibration_file)


@app.command()
def serve(
    model: opt.Model, embedding_adapter: opt.EmbeddingAdapter = None,
    served_model_name: opt.ServedModelName = None, pooling: opt.Pooling = "mean",
    max_model_len: opt.MaxModelLen = None,
    policy: opt.PolicyName = "ibs", token_budget: opt.TokenBudget = None,
    chunk_size: opt.ChunkSize = None, max_num_seqs: opt.MaxNumSeqs = None,
    scenario: opt.ScenarioFile = None, configuration: opt.Configuration = None,
    set_: opt.SetField = [], kv_cache_tokens: opt.KvCacheTokens = 32768,  # noqa: B006 (typer's)
    tpot_target: opt.TpotTarget = None, calibration: opt.Calibration = None,
    host: opt.Host = "127.0.0.1", port: opt.Port = 8000, max_queued: opt.MaxQueued = 1024,
    max_body_bytes: opt.MaxBodyBytes = 1 << 20, api_key: opt.ApiKey = None,
    max_inputs_per_request: opt.MaxInputsPerRequest = 256, log_level: opt.LogLevel = "info",
    device: opt.Device = None, dtype: opt.Dtype = None, threads: opt.Threads = 0,
    cpus: opt.Cpus = None, backend: opt.Backend = "torch", attention: opt.Attention = None,
    cuda_graphs: opt.CudaGraphs = None, static_step: opt.StaticStep = None,
    cpu_gemm: opt.CpuGemm = None,
    replicas: opt.Replicas = None, devices: opt.Devices = None, router: opt.Router = None,
    auto_restart: opt.AutoRestart = False, ray: opt.Ray = None, retries: opt.Retries = 2,
    retry_budget: opt.RetryBudget = 0.5,
) -> None:
    """Serve /v1/embeddings, /v1/completions and /v1/chat/completions from one engine (or from
    --replicas N engines behind one endpoint).

    Logs what it loaded, then 'orthrus ready: http://HOST:PORT' once it accepts requests.
    """
    options = dict(locals())
    if not 1 <= port <= 65535:
        fail(f"--port must be between 1 and 65535, got {port}")
    try:
        run = _prepare_serving(options)
    except (ValueError, RuntimeError) as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()
    run()


def _prepare_serving(o: dict):
    """Pin the process, bind the port (before the model loads: a taken port fails at once) and
    build one engine's server or the cluster; returns what runs it until SIGTERM/SIGINT."""
    from orthrus_real.engine.device import parse_cpus, pin_process
    from orthrus_real.server.serving import bind_socket, check_max_model_len, setup_logging

    pinned = parse_cpus(o["cpus"])
    pin_process(pinned)
    o["threads"] = o["threads"] or len(pinned or ())
    setup_logging(o["log_level"])
    for field, value in (("max_model_len", o["max_model_len"]), ("tpot_target_s", o["tpot_target"])):
        if value is not None:  # a field like any other: one path for every override
            o["set_"] = [*o["set_"], f"scheduler.{field}={value}"]
    check_max_model_len(str(o["model"]), o["max_model_len"])
    o["sock"] = bind_socket(o["host"], o["port"])
    if o["replicas"] is not None or o["devices"] or o["router"] or o["ray"] or o["auto_restart"]:
        from orthrus_real.cluster.serve import cluster_from_cli

        return cluster_from_cli(o, _chunk(o["chunk_size"]))
    return _one_engine_server(o)


def _one_engine_server(o: dict):
    """One engine behind the HTTP API, with the scheduler settings of the scenario's plan or of
    the command line's knobs."""
    from orthrus_real.server.serving import build
    from orthrus_real.server.serving import serve as run_server

    policy, sched, scenario_calibration = _settings(o["scenario"], o["configuration"], o["set_"],
                                                    o["policy"], o["token_budget"],
                                                    o["chunk_size"], o["max_num_seqs"])
    calibration = o["calibration"] or scenario_calibration  # a scenario's target: its model
    adapter = str(o["embedding_adapter"]) if o["embedding_adapter"] else None
    engine_options = {k: o[k] for k in ("attention", "cuda_graphs", "static_step", "cpu_gemm")}
    app_, runner = build(str(o["model"]), adapter, policy, sched, o["kv_cache_tokens"],
                         o["max_queued"], o["max_body_bytes"], o["served_model_name"], o["device"],
                         o["dtype"], o["pooling"], o["threads"], o["backend"], o["api_key"],
                         o["max_inputs_per_request"], calibration=calibration,
                         engine_options=engine_options)
    return lambda: run_server(app_, runner, o["host"], o["port"], sock=o["sock"],
                              log_level=o["log_level"])


@app.command()
def bench(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP + " (its workload drives the load)"),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="server base URL"),
    out: Path = typer.Option(Path("out/bench"), "--out", help="directory for results.json, CSV, PNGs"),
    set_: list[str] = typer.Option([], "--set", help="override a scenario field: section.key=value"),
    label: str = typer.Option("measured", help="configuration name in results.json"),
    token_range: int = typer.Option(500, help="prompts use random token ids in [4, N)"),
    fmt: str = typer.Option("table", "--format", help="table | csv | json"),
    only: str = typer.Option(None, "--only", help="embedding | generation: send only that kind's "
                             "pools (a dedicated single-kind server)"),
    repeat: int = typer.Option(1, help="run the workload this many times; results.json holds "
                               "every run and their spread (repeats)"),
    client_cpus: str = typer.Option(None, "--client-cpus", help="run this client on these CPUs "
                                    "only (0,1 or 0-3), apart from the server's (serve --cpus)"),
    calibration: Path = typer.Option(None, "--calibration", help="warn when this machine differs "
                                     "from the one this calibration was measured on"),
) -> None:
    """Load-test a live server with a scenario's workload; results in the simulator's schema."""
    import asyncio

    from rich.progress import Progress

    from orthrus_real.engine.device import environment_check, parse_cpus, pin_process
    from orthrus_real.measure.bench import bench as run_bench
    from orthrus_real.measure.bench import repeats_doc, stream_summary, write_results
    from orthrus_sim.experiment.results import print_runs
    from orthrus_sim.experiment.scenario import load_scenario

    try:
        sc = load_scenario(scenario, set_)
        if only:
            from orthrus_sim.experiment.measured import only_kind
            from orthrus_sim.experiment.scenario import parse_scenario, scenario_dump

            sc = parse_scenario(only_kind(scenario_dump(sc), only), f"{scenario} (--only {only})")
        if repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {repeat}")
        pin_process(parse_cpus(client_cpus, "--client-cpus"))
        warning = environment_check(str(calibration)) if calibration else None
    except ValueError as exc:
        fail(exc)
    if warning:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    docs = []
    try:
        with Progress(console=make_console(stderr=True), transient=True) as bar:
            for i in range(repeat):
                task = bar.add_task(f"{sc.name} against {url}" + (f" ({i + 1}/{repeat})" if repeat > 1
                                                                  else ""), total=1.0)
                docs.append(asyncio.run(run_bench(url, sc, label, token_range,
                                                  on_progress=lambda f, t=task: bar.update(t, completed=f))))
    except KeyboardInterrupt:
        interrupted()
    except Exception as exc:  # connection refused, server gone: say so plainly
        fail(f"bench against {url} failed: {exc}", 1)
    doc, rows = repeats_doc(docs)
    for run in doc["runs"]:  # what a fit simulates this run under (orthrus-sim fit)
        run["scenario_overrides"] = list(set_)
    path = write_results(doc, rows, out)
    notes = console if fmt == "table" else make_console(stderr=True)
    print_runs(console, doc["runs"], f"{sc.name} against {url}", fmt, notes=notes)
    if fmt == "table":
        console.print(stream_summary(doc["runs"][0]["metrics"]), highlight=False)
    for metric, s in doc.get("repeats", {}).items():
        cv = "-" if s["cv"] is None else f"{s['cv']:.1%}"
        notes.print(f"{metric}: mean {s['mean']:.4g} over {len(s['values'])} runs, "
                    f"run-to-run CV {cv}", highlight=False)
    notes.print(f"results: {path}", highlight=False)


@app.command()
def calibrate(
    model: Path = typer.Option(..., "--model", help="model directory"),
    embedding_adapter: Path = typer.Option(None, "--embedding-adapter", help="PEFT LoRA adapter"),
    out: Path = typer.Option(..., "--out", help="calibration JSON to write (raw CSV beside it)"),
    hardware: str = typer.Option("cpu-2core", help="hardware catalogue entry the figures refine"),
    repeats: int = typer.Option(3, help="measured runs per grid point (after one warm-up)"),
    quick: bool = typer.Option(False, help="a small grid (smoke tests)"),
    load_seconds: float = typer.Option(60.0, help="seconds of mixed serving load profiled after "
                                                  "the grid (0: grid only)"),
    token_budget: int = typer.Option(None, help=f"tokens per iteration {KNOB_HELP}"),
    set_: list[str] = typer.Option([], "--set", help="scheduler.FIELD=VALUE"),
    threads: int = typer.Option(0, help="torch CPU threads (0: torch's default, or one per --cpus)"),
    cpus: str = typer.Option(None, "--cpus", help="profile on these CPUs only (0,1 or 0-3): the "
                             "arrangement the engine will serve under (serve --cpus)"),
    backend: str = typer.Option("torch", help=BACKEND_HELP),
    colocated: int = typer.Option(1, "--colocated", help="engines on this machine while it is "
                                  "profiled, this one included: N-1 neighbours of the same "
                                  "arrangement serve a mixed load meanwhile, so the calibration "
                                  "sees their interference (a cluster of N replicas here)"),
    devices: str = typer.Option(None, "--devices", help="with --colocated N: one device per "
                                "engine as serve --replicas N --devices takes them (cpu:0,cpu:1); "
                                "the first is the profiled engine's"),
) -> None:
    """Profile the engine over batch compositions, fit the cost model, write a calibration."""
    from rich.progress import Progress

    from orthrus_real.engine.device import parse_cpus, pin_process
    from orthrus_real.engine.model_files import adapter_rank
    from orthrus_real.measure import calibrate as cal

    try:
        placed = _calibration_devices(colocated, devices, cpus)
        pinned = placed[0].cpus if placed else parse_cpus(cpus)
        threads = threads or len(pinned or ())
        rank = adapter_rank(embedding_adapter) if embedding_adapter else None
        adapter = str(embedding_adapter) if embedding_adapter else None
        _, sched = scheduler_settings(None, None, set_, "ibs", token_budget)
        grid = cal.default_grid(quick)
        seconds = min(load_seconds, 6.0) if quick else load_seconds
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("profiling", total=len(grid))
            common = {"threads": threads, "backend": backend,
                      "status": lambda text: _bar_says(bar, task, text),
                      "progress": lambda i, n: bar.update(task, completed=i)}
            if colocated > 1:
                from orthrus_real.measure.colocated import profile_colocated

                console.print(f"starting {colocated - 1} neighbour engine(s) on "
                              f"{', '.join(str(d) for d in placed[1:])}, each under a mixed "
                              "load", highlight=False)
                rows, env = profile_colocated(placed, str(model), adapter, sched, grid, repeats,
                                              seconds, **common)
            else:
                pin_process(pinned)
                rows, env = cal.profile_engine(str(model), adapter, sched, grid, repeats, seconds,
                                               device=placed[0].torch_device if placed else None,
                                               **common)
        calibration, rows = cal.fit(rows, str(model), rank, hardware, backend=backend,
                                    environment=env)
    except (ValueError, RuntimeError) as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()
    csv_path = cal.write(calibration, rows, out)
    table = Table(title=f"Cost-model fit on {len(rows)} iterations ({hardware})")
    table.add_column("rows")
    table.add_column("MAPE", justify="right")
    for key, value in calibration.fit_error.detail.items():
        if "mape" in key:
            table.add_row(key.replace("holdout_mape_", "held-out ").replace("_", " "), f"{value:.1%}")
    console.print(table)
    for warning in cal.fit_warnings(calibration):
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    console.print(f"wrote {out} and {csv_path}", highlight=False)


@contextmanager
def _bar_says(bar, task, text: str):
    """A progress bar's line says ``text`` while a step without a count runs (one live
    display at a time: a status spinner cannot run inside the bar)."""
    bar.update(task, description=text)
    yield


def _calibration_devices(colocated: int, devices: str | None, cpus: str | None) -> list:
    """``calibrate``'s engines' devices (the profiled one first; empty: no --devices), checked
    before anything starts."""
    if colocated < 1:
        raise ValueError(f"--colocated must be >= 1 (engines on the machine, this one "
                         f"included), got {colocated}")
    if devices is None:
        if colocated == 1:
            return []
        from orthrus_real.cluster.devices import Device
        from orthrus_real.engine.device import parse_cpus

        pinned = parse_cpus(cpus)  # the profiled engine's; the neighbours are not pinned
        return [Device("cpu", cpus=frozenset(pinned) if pinned else None)] + \
            [Device("cpu")] * (colocated - 1)
    if cpus:
        raise ValueError("give --devices (one per engine) or --cpus (the profiled engine's), "
                         "not both")
    import torch

    from orthrus_real.cluster.devices import parse_devices

    return parse_devices(devices, colocated,
                         torch.cuda.device_count() if torch.cuda.is_available() else 0)


@app.command()
def validate(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP),
    model: Path = typer.Option(..., "--model", help="model directory"),
    calibration: Path = typer.Option(..., "--calibration", help="calibration JSON of this machine"),
    embedding_adapter: Path = typer.Option(None, "--embedding-adapter"),
    out: Path = typer.Option(Path("out/validate"), "--out"),
    set_: list[str] = typer.Option([], "--set", help="override a scenario field: section.key=value"),
    kv_cache_tokens: int = typer.Option(32768),
    threads: int = typer.Option(2, help="torch threads of the measured engine"),
    via_server: bool = typer.Option(False, help="measure through a server process and HTTP "
                                                "(default: the engine in this process)"),
    backend: str = typer.Option("torch", help=BACKEND_HELP),
    engine_cpus: str = typer.Option(None, "--engine-cpus", help="with --via-server: the server's "
                                    "CPUs (0,1 or 0-3)"),
    client_cpus: str = typer.Option(None, "--client-cpus", help="with --via-server: this client's "
                                    "CPUs, apart from the server's"),
) -> None:
    """Run a scenario simulated and for real on this machine; print both and the errors."""
    from orthrus_real.engine.device import parse_cpus, pin_process
    from orthrus_real.measure.validate import validate as run_validate

    try:
        if (engine_cpus or client_cpus) and not via_server:
            raise ValueError("--engine-cpus and --client-cpus need --via-server (the engine and "
                             "the client in one process cannot be pinned apart)")
        parse_cpus(engine_cpus, "--engine-cpus")
        pin_process(parse_cpus(client_cpus, "--client-cpus"))
        with console.status("validating ...") as status:
            result = run_validate(scenario, set_, str(model),
                                  str(embedding_adapter) if embedding_adapter else None,
                                  str(calibration), out, kv_cache_tokens, threads,
                                  progress=lambda msg: status.update(msg), via_server=via_server,
                                  backend=backend, engine_cpus=engine_cpus)
    except (ValueError, RuntimeError) as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()
    table = Table(title=f"{result['scenario'].name}: simulated vs measured")
    for col in ("configuration", "metric", "simulated", "measured", "error"):
        table.add_column(col, justify="right", overflow="fold")

    def fmt(v) -> str:
        return "-" if v is None else f"{v:.4g}"

    for row in result["rows"]:
        err = row["relative_error"]
        table.add_row(row["configuration"], row["metric"], fmt(row["simulated"]), fmt(row["measured"]),
                      "-" if err is None else f"{err:+.1%}")
    console.print(table)
    for warning in result.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    console.print(f"results: {out}/simulated/results.json, {out}/measured/results.json", highlight=False)


if __name__ == "__main__":
    app()
