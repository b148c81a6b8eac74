"""Fit on the baselines, predict the treatment: the workflow docs/fitting.md recommends, checked
against measurement on this machine (docs/fidelity.md, "Fit on baselines, predict the treatment").

For each mix (embedding:generation closed-loop clients of `scenarios/fit_cpu.yaml`):

0. the prior: a profile of the engine on the CPUs it will serve on (`orthrus-real calibrate
   --cpus`, in the same run unless `--calibration` is given: a calibration belongs to one
   machine, day and arrangement);
1. measure the baselines a team runs today: a dedicated embedding-only server (the base model,
   atomic embeddings) and a dedicated generation server, each alone on the engine's CPUs, benched
   with its kind's pool (`bench --only KIND`, label dedicated-1:1);
2. fit the cost factors on those two runs alone (`orthrus-sim fit`, configuration dedicated-1:1);
3. predict the co-served configurations (Orthrus and the unified baselines, one device) with the
   fitted calibration, and with the prior calibration for contrast;
4. measure those configurations on the same engine and compare: targets throughput within 10 %
   and p50 latency within 20 %. Without a target (`--target-factor 0`) the served policy
   never consults a calibration, so the treatment is benched in the same rounds as the
   baselines (before the fit: step 1 then benches all five servers); with one, after the fit,
   served with the fitted calibration.

Engines: `--backend torch` (the PyTorch engine: baselines and treatment alike) or `--backend vllm`
(baselines on stock `vllm serve`, an engine this project did not write; the treatment on the
Orthrus plug-in, `serve --backend vllm`; run from the vLLM environment with LD_PRELOAD set as the
README says). The server runs on `--engine-cpus` and this client on `--client-cpus` (default 1
and 0: apart), the same arrangement for every run.

Run: python scripts/fit_validation.py [--backend torch|vllm] [--duration 60] [--warmup 10]
     [--mixes 9:1,5:5,1:9] [--clients 16] [--repeat N] [--model DIR] [--write-docs]
     [--note TEXT] [--tables-only]
Results: OUT/<mix>/<server>/results.json (every bench), OUT/<mix>/<server>/iterations.jsonl
(the server's every iteration, where it records them; round R of --repeat: iterations-R.jsonl;
scripts/iteration_residuals.py sets them
beside the fitted cost model), OUT/<mix>/fitted.json (the fit),
OUT/summary-BACKEND.json and OUT/table-BACKEND.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from orthrus_real.engine.device import parse_cpus, pin_process
from orthrus_real.measure.bench import mean_metrics, spread
from orthrus_real.measure.validate import _free_port, compare, mape_summary, serve_and_bench
from orthrus_sim.costmodel import calibrated_predictor, save_calibration
from orthrus_sim.costmodel.iteration_check import iteration_residuals, load_iterations
from orthrus_sim.costmodel.machine import this_machine
from orthrus_sim.experiment.measured import load_measured, only_kind
from orthrus_sim.experiment.results import results_doc, write_json
from orthrus_sim.experiment.scenario import parse_scenario, read_scenario, scenario_dump
from orthrus_sim.questions.fit import fit
from orthrus_sim.questions.predict import predict
from orthrus_sim.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "fit_cpu.yaml"
MIXES = {"9:1": 0.9, "5:5": 0.5, "1:9": 0.1}  # embedding share of the clients
TREATMENT = ("orthrus", "unified-hetero", "unified-homo")
KV_TOKENS = 32768
TARGETS = {"throughput": 0.10, "p50": 0.20}
COMPARED = [("throughput_rps.embedding", "throughput"), ("throughput_rps.generation", "throughput"),
            ("latency_s.embedding.p50", "p50"), ("latency_s.generation.p50", "p50"),
            ("latency_s.ttft.p50", "p50"), ("latency_s.tpot.p50", "p50")]
# the tables' fit; `--fit-metrics` adds the servers' steps per second ("iterations_per_s"), which
# on 2026-12-02 changed nothing on vLLM and, on a one-round torch run whose baselines ran slow,
# pinned that slowness harder (docs/history.md#fidelity-issue-22, (f))
FIT_METRICS = ["throughput_rps.embedding", "throughput_rps.generation", "utilization.busy",
               "latency_s.*.p50", "latency_s.*.p95"]
START = "<!-- fit-validation: written by scripts/fit_validation.py -->"
END = "<!-- /fit-validation -->"


def mix_raw(model: Path, share: float, clients: int, duration: float, warmup: float,
            calibration: str) -> dict:
    raw = read_scenario(SCENARIO)
    emb = min(clients - 1, max(1, round(clients * share)))
    raw.update(model=str(model), duration_s=duration, warmup_s=warmup, calibration=calibration)
    for pool in raw["workload"]["pools"]:
        pool["clients"] = emb if pool["kind"] == "embedding" else clients - emb
    return raw


def prior_calibration(args, console: Console) -> str:
    """The prior the fit scales: ``--calibration``, or a profile of the engine made now on the
    engine's CPUs (``orthrus-real calibrate --cpus``). A calibration belongs to one machine, one
    day and one arrangement (docs/fidelity.md): one made on both cores prices a batch of the
    engine pinned to one core by a shape the fit's few factors cannot mend (its LoRA and
    attention costs scale otherwise with the threads than its GEMMs)."""
    if args.calibration:
        return str(Path(args.calibration).resolve())
    out = args.out / "prior" / f"calibration-{args.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.backend == "vllm" and args.engine_cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.engine_cpus
    cmd = [sys.executable, "-m", "orthrus_real.cli", "calibrate", "--model", str(args.model),
           "--embedding-adapter", str(args.model / "adapter"), "--out", str(out),
           "--backend", args.backend]
    if args.engine_cpus:
        cmd += ["--cpus", args.engine_cpus]
    console.print(f"profiling the engine on CPUs {args.engine_cpus or 'all'} for the prior "
                  f"calibration ({out}; 13 minutes for the PyTorch engine on an AVX-512 "
                  "core, 30 for the vLLM plug-in in fp32 on an AVX2 one)")
    subprocess.run(cmd, check=True, env=env)
    return str(out)


def served_dtype(model: Path) -> str:
    """The dtype every server of the run computes in: the one the project's engines choose on
    this CPU (fp32 where it has no bf16 instructions). Stock vLLM is given it explicitly: its
    ``--dtype auto`` downcasts an fp32 checkpoint to bf16 on a CPU, ~60x slower matmuls on one
    without bf16 instructions, so its baselines would price another engine than the treatment."""
    import torch

    from orthrus_real.engine.device import choose_dtype

    config = json.loads((model / "config.json").read_text())
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    chosen, _ = choose_dtype(torch.device("cpu"), None, getattr(torch, name))
    return str(chosen).removeprefix("torch.")


def serve_command(args, port: int, role: str, scenario_file: Path | None = None,
                  configuration: str | None = None) -> tuple[list[str], dict]:
    """The server of a baseline (``embedding``/``generation``) or of the treatment (``unified``),
    and the environment it needs."""
    env = dict(os.environ)
    sched = ["--token-budget", "2048", "--max-num-seqs", "256"]
    if args.backend == "vllm" and args.engine_cpus:  # the vLLM worker's OpenMP team
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.engine_cpus
    if args.backend == "vllm" and role != "unified":  # stock vLLM
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vllm-cpu's `vllm` command looks up the metadata of a package named vllm and fails:
        # its API server module is the same server
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(args.model), "--port", str(port), "--max-num-seqs", "256",
               "--max-num-batched-tokens", "2048", "--max-model-len", "2048", "--dtype", args.dtype]
        if role == "embedding":
            cmd += ["--runner", "pooling", "--convert", "embed",
                    "--pooler-config", json.dumps({"pooling_type": "MEAN", "use_activation": False})]
        if args.engine_cpus:
            cmd = ["taskset", "-c", args.engine_cpus] + cmd
        return cmd, env
    cmd = [sys.executable, "-m", "orthrus_real.cli", "serve", "--model", str(args.model),
           "--port", str(port), "--kv-cache-tokens", str(KV_TOKENS), "--max-queued", "100000",
           "--backend", args.backend, "--dtype", args.dtype]
    if args.engine_cpus:
        cmd += ["--cpus", args.engine_cpus]
    if role == "embedding":
        cmd += ["--policy", "embedding-only", "--chunk-size", "none", *sched]
    elif role == "generation":
        cmd += ["--policy", "generation", "--chunk-size", "none", *sched]
    else:
        cmd += ["--scenario", str(scenario_file), "--configuration", configuration,
                "--embedding-adapter", str(args.model / "adapter")]
    return cmd, env


def measure(args, servers: list[tuple], console: Console, mix: str) -> list[dict]:
    """Bench each of ``servers`` (role, scenario mapping, label, folder, configuration)
    ``args.repeat`` times, in rounds: every server once, then every server again, so that a
    slow minute of a shared machine falls on one run of one server, not on all of one server's
    runs. Each run starts its server afresh; round R's iteration record and log are
    ``iterations[-R].jsonl`` and ``server[-R].log``. Returns per server its label, mean metrics
    and spread, with every run in its results.json."""
    runs: dict[int, list[dict]] = {i: [] for i in range(len(servers))}
    scenarios = []
    for _, raw, _, out, _ in servers:
        out.mkdir(parents=True, exist_ok=True)
        scenario_file = out / "scenario.yaml"
        scenario_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        scenarios.append((scenario_file, parse_scenario(raw, str(scenario_file))))
    for r in range(args.repeat):
        suffix = f"-{r + 1}" if r else ""
        for i, (role, _, label, out, configuration) in enumerate(servers):
            scenario_file, sc = scenarios[i]
            round_text = f", round {r + 1} of {args.repeat}" if args.repeat > 1 else ""
            what = label if role == "unified" else f"the dedicated {role} server"
            console.print(f"mix {mix}: measuring {what} ({args.duration:.0f} s{round_text})")
            port = _free_port()
            cmd, env = serve_command(args, port, role, scenario_file, configuration)
            runs[i] += serve_and_bench(cmd, port, sc, label, out / f"server{suffix}.log",
                                       start_timeout=300.0, env=env,
                                       iterations=out / f"iterations{suffix}.jsonl")
    for i, (_, _, _, out, _) in enumerate(servers):
        doc = results_doc(scenario_dump(scenarios[i][1]), runs[i])
        if len(runs[i]) > 1:
            doc["repeats"] = spread(runs[i])
        write_json(doc, out / "results.json")
    return stored(servers)


def stored(servers: list[tuple]) -> list[dict]:
    """Per server its label, mean metrics and spread, from the results.json ``measure`` wrote
    (now, or in an earlier run that ``--refit`` fits again)."""
    got = []
    for _, _, label, out, _ in servers:
        path = out / "results.json"
        if not path.exists():
            raise SystemExit(f"--refit: {path} is missing (measure this mix first)")
        doc = json.loads(path.read_text())
        got.append({"configuration": label, "metrics": mean_metrics(doc["runs"]),
                    "spread": doc.get("repeats", {})})
    return got


def _nested(rows: list[tuple[str, float]]) -> dict:
    """Dotted metric paths and values as a results file's nested ``metrics``."""
    out: dict = {}
    for path, value in rows:
        node = out
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def unpack_summary(path: Path, out: Path) -> None:
    """An earlier run's stored summary (docs/fidelity/*.json) as the servers' results files
    ``--refit`` reads: each baseline run's measured metrics from its fit's residual rows (one
    run per bench: each starts at its throughput), each treatment's measured means and their
    spread. So a fit can be redone, with the current code and the same prior, on what was
    measured then (the ranges of a table measured before they existed)."""
    stored = json.loads(path.read_text())
    for r in stored["mixes"]:
        base = out / r["mix"].replace(":", "-")
        runs: dict[str, list[list[tuple[str, float]]]] = {}
        for row in r["fit_residuals"]:
            metric = row["metric"]
            if metric.startswith("throughput_rps."):
                runs.setdefault(metric.split(".")[1], []).append([])
            if not runs:
                raise SystemExit(f"--from-summary {path}: mix {r['mix']}: a fitted metric "
                                 f"before any throughput ({metric}); cannot tell its server")
            list(runs.values())[-1][-1].append((metric, row["measured"]))
        for kind, benches in runs.items():
            folder = base / f"dedicated-{kind}"
            folder.mkdir(parents=True, exist_ok=True)
            doc = {"schema": "orthrus.results/1", "runs": [
                {"configuration": "dedicated-1:1", "metrics": _nested(b)} for b in benches],
                "repeats": r["spread"].get(f"dedicated {kind}", {})}
            write_json(doc, folder / "results.json")
        for cfg in {x["configuration"] for x in r["predicted"]}:
            rows = [(x["metric"], x["measured"]) for x in r["predicted"]
                    if x["configuration"] == cfg and x["measured"] is not None]
            metrics = _nested(rows) | {"completed": r["completed"].get(cfg, {})}
            folder = base / cfg.replace(":", "_")
            folder.mkdir(parents=True, exist_ok=True)
            write_json({"schema": "orthrus.results/1", "repeats": r["spread"].get(cfg, {}),
                        "runs": [{"configuration": cfg, "metrics": metrics}]},
                       folder / "results.json")


def one_mix(args, mix: str, share: float, console: Console) -> dict:
    base = args.out / mix.replace(":", "-")
    if base.exists() and not args.refit:
        shutil.rmtree(base)
    raw = mix_raw(args.model, share, args.clients, args.duration, args.warmup, args.calibration)
    measured_files = []
    spreads = {}
    kinds = ("embedding", "generation")
    baselines = [(kind, only_kind(raw, kind), "dedicated-1:1", base / f"dedicated-{kind}", None)
                 for kind in kinds]
    treatment = raw | {"configurations": list(args.configurations),
                       "cluster": {**raw.get("cluster", {}), "gpus": 1}}

    def treatment_servers(scenario: dict) -> list[tuple]:
        return [("unified", scenario, cfg, base / cfg.replace(":", "_"), cfg)
                for cfg in args.configurations]

    measured = None
    if args.refit:  # the measurements of an earlier run, fitted again
        got = stored(baselines + treatment_servers(treatment))
        got, measured = got[:len(kinds)], got[len(kinds):]
    elif args.target_factor:  # the target's predictor is the fitted calibration: after the fit
        got = measure(args, baselines, console, mix)
    else:
        # without a target the served policy never consults a calibration (its predictor
        # serves tpot_target_s only), so the treatment is benched in the same rounds as the
        # baselines, before the fit: a slow stretch of the shared machine falls on both alike
        got = measure(args, baselines + treatment_servers(treatment), console, mix)
        got, measured = got[:len(kinds)], got[len(kinds):]
    for kind, one in zip(kinds, got):
        spreads[f"dedicated {kind}"] = one["spread"]
        measured_files.append(base / f"dedicated-{kind}" / "results.json")
    console.print(f"mix {mix}: fitting on the baselines")
    result = fit(parse_scenario(raw, "fit scenario"), load_measured(measured_files, args.fit_metrics),
                 workers=args.workers)
    fitted = base / "fitted.json"
    save_calibration(result.calibration, fitted)
    target = treatment_target(args.target_factor, json.loads(measured_files[1].read_text()))
    if target is not None:
        treatment["scheduler"] = {**raw.get("scheduler", {}), "tpot_target_s": target}
    # the treatment is predicted with the fitted calibration (and served with it where its
    # target's predictor needs one, as a team would deploy after the fit); the prior shows
    # what no fit gives
    served = treatment | {"calibration": str(fitted)}
    predicted, prior = [], []
    for cfg in args.configurations:
        predicted.append({"configuration": cfg,
                          "metrics": simulate(parse_scenario(served, "prediction"), cfg).metrics})
        prior.append({"configuration": cfg,
                      "metrics": simulate(parse_scenario(treatment, "prior"), cfg).metrics})
    # the range the fit's evidence allows for each predicted metric (docs/fitting.md)
    ranges = predict(parse_scenario(served, "prediction"), result.calibration,
                     list(args.configurations), args.workers, tuple(m for m, _ in COMPARED))
    if measured is None:
        measured = measure(args, treatment_servers(served), console, mix)
    for cfg, one in zip(args.configurations, measured):
        spreads[cfg] = one.pop("spread")
    return {"mix": mix, "spread": spreads, "target_s": target,
            "iterations": server_iterations(base, fitted, args.model, raw),
            "speed": machine_speed(base, args.calibration, args.model, raw),
            "fit": {k: {kk: vv for kk, vv in v.items() if kk != "bounds"}
                    for k, v in result.parameters.items()},
            "fit_residuals": result.residuals, "predicted": compare(predicted, measured),
            "prior": compare(prior, measured), "ranges": [x.as_dict() for x in ranges],
            "completed": {x["configuration"]: completions(x["metrics"]) for x in measured},
            "completed_predicted": {x["configuration"]: completions(x["metrics"])
                                    for x in predicted}}


def server_iterations(base: Path, calibration: Path, model: Path, raw: dict) -> list[dict]:
    """Each server's recorded iterations against the fitted cost model for the same batches
    (where the server records them: not stock vLLM): is a miss the schedule's or the cost's?"""
    cost = _cost_model(calibration, model, raw)
    rows = [row for log in sorted(base.glob("*/iterations*.jsonl")) for row in load_iterations(log)]
    return iteration_residuals(rows, cost) if rows else []


def _cost_model(calibration, model: Path, raw: dict):
    """The cost model of ``calibration`` (its factors applied) for the scenario's adapter."""
    rank = (raw.get("embedding") or {}).get("lora_rank")
    return calibrated_predictor(str(calibration), str(model), rank).cost


def machine_speed(base: Path, prior: str, model: Path, raw: dict) -> dict[str, list[float]]:
    """Per server, each run's (round's) recorded iterations: measured time over what the prior
    calibration predicts for the same batches. The prior is one fixed yardstick, so a run that
    found the shared machine slower shows as a larger ratio, whoever's run it was."""
    cost = _cost_model(prior, model, raw)
    out: dict[str, list[float]] = {}
    for folder in sorted(p for p in base.iterdir() if p.is_dir()):
        logs = sorted(folder.glob("iterations*.jsonl"), key=lambda f: (len(f.name), f.name))
        for log in logs:
            rows = load_iterations(log)
            if rows:  # the "all" row of the same-batches check: its sums, inverted
                whole = iteration_residuals(rows, cost)[0]
                out.setdefault(folder.name, []).append(whole["measured_s"] / whole["predicted_s"])
    return out


def treatment_target(factor: float, generation_baseline: dict) -> float | None:
    """The treatment's ``scheduler.tpot_target_s``: ``factor`` times the TPOT p50 the dedicated
    generation server measured (what a team asks of co-serving: decodes at most that much
    slower than today); None for ``factor`` 0 (no target: the brief's IBS)."""
    if not factor:
        return None
    runs = generation_baseline.get("runs") or [generation_baseline]
    tpot = [r["metrics"]["latency_s"]["tpot"]["p50"] for r in runs
            if (r.get("metrics", {}).get("latency_s", {}).get("tpot") or {}).get("p50")]
    if not tpot:
        raise SystemExit("--target-factor: the dedicated generation server measured no TPOT "
                         "(no generation finished in the window); lengthen --duration")
    return round(factor * sum(tpot) / len(tpot), 4)


def completions(metrics: dict) -> dict:
    """Requests of each kind that finished in the measurement window."""
    done = metrics.get("completed") or {}
    return {kind: done.get(kind) for kind in ("embedding", "generation")}


# what a stored run was measured with: ``--tables-only`` writes its tables with these
RUN_ARGUMENTS = ("duration", "warmup", "clients", "repeat", "target_factor", "engine_cpus",
                 "client_cpus", "min_completions", "calibration", "fit_metrics", "refit", "dtype",
                 "from_summary")


def _profiled_in_run(cal: str) -> bool:
    """A prior ``prior_calibration`` made in the run (not given with --calibration)."""
    return Path(cal).parent.name == "prior"


def _prior_argument(args) -> str:
    """``--calibration FILE`` as the run was given it (a prior profiled in the run: nothing)."""
    cal = getattr(args, "calibration", None)
    if not cal or _profiled_in_run(cal):
        return ""
    try:
        return f" --calibration {Path(cal).relative_to(ROOT)}"
    except ValueError:
        return f" --calibration {cal}"


def _prior_text(args) -> str:
    cal = getattr(args, "calibration", None)
    if not cal:
        return "unrecorded"
    if _profiled_in_run(cal):
        return "a profile of the engine on its CPUs made in the same run (`orthrus-real calibrate --cpus`)"
    from orthrus_sim.costmodel import load_calibration

    loaded = load_calibration(cal)
    env = loaded.environment
    made = f", {env.threads} thread(s), {env.dtype}" if env else ""
    return f"`{Path(cal).name}` (made {loaded.created}{made})"


def _fit_arguments(args) -> str:
    """The fit's options where they are not the default (an earlier run's summary may lack them)."""
    metrics = getattr(args, "fit_metrics", None) or FIT_METRICS
    text = "" if list(metrics) == FIT_METRICS else f" --fit-metrics '{','.join(metrics)}'"
    text += " --refit" if getattr(args, "refit", False) else ""
    source = getattr(args, "from_summary", None)
    if source:
        try:
            source = Path(source).resolve().relative_to(ROOT)
        except ValueError:
            pass
        text += f" --from-summary {source}"
    return text


def table_lines(results: list[dict], args, wall: float) -> list[str]:
    machine = this_machine()
    engine = ("the PyTorch engine (baselines and treatment)" if args.backend == "torch" else
              "stock vLLM's OpenAI server (baselines) and the Orthrus vLLM plug-in (treatment)")
    lines = [
        START, "", f"## Fit on baselines, predict the treatment ({args.backend})", "",
        f"Generated by `python scripts/fit_validation.py --backend {args.backend} --duration "
        f"{args.duration:.0f} --warmup {args.warmup:.0f} --clients {args.clients} --repeat "
        f"{args.repeat} --target-factor {args.target_factor:g} --mixes "
        f"{','.join(r['mix'] for r in results)}{_prior_argument(args)}{_fit_arguments(args)}` on "
        f"{datetime.date.today().isoformat()} "
        f"({wall:.0f} s), machine {machine['machine']} ({', '.join(machine['cpu_flags'])}), "
        f"engine on CPUs {args.engine_cpus or 'all'}, client on {args.client_cpus or 'all'}, "
        f"every server in {getattr(args, 'dtype', None) or 'its default dtype'}; "
        f"engine: {engine}; prior calibration: {_prior_text(args)}. For each mix the cost "
        "factors were fitted on the two dedicated "
        "servers alone, then Orthrus and the unified baselines were predicted and measured. "
        "Cells: (predicted - measured) / measured with the fitted calibration, and in brackets "
        "with the prior calibration (no fit). Targets: throughput within 10 %, p50 within 20 %; "
        "**bold** misses." + (f" {args.note}" if getattr(args, "note", None) else ""), ""]
    head = ["mix", "configuration", "emb tput", "gen tput", "emb p50", "gen p50", "TTFT p50",
            "TPOT p50"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = total = few = 0
    judged = set()  # (mix, configuration, metric) of the cells counted
    for r in results:
        for cfg in args.configurations:
            cells = []
            for metric, target in COMPARED:
                err, perr = (next(x["relative_error"] for x in r[side]
                                  if x["configuration"] == cfg and x["metric"] == metric)
                             for side in ("predicted", "prior"))
                kind = "embedding" if metric.endswith((".embedding", ".embedding.p50")) \
                    else "generation"
                counts = [r.get(side, {}).get(cfg, {}).get(kind)
                          for side in ("completed", "completed_predicted")]
                if err is None:
                    cells.append("-")
                    continue
                if any(c is not None and c < args.min_completions for c in counts):
                    cells.append(f"({err:+.0%}, n={min(c for c in counts if c is not None):.0f})")
                    few += 1
                    continue
                text = f"{err:+.1%}"
                total += 1
                judged.add((r["mix"], cfg, metric))
                if abs(err) > TARGETS[target]:
                    text = f"**{text}**"
                else:
                    met += 1
                cells.append(text + (f" ({perr:+.0%})" if perr is not None else ""))
            lines.append(f"| {r['mix']} | {cfg} | " + " | ".join(cells) + " |")
    fitted_rows = [x for r in results for x in r["predicted"]]
    prior_rows = [x for r in results for x in r["prior"]]
    lines += ["", f"{met} of {total} cells meet their target"
              + (f" ({few} more in brackets with n=K: fewer than {args.min_completions} requests "
                 "of that kind finished in the measured or the predicted window, too few to "
                 "judge a 10 % target, not counted)." if few else ".")]
    targets = [f"{r['mix']} {r['target_s'] * 1000:.0f} ms" for r in results if r.get("target_s")]
    if targets:
        lines.append(f"Treatment's TPOT target ({args.target_factor:g} x the dedicated "
                     "generation server's measured TPOT p50; served and predicted with the "
                     "fitted calibration): " + ", ".join(targets) + ".")
    for name, rows in (("fitted", fitted_rows), ("prior", prior_rows)):
        m = mape_summary(rows)
        lines.append(f"MAPE with the {name} calibration: " + ", ".join(
            f"{k} {v['mape']:.1%} ({v['cells']} cells)" for k, v in m.items() if v["mape"] is not None)
            + ".")
    if args.repeat > 1:
        lines += ["", f"Run-to-run spread (coefficient of variation over {args.repeat} repeated "
                  "benches of each server, in rounds over the servers, each started afresh; the "
                  "cells compare with their mean):", ""]
        for r in results:
            for server, sp in r["spread"].items():
                lines.append(f"* {r['mix']} {server}: " + ", ".join(
                    f"{k} {v['cv']:.1%}" for k, v in sp.items() if v["cv"] is not None))
    lines += range_lines(results, args, judged)
    lines += iteration_lines(results)
    lines += ["", "Fitted factors per mix (status: fitted, or undetermined: left at the prior):", "",
              "| mix | " + " | ".join(results[0]["fit"]) + " |", "|" + "---|" * (len(results[0]["fit"]) + 1)]
    for r in results:
        lines.append(f"| {r['mix']} | " + " | ".join(
            f"{v['value']:.3g} ({v['status']})" for v in r["fit"].values()) + " |")
    lines += ["", END]
    return lines


def range_lines(results: list[dict], args, judged: set[tuple[str, str, str]]) -> list[str]:
    """Each cell's predicted range (`orthrus-sim predict` on the fit: every parameter moved as
    far as the baselines allow) as its ends' errors against the measurement; **bold** where the
    measurement lies outside."""
    if not any(r.get("ranges") for r in results):
        return []
    head = ["mix", "configuration"] + [m.replace("throughput_rps.", "").replace("latency_s.", "")
                                       for m, _ in COMPARED]
    lines = ["", "Predicted ranges (the fit's parameters moved as far as the baselines allow, "
             "`orthrus-sim predict`): each end's (predicted - measured) / measured; **bold** "
             "where the measurement lies outside its range:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    inside = counted = near = 0
    for r in results:
        ranges = {(x["configuration"], x["metric"]): x for x in r.get("ranges") or []}
        measured = {(x["configuration"], x["metric"]): x["measured"] for x in r["predicted"]}
        for cfg in args.configurations:
            cells = []
            for metric, _ in COMPARED:
                rng, seen = ranges.get((cfg, metric)), measured.get((cfg, metric))
                if rng is None or not seen:
                    cells.append("-")
                    continue
                low, high = rng["low"] / seen - 1, rng["high"] / seen - 1
                ok = low <= 1e-3 and high >= -1e-3
                text = f"{low:+.0%}..{high:+.0%}"
                if (r["mix"], cfg, metric) in judged:
                    counted += 1
                    inside += ok
                    near += ok or _within_spread(low, high, (r.get("spread") or {}).get(cfg, {})
                                                 .get(metric))
                else:
                    text = f"({text})"
                cells.append(text if ok else f"**{text}**")
            lines.append(f"| {r['mix']} | {cfg} | " + " | ".join(cells) + " |")
    lines += ["", f"{inside} of {counted} judged cells lie inside their predicted range (cells "
              "in brackets are not judged, as above); "
              f"{near} of {counted} reach their range within two standard errors of the "
              "measured mean (the run-to-run spread over the repeats). The range carries the fit's "
              "uncertainty and the prediction's own sampling spread, not the measured run's."]
    return lines


def _within_spread(low: float, high: float, spread_of: dict | None) -> bool:
    """A measurement outside its range by no more than two standard errors of its mean (the
    cell's run-to-run CV over the square root of its repeats)."""
    if not spread_of or spread_of.get("cv") is None:
        return False
    n = max(len(spread_of.get("values") or []), 1)
    margin = 2 * spread_of["cv"] / n ** 0.5
    return low <= margin and high >= -margin


ITERATION_KINDS = ("decode", "prefill+decode", "embedding", "embedding+decode",
                   "embedding+prefill+decode")


def iteration_lines(results: list[dict]) -> list[str]:
    """The cost of the same batches: predicted / measured time summed over each server's
    iterations of each kind (count in brackets), from its own record."""
    if not any(r.get("iterations") for r in results):
        return []
    lines = ["", "The same batches, predicted by the fitted cost model against their measured time "
             "(sum over the server's iterations of that kind, warm-up included; count in "
             "brackets; `scripts/iteration_residuals.py`): a throughput miss with these near 1 is "
             "the schedule's, not the cost model's.", "",
             "| mix | server | all | " + " | ".join(ITERATION_KINDS) + " |",
             "|" + "---|" * (3 + len(ITERATION_KINDS))]
    for r in results:
        by_log: dict[str, dict[str, dict]] = {}
        for x in r.get("iterations", []):
            by_log.setdefault(x["log"], {})[x["batch"]] = x
        for log, kinds in by_log.items():
            cells = [f"{kinds[k]['ratio']:.2f} ({kinds[k]['iterations']})" if k in kinds else "-"
                     for k in ("all", *ITERATION_KINDS)]
            lines.append(f"| {r['mix']} | {log} | " + " | ".join(cells) + " |")
    if any(r.get("speed") for r in results):
        lines += ["", "The machine's speed: each server run's iterations, their measured time over "
                  "what the prior calibration predicts for the same batches (one fixed yardstick), "
                  "per run in the order of the rounds; a slow stretch of the shared machine shows "
                  "as a larger ratio on whichever server ran then:", ""]
        for r in results:
            if r.get("speed"):
                lines.append(f"* {r['mix']}: " + "; ".join(
                    f"{server} {', '.join(f'{x:.2f}' for x in ratios)}"
                    for server, ratios in r["speed"].items()))
    return lines


def write_docs(lines: list[str], backend: str) -> Path:
    """Replace this backend's section of docs/fidelity.md (or append it)."""
    path = ROOT / "docs" / "fidelity.md"
    text = path.read_text()
    marker = f"## Fit on baselines, predict the treatment ({backend})"
    block = "\n".join(lines)
    start = 0
    while (i := text.find(START, start)) >= 0:
        j = text.find(END, i)
        if j < 0:
            break
        if marker in text[i:j]:
            path.write_text(text[:i] + block + text[j + len(END):])
            return path
        start = j
    path.write_text(text.rstrip("\n") + "\n\n" + block + "\n")
    return path


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="torch", choices=("torch", "vllm"))
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--mixes", default="9:1,5:5,1:9")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients of a mix")
    parser.add_argument("--configurations", default=",".join(TREATMENT))
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "small")
    parser.add_argument("--calibration", default=None, help="the prior (default: profile the "
                        "engine in this run, on --engine-cpus: orthrus-real calibrate)")
    parser.add_argument("--engine-cpus", default="1", help="'' for no pinning")
    parser.add_argument("--client-cpus", default="0", help="'' for no pinning")
    parser.add_argument("--workers", type=int, default=1, help="parallel simulations of the fit")
    parser.add_argument("--target-factor", type=float, default=0.0, help="the treatment's "
                        "scheduler.tpot_target_s as this multiple of the generation baseline's "
                        "measured TPOT p50 (0: no target)")
    parser.add_argument("--min-completions", type=int, default=20, help="cells of a kind with "
                        "fewer finished requests are shown but not judged")
    parser.add_argument("--repeat", type=int, default=1, help="benches of each server, in rounds "
                        "over the servers (the fit "
                        "sees every run; the comparison their mean; the spread is reported)")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "fit_validation")
    parser.add_argument("--write-docs", action="store_true", help="update docs/fidelity.md")
    parser.add_argument("--note", default=None, help="a caveat printed with the table")
    parser.add_argument("--tables-only", action="store_true", help="measure nothing: the tables "
                        "from OUT/summary-BACKEND.json of an earlier run")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="what "
                        "every server computes in, stock vLLM's too (default: what the "
                        "project's engines choose on this CPU)")
    parser.add_argument("--fit-metrics", default=",".join(FIT_METRICS), help="the measured "
                        "metrics the fit uses, comma-separated shell patterns "
                        "(orthrus-sim fit --metrics)")
    parser.add_argument("--refit", action="store_true", help="measure nothing: fit again on the "
                        "servers' results.json an earlier run left in OUT (with this run's "
                        "--fit-metrics, --calibration: the prior it used) and predict again")
    parser.add_argument("--from-summary", type=Path, default=None, help="with --refit: the "
                        "measurements of an earlier run's stored summary (docs/fidelity/*.json) "
                        "instead of OUT's results files; its iteration tables are kept")
    return parser


def main() -> None:
    args = arguments().parse_args()
    args.out = args.out.resolve()  # the scenarios it writes name files under it
    args.configurations = [c for c in args.configurations.split(",") if c]
    args.fit_metrics = [m for m in args.fit_metrics.split(",") if m]
    if args.refit and args.target_factor:
        raise SystemExit("--refit with --target-factor: the treatment was served with the earlier "
                         "run's fitted calibration, which a refit would not match")
    if args.refit and not args.calibration:
        raise SystemExit("--refit needs --calibration: the prior the earlier run fitted on")
    if args.from_summary and not args.refit:
        raise SystemExit("--from-summary goes with --refit (it measures nothing)")
    if args.from_summary and args.from_summary.exists():  # measured with the stored arguments
        kept = json.loads(args.from_summary.read_text()).get("arguments", {})
        for name in ("duration", "warmup", "clients", "repeat", "engine_cpus", "client_cpus",
                     "min_completions", "dtype", "fit_metrics"):
            if kept.get(name) is not None:
                setattr(args, name, kept[name])
    console = Console()
    if not (args.model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "orthrus_real.cli", "init-model", str(args.model),
                        "--size", "small", "--adapter-rank", "16"], check=True)
    args.dtype = args.dtype or served_dtype(args.model)
    parse_cpus(args.engine_cpus, "--engine-cpus")
    pin_process(parse_cpus(args.client_cpus, "--client-cpus"))
    summary = args.out / f"summary-{args.backend}.json"
    if args.tables_only:  # the tables again from the stored results, with the run's arguments
        stored = json.loads(summary.read_text())
        results, wall = stored["mixes"], stored["wall_s"]
        for name, value in stored.get("arguments", {}).items():
            setattr(args, name, value)
    else:
        args.calibration = prior_calibration(args, console)
        started = time.time()
        if args.from_summary:  # the stored run's measurements, as the servers' results files
            if not args.from_summary.exists():
                raise SystemExit(f"--from-summary: {args.from_summary} does not exist")
            unpack_summary(args.from_summary, args.out)
            summary.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.from_summary, summary)
        earlier = json.loads(summary.read_text()) if args.refit and summary.exists() else {}
        results = []
        for mix in args.mixes.split(","):
            if mix not in MIXES:
                raise SystemExit(f"--mixes: unknown mix {mix!r}; known: {', '.join(MIXES)}")
            results.append(one_mix(args, mix, MIXES[mix], console))
            if args.from_summary:  # its servers' iterations are not stored: the run's tables
                kept = {m["mix"]: m for m in earlier.get("mixes", [])}.get(mix, {})
                results[-1]["iterations"] = kept.get("iterations", [])
                results[-1]["speed"] = kept.get("speed", {})
        wall = earlier.get("wall_s", time.time() - started)  # a refit: the measuring run's
        args.out.mkdir(parents=True, exist_ok=True)
        summary.write_text(json.dumps({"mixes": results, "wall_s": wall, "arguments": {
            name: getattr(args, name) for name in RUN_ARGUMENTS}}, indent=2, default=str) + "\n")
    lines = table_lines(results, args, wall)
    (args.out / f"table-{args.backend}.md").write_text("\n".join(lines) + "\n")
    console.print("\n".join(lines), markup=False, highlight=False)
    if args.write_docs:
        console.print(f"wrote {write_docs(lines, args.backend)}")
    table = Table(title="done")
    table.add_column("results")
    table.add_row(str(args.out))
    console.print(table)


if __name__ == "__main__":
    main()
