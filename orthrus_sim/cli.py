"""``orthrus-sim``: simulate embedding + generation co-serving and compare configurations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from orthrus_sim.console import fail, interrupted, make_console, version_option

app = typer.Typer(help="Orthrus discrete-event simulator.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None)
console = make_console()
FORMATS = ("table", "csv", "json")


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=version_option("orthrus-sim"),
                                      is_eager=True, help="print the version and exit")) -> None:
    """Orthrus discrete-event simulator."""


def _format(fmt: str) -> str:
    if fmt not in FORMATS:
        fail(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


SCENARIO_HELP = "scenario YAML file, or the name of a shipped scenario (quickstart, mix_sweep, ...)"
SEEDS_HELP = ("at most this many other seeds each predicted configuration runs under (default "
              "64: 8, then as many as the expected value's spread needs): the spread of one "
              "run, and of the expected value, which more seeds narrow")


@app.command()
def run(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP),
    out: Path = typer.Option(Path("out"), "--out", help="directory for results.json, CSVs, PNGs"),
    set_: list[str] = typer.Option([], "--set", help="override a field: section.key=value (YAML)"),
    workers: int = typer.Option(0, help="parallel processes (0: one per CPU)"),
    fmt: str = typer.Option("table", "--format", help="table | csv | json (the comparison on "
                            "stdout, and nothing else for csv and json)"),
    wide: bool = typer.Option(False, "--wide", help="every column (the default fits 80)"),
) -> None:
    """Run every configuration listed in the scenario and compare them."""
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.questions.run import run_scenario

    try:
        sc = load_scenario(scenario, set_)
        _calibration_warning(sc)
        run_scenario(sc, out, workers or None, console, fmt=_format(fmt), wide=wide)
    except ValueError as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()


def _calibration_warning(sc) -> None:
    """On stderr (stdout may be JSON): a calibration made for other hardware or another dtype,
    and a note where the figures are derived from another card's fit or a bare roofline."""
    from orthrus_sim.costmodel.machine import calibration_note, scenario_warning

    err = make_console(stderr=True)
    warning = scenario_warning(sc)
    if warning:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    note = calibration_note(sc)
    if note:
        err.print(f"note: {escape(note)}", highlight=False)


@app.command()
def sweep(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP),
    grid: list[str] = typer.Option(..., "--grid", help="key=v1,v2,... (repeat for a grid)"),
    out: Path = typer.Option(Path("out/sweep"), "--out",
                             help="results: points/*/results.json and sweep.json; run again "
                                  "with the same --out to resume"),
    set_: list[str] = typer.Option([], "--set", help="override a field: section.key=value"),
    max_parallel: int = typer.Option(0, "--max-parallel", "--workers",
                                     help="points run at once (0: one per CPU, of the Ray "
                                          "cluster with --ray)"),
    ray: str = typer.Option(None, "--ray", help="run the points as Ray tasks: auto (join a "
                                                "running cluster) or local (start one here)"),
    fmt: str = typer.Option("table", "--format", help="table | csv | json"),
) -> None:
    """Run a parameter grid (all configurations at each point) in parallel, on local
    processes or a Ray cluster; resumable."""
    from orthrus_sim.experiment.scenario import read_scenario, scenario_path
    from orthrus_sim.questions.sweep import run_sweep

    if ray is not None and ray not in ("auto", "local"):
        fail(f"--ray must be auto or local, got {ray!r}")
    if max_parallel < 0:
        fail(f"--max-parallel must be >= 0, got {max_parallel}")
    try:
        path = scenario_path(scenario)
        doc = run_sweep(read_scenario(path), set_, grid, out, max_parallel or None, console,
                        base_dir=path.parent, source=str(path), fmt=_format(fmt), ray=ray)
    except ValueError as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()
    if doc["failed"]:
        raise typer.Exit(1)


def _demand(text: str | None) -> dict[str, float] | None:
    """``embedding=R,generation=R`` -> requests/s per kind."""
    if text is None:
        return None
    out: dict[str, float] = {}
    for item in text.split(","):
        kind, _, value = item.partition("=")
        kind = kind.strip()
        if kind not in ("embedding", "generation") or not value.strip():
            raise ValueError(f"--demand {text!r}: expected embedding=R,generation=R (requests/s), "
                             f"got {item!r}")
        try:
            out[kind] = float(value)
        except ValueError:
            raise ValueError(f"--demand {text!r}: {value!r} is not a number") from None
        if out[kind] < 0:
            raise ValueError(f"--demand {text!r}: a rate must be >= 0, got {value}")
    return out


@app.command()
def capacity(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP + " (open-loop pools and an slo section)"),
    attainment: float = typer.Option(0.99, help="SLO attainment every kind must reach (0-1]"),
    tolerance: float = typer.Option(0.05, help="stop when the next rate tried is within this "
                                               "fraction above the answer"),
    demand: str = typer.Option(None, "--demand", help="embedding=R,generation=R: requests/s the "
                               "GPU search must serve (default: the scenario's own rates)"),
    max_gpus: int = typer.Option(8, "--max-gpus", help="GPU search up to this many (0: skip it)"),
    scale: float = typer.Option(None, "--scale", help="the GPU search serves the scenario's load "
                                "times this (a trace or bursty load: its rate_scale)"),
    stretch_attainment: float = typer.Option(
        None, "--stretch-attainment", help="attainment every kind must also reach over its worst "
        "5 minutes (default: 0.95 for a trace or bursty load, none for a stationary one)"),
    out: Path = typer.Option(Path("out/capacity"), "--out", help="capacity.json and capacity.png"),
    set_: list[str] = typer.Option([], "--set", help="override a field: section.key=value (YAML)"),
    max_parallel: int = typer.Option(0, "--max-parallel", "--workers",
                                     help="simulations at once (0: one per CPU)"),
    ray: str = typer.Option(None, "--ray", help="run the simulations as Ray tasks: auto (join a "
                                                "running cluster) or local (start one here)"),
    full_runs: bool = typer.Option(False, "--full-runs", help="run every simulation to its end "
                                   "(default: a run stops once a kind can no longer reach "
                                   "--attainment; its attainment is then not recorded)"),
) -> None:
    """Per configuration: the highest offered open-loop rate (the scenario's mix) that meets
    the scenario's SLOs at the required attainment, and the fewest GPUs that serve a given rate
    of each kind; bisection over simulator runs, in parallel through the sweep backend."""
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.questions.capacity import run_capacity

    if ray is not None and ray not in ("auto", "local"):
        fail(f"--ray must be auto or local, got {ray!r}")
    if max_parallel < 0:
        fail(f"--max-parallel must be >= 0, got {max_parallel}")
    try:
        sc = load_scenario(scenario, set_)
        _calibration_warning(sc)
        run_capacity(sc, out, attainment, tolerance, _demand(demand), max_gpus,
                     max_parallel or None, ray, console, stretch_attainment, scale, full_runs)
    except ValueError as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()


@app.command()
def validate(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP),
    set_: list[str] = typer.Option([], "--set", help="override a field: section.key=value"),
) -> None:
    """Check a scenario without running it (traces and length files are read), and show what
    each configuration places where."""
    from orthrus_sim.experiment.plan import dedicated_plans, plan_configuration
    from orthrus_sim.experiment.scenario import is_replan, load_scenario, split_gpus

    try:
        sc = load_scenario(scenario, set_)
        _calibration_warning(sc)
        table = Table(title=f"{sc.name}: placement ({sc.cluster.gpus} x {sc.hardware}, {sc.model})")
        for col in ("configuration", "GPU", "role", "policy", "token budget", "chunk", "KV blocks"):
            table.add_column(col, overflow="fold")
        for cfg in sc.configurations:
            if is_replan(cfg):  # its GPUs run either role's server, from the split it starts at
                split = split_gpus(cfg, sc.cluster.gpus)
                start = (f"{split[0]} embedding : {split[1]} generation" if split
                         else "the planner's split")
                for i, plan in enumerate(dedicated_plans(sc)):
                    c = plan.config
                    table.add_row(cfg if i == 0 else "", start if i == 0 else "", plan.role,
                                  plan.policy, str(c.token_budget), str(c.chunk_size),
                                  str(c.num_blocks))
                continue
            for i, plan in enumerate(plan_configuration(sc, cfg)):
                c = plan.config
                table.add_row(cfg if i == 0 else "", str(i), plan.role, plan.policy,
                              str(c.token_budget), str(c.chunk_size), str(c.num_blocks))
        console.print(table)
        console.print(f"{escape(str(scenario))} is valid", style="green", highlight=False)
    except ValueError as exc:
        fail(exc)


@app.command()
def fit(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP + " (the deployment: hardware, model, "
                                   "load; its calibration is the prior the factors scale)"),
    measured: list[Path] = typer.Option(..., "--measured", help="results.json of measured runs "
                                        "(repeat); only the measured metrics need be present"),
    out: Path = typer.Option(..., "--out", help="calibration JSON to write (orthrus-sim run "
                                                "accepts it as a scenario's calibration)"),
    set_: list[str] = typer.Option([], "--set", help="override a scenario field: section.key=value"),
    fix: list[str] = typer.Option([], "--fix", help="hold a parameter at a value: NAME=VALUE"),
    metrics: list[str] = typer.Option([], "--metrics", help="fit only these metrics (shell "
                                      "patterns such as 'latency_s.*.p50'; repeat); default all"),
    at: list[str] = typer.Option([], "--at", help="the scenario overrides one --measured file "
                                 "was measured under, 'section.key=value' joined by ';' (one per "
                                 "--measured, in order; '-' for none): one joint fit across loads"),
    spread: float = typer.Option(0.10, "--spread", help="the measurements' relative run-to-run "
                                 "spread; sets the standard-error floor and the ranges' width"),
    predict_: str = typer.Option(None, "--predict", help="then predict these configurations "
                                 "(comma-separated) with the fit's ranges, as orthrus-sim predict"),
    seeds: int | None = typer.Option(None, "--seeds", help=SEEDS_HELP),
    workers: int = typer.Option(0, help="parallel simulations (0: one per CPU)"),
    fmt: str = typer.Option("table", "--format", help="table | json"),
) -> None:
    """Fit cost factors (device-time scales, mixed-iteration overlap, per-request overheads) to
    measured serving metrics by simulation; write a calibration and report the residuals."""
    import os

    from orthrus_sim.costmodel import save_calibration
    from orthrus_sim.experiment.measured import load_measured
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.questions.fit import fit as run_fit
    from orthrus_sim.questions.fit import fit_json

    if fmt not in ("table", "json"):
        fail(f"--format must be table or json, got {fmt!r}")
    try:
        fixed = {}
        for item in fix:
            name, sep, value = item.partition("=")
            try:
                fixed[name.strip()] = float(value)
            except ValueError:
                fail(f"--fix {item!r}: expected NAME=VALUE (a number)")
            if not sep:
                fail(f"--fix {item!r}: expected NAME=VALUE")
        sc = load_scenario(scenario, set_)
        if not 0 < spread < 1:
            fail(f"--spread must be in (0, 1), got {spread}")
        _check_seeds(seeds)
        overrides = [[] if a.strip() == "-" else [o.strip() for o in a.split(";") if o.strip()]
                     for a in at]
        runs = load_measured(measured, metrics, overrides or None)
        configs = _configurations(predict_, "--predict") if predict_ is not None else []
        if configs:  # a configuration the scenario can't run fails here, before the fit
            from orthrus_sim.experiment.scenario import parse_scenario, scenario_dump

            parse_scenario(scenario_dump(sc) | {"configurations": configs},
                           f"{scenario} (--predict)")
        with console.status("fitting ...") as status:
            result = run_fit(sc, runs, workers or os.cpu_count() or 1, fixed,
                             progress=lambda msg: status.update(f"fitting: {msg}"),
                             spread=spread)
        save_calibration(result.calibration, out)
        predictions = (_predictions(sc, result.calibration, configs, workers, seeds)
                       if configs else None)
    except ValueError as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()
    if fmt == "json":
        doc = json.loads(fit_json(result))
        if predictions:
            doc["predictions"] = _predictions_doc(*predictions, _window_s(sc))
        console.print(json.dumps(doc), markup=False, highlight=False, soft_wrap=True)
    else:
        _print_fit(result)
        if predictions:
            _print_predictions(sc.name, str(out), result.calibration, *predictions,
                               _window_s(sc))
    console.print(f"wrote {out}", highlight=False)


def _configurations(value: str, flag: str) -> list[str]:
    configs = [c.strip() for c in value.split(",") if c.strip()]
    if not configs:
        fail(f"{flag}: give at least one configuration")
    return configs


def _check_seeds(seeds: int | None) -> None:
    if seeds is not None and seeds < 1:
        fail(f"--seeds must be at least 1 (a spread needs two samples), got {seeds}")


def _predictions(sc, cal, configs: list[str], workers: int,
                 seeds: int | None = None) -> tuple[list, list, list]:
    """The configurations' ranges under ``cal``, and what to measure next for the widest: the
    single metrics, and the one run that would remove most."""
    import os

    from orthrus_sim.questions.predict import SEEDS, suggest, suggest_run
    from orthrus_sim.questions.predict import predict as run_predict

    with console.status("predicting ..."):
        ranges = run_predict(sc, cal, configs, workers or os.cpu_count() or 1,
                             seeds=SEEDS if seeds is None else seeds)
    widest = _widest(ranges)
    if widest is None:
        return ranges, [], []
    return ranges, suggest(widest, cal), suggest_run(widest, cal)


def _widest(ranges: list):
    """The range whose parameters' part is widest (what a measurement can narrow)."""
    return max(ranges, key=lambda r: (r.parameter_width, r.width), default=None)


def _window_s(sc) -> float | None:
    """The measurement window of ``sc``'s runs (None: it runs to its last request)."""
    return sc.duration_s - sc.warmup_s if sc.duration_s is not None else None


def _predictions_doc(ranges: list, nexts: list, runs: list, duration_s: float | None) -> dict:
    from orthrus_sim.questions.predict import sampling_bound

    bound = sampling_bound(ranges, duration_s)
    return {"ranges": [r.as_dict() for r in ranges], "measure_next": [s.as_dict() for s in nexts],
            "measure_next_run": [s.as_dict() for s in runs],
            "sampling_bound": bound.as_dict() if bound else None}


def _print_predictions(name: str, source: str, cal, ranges: list, nexts: list, runs: list,
                       duration_s: float | None) -> None:
    from orthrus_sim.questions.predict import sampling_bound

    table = Table(title=f"{name}: predictions with ranges ({escape(source)})")
    for col in ("configuration", "metric", "point", "low", "high", "expected", "low end",
                "high end", "sampling sd"):
        table.add_column(col, overflow="fold")
    for r in ranges:
        expected = (f"{r.mean:.4g} ({r.mean_low:.4g}..{r.mean_high:.4g})"
                    if r.mean is not None and r.mean_low is not None else "-")
        table.add_row(r.configuration, r.metric, f"{r.point:.4g}", f"{r.low:.4g}",
                      f"{r.high:.4g}", expected, r.low_end or "-", r.high_end or "-",
                      f"{r.noise:.1%}")
    counted = (f"{min(r.samples for r in ranges)}-{max(r.samples for r in ranges)}"
               if ranges else "0")
    table.caption = ("low/high: where one run of the window lands: the parameters' extremes (the "
                     "end that gives each) widened by 2 sampling sd (the point under other seeds), "
                     f"in quadrature; expected: the geometric mean of {counted} runs under other "
                     "seeds and its range, the same extremes widened by 2 sd of that mean (what "
                     "many runs average to)")
    if not (cal.factor_fit and cal.factor_fit.range_ends):
        table.caption = ("this calibration has no fitted ranges: low/high the spread of one run "
                         f"(2 sd), expected the geometric mean of {counted} runs with 2 sd of it")
    console.print(table)
    widest = _widest(ranges)
    for s in nexts:
        where = f" at {'; '.join(s.at)}" if s.at else ""
        of = f" of its {s.kind} servers (bench --only {s.kind})" if s.kind else ""
        console.print(f"measure next: {s.configuration}{where} {s.metric}{of} (would remove "
                      f"~{s.removes:.0%} of the {widest.configuration} {widest.metric} "
                      f"expected range)",
                      highlight=False, markup=False)
    best = max((s.removes for s in nexts), default=0.0)
    for run in runs:
        if len(run.metrics) < 2 and run.removes <= best:
            continue  # the same as a single metric above
        where = f" at {'; '.join(run.at)}" if run.at else ""
        kept = ", ".join(m.metric + (f" of its {m.kind} servers" if m.kind else "")
                         for m in run.metrics)
        console.print(f"or one more run: {run.configuration}{where}, keeping every metric it "
                      f"reports ({kept}; a split's per-kind figures from its servers' benches, "
                      f"bench --only KIND): would remove ~{run.removes:.0%}",
                      highlight=False, markup=False)
    bound = sampling_bound(ranges, duration_s)
    if bound is not None:
        window = f"{bound.duration_s:g} s" if bound.duration_s is not None else "whole-run"
        field = "duration_s" if bound.duration_s is not None else "num_requests"
        console.print(
            f"the widest range, {bound.configuration} {bound.metric} ({bound.width:.0%} wide), is "
            f"mostly the prediction's own sampling spread (sd {bound.sampling_sd:.1%} over "
            f"a {window} window; the parameters' part {bound.parameter_width:.0%}): no measurement "
            f"of the fit's configurations narrows that part; a window 4x as long ({field}) "
            f"would about halve it (the expected value's range, over {bound.runs} runs, is "
            f"{bound.mean_width:.0%} wide; more --seeds narrow its sampling part)",
            highlight=False, markup=False)


@app.command()
def predict(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP),
    calibration: Path = typer.Option(..., "--calibration", help="a fitted calibration (orthrus-"
                                     "sim fit --out): its parameter ranges give the ranges"),
    configurations: str = typer.Option(..., "--configurations", help="comma-separated, e.g. "
                                       "orthrus,dedicated-1:1"),
    set_: list[str] = typer.Option([], "--set", help="override a scenario field: section.key=value"),
    seeds: int | None = typer.Option(None, "--seeds", help=SEEDS_HELP),
    workers: int = typer.Option(0, help="parallel simulations (0: one per CPU)"),
    fmt: str = typer.Option("table", "--format", help="table | json"),
) -> None:
    """Predict configurations with ranges: each simulated at the fit's point and at every end of
    its parameter ranges; says which parameter drives each range and what to measure next."""
    from orthrus_sim.costmodel import load_calibration
    from orthrus_sim.experiment.scenario import load_scenario

    if fmt not in ("table", "json"):
        fail(f"--format must be table or json, got {fmt!r}")
    try:
        _check_seeds(seeds)
        sc = load_scenario(scenario, set_)
        _calibration_warning(sc)
        cal = load_calibration(calibration)
        ranges, nexts, runs = _predictions(sc, cal, _configurations(configurations,
                                                                     "--configurations"),
                                           workers, seeds)
    except ValueError as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted()
    if fmt == "json":
        console.print(json.dumps(_predictions_doc(ranges, nexts, runs, _window_s(sc))), markup=False,
                      highlight=False, soft_wrap=True)
    else:
        _print_predictions(sc.name, str(calibration), cal, ranges, nexts, runs, _window_s(sc))


@app.command()
def headroom(
    scenario: str = typer.Argument(..., help=SCENARIO_HELP + " (a steady mix and "
                                   "scheduler.tpot_target_s)"),
    set_: list[str] = typer.Option([], "--set", help="override a scenario field: section.key=value"),
    fmt: str = typer.Option("table", "--format", help="table | json"),
) -> None:
    """What co-serving can gain on the scenario's steady demand, predicted in a second without
    simulating: every assignment the placement planner weighs, its plan, the best static split
    and an upper bound on any placement of the cluster's replicas within the TPOT target
    (docs/scheduler.md, "What any placement could serve"). The scenario's configurations are
    not run: with another cluster.gpus, set configurations=[orthrus] too."""
    from orthrus_sim.experiment.scenario import load_scenario
    from orthrus_sim.questions.headroom import headroom as weigh

    if fmt not in ("table", "json"):
        fail(f"--format must be table or json, got {fmt!r}")
    try:
        sc = load_scenario(scenario, set_)
        _calibration_warning(sc)
        h = weigh(sc)
    except ValueError as exc:
        fail(exc)
    if fmt == "json":
        console.print(json.dumps(h.as_dict()), markup=False, highlight=False, soft_wrap=True)
        return
    _print_headroom(h)


def _print_headroom(h) -> None:
    import math

    d, n = h.demand, h.replicas
    load = (f"{d.generations:.1f} generations and {d.embeddings:.1f} embeddings in flight"
            if d.closed_loop else
            f"{d.generation_rps:.3g} generations/s and {d.embedding_rps:.3g} embeddings/s")
    table = Table(title=f"{h.scenario}: {n} replicas, TPOT target {h.target_s * 1e3:.3g} ms, "
                        f"{load}")
    for col in ("assignment (emb:dec)", "emb/s", "gen/s", "TPOT ms", "normalised",
                "holds target", ""):
        table.add_column(col)
    for p in h.assignments:
        table.add_row(p.assignment.label(n), f"{p.embedding_rps:.1f}", f"{p.generation_rps:.2f}",
                      f"{p.tpot_s * 1e3:.1f}", f"{p.throughput:.3f}", "yes" if p.feasible else "no",
                      "plan" if p.assignment == h.plan.assignment else "")
    console.print(table)
    b = h.bound

    def num(x: float) -> str:
        return f"{x:.3f}" if math.isfinite(x) else "-"

    def where(r: tuple) -> str:
        return "a whole budget of chunks" if r[0] is None else \
            f"{r[0]} decodes + {r[1]} chunk tokens (prompts, riders)"

    split = b.best_split_label or "-"
    if b.best_split_cap is not None:
        split += f" at {b.best_split_cap} decodes per decoding replica"
    console.print(f"best static split (emb:dec; as it is, capped, or with its prompts offloaded; "
                  f"embedding replicas merged): {split}, {num(b.best_split)}; any placement: at "
                  f"most {num(b.objective)} (headroom {num(b.headroom)}x the split)", highlight=False)
    if b.placement:
        console.print("  the bound's placement, per replica: " + "; ".join(where(r) for r in b.placement),
                      highlight=False)
    if b.serves_demand is not None:
        verdict = ("some placement may serve it" if b.serves_demand
                   else "no placement of these replicas serves it within the target")
        console.print(f"the whole demand, normalised: {num(b.asked)}: {verdict}", highlight=False)
    console.print("normalised: each kind's throughput over one replica dedicated to it (the "
                  "planner's own units); steady-state predictions: simulate with "
                  "--set cluster.router=adaptive to measure", style="dim", highlight=False)


def _print_fit(result) -> None:
    from orthrus_sim.questions.evaluation import BY_NAME

    params = Table(title=f"fitted factors ({result.evaluations} simulations)")
    for col in ("parameter", "value", "prior", "bounds", "status", "sensitivity", "meaning"):
        params.add_column(col, overflow="fold")
    for name, p in result.parameters.items():
        lo, hi = p["bounds"]
        params.add_row(name, f"{p['value']:.4g}", f"{p['prior']:.4g}", f"[{lo:g}, {hi:g}]",
                       p["status"], f"{p['sensitivity']:.1%}", BY_NAME[name].meaning)
    params.caption = ("sensitivity: the largest change of a measured metric with the parameter "
                      "at either bound; undetermined: the measurements do not pin it (left at "
                      "its prior)")
    console.print(params)
    resid = Table(title="measured vs fitted simulation")
    for col in ("configuration", "metric", "measured", "simulated", "residual"):
        resid.add_column(col, justify="right", overflow="fold")
    for r in result.residuals:
        sim = "-" if r["simulated"] is None else f"{r['simulated']:.4g}"
        res = "-" if r["residual"] is None else f"{r['residual']:+.1%}"
        where = r["configuration"] + (f" at {'; '.join(r['at'])}" if r.get("at") else "")
        resid.add_row(where, r["metric"], f"{r['measured']:.4g}", sim, res)
    console.print(resid)
    if result.misses:
        console.print(f"misfit: the model cannot reproduce {len(result.misses)} measured "
                      f"metric(s) within the stated spread; tried: {', '.join(result.tried)}",
                      style="red", highlight=False, markup=False)
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)


@app.command()
def catalogue() -> None:
    """List the known hardware, models, shipped scenarios, calibrations and routers."""
    from orthrus_sim import data_dir
    from orthrus_sim.costmodel import HARDWARE, MODEL_CONFIGS, get_model, load_calibration
    from orthrus_sim.experiment.scenario import shipped_calibrations
    from orthrus_sim.routing.rules import ROUTERS

    hw = Table(title="hardware (a scenario uses its hardware's calibration unless it names another)")
    for col in ("name", "bf16 TFLOP/s", "mem GB/s", "memory GB", "link GB/s", "L2 MB", "calibration"):
        hw.add_column(col)
    shipped = shipped_calibrations()
    for h in HARDWARE.values():
        if h.name not in shipped:
            cal = "none: roofline, assumed efficiencies"
        else:
            source = load_calibration(shipped[h.name]).source
            cal = f"derived, not fitted (from {source.derived_from})" if source.derived_from \
                else "fitted"
        hw.add_row(h.name, f"{h.peak_flops / 1e12:.1f}", f"{h.mem_bw / 1e9:.0f}",
                   f"{h.mem_capacity / 1e9:.0f}", f"{h.interconnect_bw / 1e9:.0f}",
                   f"{h.cache_bytes / 2**20:.0f}" if h.cache_bytes else "", cal)
    console.print(hw)
    models = Table(title="models")
    for col in ("name", "params (B)", "layers", "hidden", "heads/kv", "KV KiB/token"):
        models.add_column(col)
    for name in MODEL_CONFIGS:
        m = get_model(name)
        models.add_row(name, f"{m.num_params / 1e9:.2f}", str(m.num_layers), str(m.hidden_size),
                       f"{m.num_heads}/{m.num_kv_heads}", f"{m.kv_bytes_per_token / 1024:.0f}")
    console.print(models)
    console.print("scenarios: " + ", ".join(p.stem for p in sorted(data_dir("scenarios").glob("*.yaml"))),
                  highlight=False)
    console.print("calibrations: " + ", ".join(shipped_calibrations()), highlight=False)
    console.print("routers (cluster.router): " + ", ".join(ROUTERS), highlight=False)


if __name__ == "__main__":
    sys.exit(app())
