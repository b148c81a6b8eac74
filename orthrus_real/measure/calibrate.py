"""``orthrus-real calibrate``: profile the real engine over a grid of batch compositions, fit
the cost model to the measured iteration times, write a calibration file ``orthrus-sim``
accepts (and the raw measurements as CSV beside it).

Each grid point is a small workload run through the engine's own loop (``Engine.step``), so the
measured time is a whole iteration as it happens in serving: scheduling, the packed forward
pass, the emit stage and completion. Every iteration's composition (its ``BatchShape``) and time
is one profiling row; the first run of each point is a warm-up and is discarded.
"""

from __future__ import annotations

import asyncio
import csv
import datetime
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from orthrus_real.server.engine_thread import EngineThread
from orthrus_sim.costmodel import (
    CostModel,
    LoRASpec,
    fit_iterations,
    get_hardware,
    get_model,
    save_calibration,
)
from orthrus_sim.costmodel.calibration import (
    CalibrationFile,
    EnvironmentModel,
    FitErrorModel,
    SourceModel,
    coefficients_model,
    mape,
)
from orthrus_sim.costmodel.coefficients import Coefficients
from orthrus_sim.costmodel.iteration_check import batch_kind
from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.engine import SchedulerConfig


@dataclass(frozen=True)
class GridPoint:
    """A workload that produces one kind of batch: D decodes at context C, E embedding inputs
    of L tokens, P prompts of N tokens (prefill chunks)."""

    category: str
    decodes: int = 0
    context: int = 0
    steps: int = 8
    embeds: int = 0
    embed_len: int = 0
    prompts: int = 0
    prompt_len: int = 0


def default_grid(quick: bool = False) -> list[GridPoint]:
    decodes = (1, 8, 32) if quick else (1, 4, 16, 32, 64)
    contexts = (64, 512) if quick else (64, 256, 1024)
    lens = (32, 256) if quick else (16, 64, 256, 512)
    counts = (1, 4) if quick else (1, 4, 8)
    # decode points prefill d x c tokens per run; past 32k tokens that dominates the profile
    grid = [GridPoint("decode", decodes=d, context=c) for d in decodes for c in contexts
            if d * c <= 32768]
    grid += [GridPoint("embedding", embeds=n, embed_len=n_tok) for n in counts for n_tok in lens]
    grid += [GridPoint("prefill", prompts=n, prompt_len=n_tok) for n in counts for n_tok in lens]
    grid += [GridPoint("mixed", decodes=d, context=c, embeds=n, embed_len=n_tok)
             for d in decodes[1:] for c in contexts[:1] for n, n_tok in ((2, 128), (4, 256))]
    return grid


async def _run_point(runner: EngineThread, transport, point: GridPoint,
                     rng: np.random.Generator) -> list:
    """Run one grid point to completion; returns the IterationStats of its iterations."""
    engine = runner.engine
    vocab = min(engine.cfg.vocab_size, 30000)
    first = engine.iterations

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(4, vocab, size=n)]

    started = asyncio.Event()
    decoding = [0]

    def on_token() -> None:
        decoding[0] += 1
        if decoding[0] == point.decodes:
            started.set()

    def first_token_counter():
        seen = [False]

        def cb() -> None:
            if not seen[0]:
                seen[0] = True
                on_token()
        return cb

    tasks = [asyncio.create_task(transport.generate(tokens(point.context), point.steps,
                                                    first_token_counter()))
             for _ in range(point.decodes)]
    if point.embeds and point.decodes:
        await started.wait()  # prompts done: embedding chunks now mix into decode iterations
    tasks += [asyncio.create_task(transport.embed([tokens(point.embed_len)]))
              for _ in range(point.embeds)]
    tasks += [asyncio.create_task(transport.generate(tokens(point.prompt_len), 1, lambda: None))
              for _ in range(point.prompts)]
    await asyncio.gather(*tasks)
    n = engine.iterations - first
    return list(engine.stats)[-n:] if n else []


def profile(runner: EngineThread, grid: list[GridPoint], repeats: int = 3, progress=None) -> list[dict]:
    """Profile through the engine thread, fed from an asyncio client in this thread: the same
    arrangement as serving (and as ``orthrus-real validate``), so the measured iteration times
    include what serving costs around the forward pass."""
    from orthrus_real.measure.bench import EngineTransport

    async def go() -> list[dict]:
        transport = EngineTransport(runner)
        rng = np.random.default_rng(0)
        rows = []
        for i, point in enumerate(grid):
            await _run_point(runner, transport, point, rng)  # warm-up
            for _ in range(repeats):
                for s in await _run_point(runner, transport, point, rng):
                    rows.append({"category": point.category, "point": i, "seconds": s.seconds,
                                 **asdict(s.shape)})
            if progress is not None:
                progress(i + 1, len(grid))
        return rows

    return asyncio.run(go())


# the serving load's lengths (the profile's own load and a co-located neighbour's)
LOAD_LENGTHS = {"embedding_input": {"dist": "uniform", "low": 16, "high": 512},
                "generation_prompt": {"dist": "uniform", "low": 16, "high": 256},
                "generation_output": {"dist": "uniform", "low": 8, "high": 128}}


def load_scenario_for(seconds: float, seed: int = 1234):
    """A mixed closed-loop load through three mixes (9:1, 5:5, 1:9 embedding:generation) with
    varied lengths: compositions a grid does not produce (prefill + decodes + embedding chunks
    at once, changing every iteration), and serving's own jitter."""
    from orthrus_sim.experiment.scenario import parse_scenario

    third = seconds / 3
    return parse_scenario({
        "name": "calibration-load", "seed": seed, "duration_s": seconds,
        "workload": {"arrival": {"process": "closed-loop", "clients": 16}, **LOAD_LENGTHS,
                     "phases": [{"duration_s": third, "generation_share": s} for s in (0.1, 0.5, 0.9)]},
    })


def profile_load(runner: EngineThread, seconds: float, token_range: int = 500) -> list[dict]:
    """Rows from every iteration of a mixed serving load of ``seconds``."""
    from orthrus_real.measure.bench import EngineTransport, LiveDriver

    engine = runner.engine
    first = engine.iterations
    driver = LiveDriver(EngineTransport(runner), load_scenario_for(seconds),
                        min(token_range, engine.cfg.vocab_size))
    asyncio.run(driver.run())
    time.sleep(0.2)  # cancelled requests leave the engine
    n = engine.iterations - first
    return [{"category": "load", "point": -1, "seconds": s.seconds, **asdict(s.shape)}
            for s in list(engine.stats)[-n:]] if n else []


def _category(shape: BatchShape, point_category: str) -> str:
    """A profiled row's category: what the batch carried (``batch_kind``, the one classifier
    of batch contents), decodes beside chunks named "mixed"; a load-driven row stays "load"."""
    if point_category == "load":
        return "load"
    kind = batch_kind(shape)
    if kind.endswith("+decode"):
        return "mixed"
    if kind in ("embedding", "decode"):
        return kind
    return point_category if point_category != "mixed" else "prefill"


ENGINE_NAMES = {"torch": "the PyTorch engine", "vllm": "vLLM with the Orthrus plug-in"}


def fit(rows: list[dict], model_dir: str, adapter_rank: int | None, hardware: str = "cpu-2core",
        holdout_every: int = 5, backend: str = "torch",
        environment: dict | None = None) -> tuple[CalibrationFile, list[dict]]:
    """Fit group efficiencies and overheads; returns the calibration and per-row predictions.
    ``environment``: where it was measured (``device.engine_environment``, and ``colocated``
    with the neighbours' figures when it was), recorded in it. When its rows include a served
    cluster's iterations (``served_iterations``: ``calibrate --colocated``), the grid's rows
    are fitted at the speed those ran (``serving_scale``)."""
    hw = get_hardware(hardware)
    spec = get_model(model_dir)
    lora = LoRASpec(adapter_rank) if adapter_rank else None
    base = CostModel(hw, spec, Coefficients(), lora)
    fields = BatchShape.__slots__
    samples = [(BatchShape(**{k: r[k] for k in fields}), r["seconds"]) for r in rows]
    if (environment or {}).get("served_iterations"):
        scale = serving_scale(samples, [r["category"] == "load" for r in rows], base,
                              holdout_every)
        environment = {**environment, "serving_scale": round(scale, 5)}
        samples = [(shape, t if r["category"] == "load" else t * scale)
                   for r, (shape, t) in zip(rows, samples)]
    coeffs, errors = fit_iterations(base, samples, holdout_every)
    fitted = CostModel(hw, spec, coeffs, lora)
    held = {}
    for i, (row, (shape, seconds)) in enumerate(zip(rows, samples)):
        row["predicted_s"] = fitted.shape_time(shape)
        row["holdout"] = i % holdout_every == 0
        row["kind"] = _category(shape, row["category"])
        if row["holdout"]:
            held.setdefault(row["kind"], []).append((row["predicted_s"], seconds))
    detail = {f"holdout_mape_{k}": round(mape(*zip(*v)), 5) for k, v in sorted(held.items())}
    detail.update({k: round(v, 5) for k, v in errors.items()})
    cal = CalibrationFile(
        schema="orthrus.calibration/1", hardware=hw.name, model=str(model_dir),
        coefficients=coefficients_model(coeffs),
        source=SourceModel(
            description=(
                f"orthrus-real calibrate: {len(rows)} whole iterations of {ENGINE_NAMES[backend]} "
                f"(scheduling, forward, emit, completion) on {hw.name}: grid points of one kind "
                "of batch each, plus every iteration of a mixed serving load (category 'load'); "
                + _colocation_text(environment) + "fitted with "
                "fit_iterations (group efficiencies: linear, attention, elementwise, LoRA; "
                "per-iteration and per-sequence overheads). Per-operator times are not measured "
                "separately here, so per-operator MAPE is not available; errors are per batch "
                "kind on held-out iterations."),
            files=[], measured=["whole iterations"], assumed=["per-operator split (roofline)"]),
        fit_error=FitErrorModel(iteration_mape=round(errors.get("holdout_mape", errors["train_mape"]), 5),
                                points=len(rows), detail=detail),
        created=datetime.date.today().isoformat(),
        environment=EnvironmentModel(**environment) if environment else None,
    )
    return cal, rows


def serving_scale(samples: list[tuple[BatchShape, float]], served: list[bool], base: CostModel,
                  holdout_every: int = 5) -> float:
    """How much slower a served cluster's iterations ran (the samples flagged ``served``) than
    a fit of the others (the grid, one engine in the calibrating process) prices the same
    batches. Served behind the gateway, with the client, the gateway and each replica's HTTP
    server on the engines' cores, every iteration takes longer by about the same factor (10 %
    for two one-core replicas on the 2-core machine, docs/cluster.md); the grid alone would
    price that away, and the served load alone does not cover the batches a grid does."""
    grid = [x for x, is_served in zip(samples, served) if not is_served]
    coeffs, _ = fit_iterations(base, grid, holdout_every)
    model = CostModel(base.hardware, base.model, coeffs, base.lora)
    taken = [(shape, t) for (shape, t), is_served in zip(samples, served) if is_served]
    return sum(t for _, t in taken) / sum(model.shape_time(shape) for shape, _ in taken)


def _colocation_text(environment: dict | None) -> str:
    n = (environment or {}).get("colocated") or 1
    if n == 1:
        return "the engine alone on the machine; "
    text = (f"the grid measured beside {n - 1} other engine(s) of the same arrangement "
            "serving a mixed closed-loop load on the same machine (calibrate --colocated)")
    if (environment or {}).get("served_iterations"):
        text += (f", the serving load run by a cluster of {n} replicas behind the gateway "
                 "(every replica's iterations), the grid's times scaled by how much slower those "
                 f"ran than it (serving_scale {environment.get('serving_scale', 1.0):.3f})")
    return text + ", so the times carry their interference; "


POOR_FIT = 0.15  # held-out MAPE over all iterations above which a calibration is called poor
POOR_KIND = 0.30  # and for one kind of batch


def fit_warnings(cal: CalibrationFile) -> list[str]:
    """Say when a fit is poor: the simulator's figures inherit its error."""
    out = []
    overall = cal.fit_error.iteration_mape
    if overall is not None and overall > POOR_FIT:
        out.append(f"the fit is poor: held-out MAPE {overall:.1%} (above {POOR_FIT:.0%}); simulations "
                   "with this calibration are off by about as much. Profile longer (--repeats, "
                   "--load-seconds) on an idle machine, or check the engine for noisy iterations")
    for key, value in cal.fit_error.detail.items():
        if key.startswith("holdout_mape_") and value > POOR_KIND:
            out.append(f"{key.removeprefix('holdout_mape_')} iterations are fitted poorly: "
                       f"held-out MAPE {value:.1%}")
    return out


def write(cal: CalibrationFile, rows: list[dict], out: Path) -> Path:
    save_calibration(cal, out)
    csv_path = out.with_suffix(".csv")
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    cal.source.files = [str(csv_path)]
    save_calibration(cal, out)
    return csv_path


def profile_engine(model_dir: str, adapter_dir: str | None, scheduler: SchedulerConfig,
                   grid: list[GridPoint], repeats: int, load_seconds: float, threads: int = 0,
                   backend: str = "torch", device: str | None = None, progress=None,
                   status=None) -> tuple[list[dict], dict]:
    """The grid, then ``load_seconds`` of mixed serving load (``profile_load``), on one engine
    in this process; returns the rows and where it ran (``engine_environment``). ``status``:
    a context manager factory that shows a message while the load runs."""
    from contextlib import nullcontext

    from orthrus_real.engine.device import engine_environment

    runner = calibration_engine(model_dir, adapter_dir, scheduler, threads=threads,
                                backend=backend, device=device)
    try:
        rows = profile(runner, grid, repeats, progress)
        if load_seconds > 0:
            with (status or nullcontext)(f"profiling {load_seconds:.0f} s of mixed serving load"):
                rows += profile_load(runner, load_seconds)
        return rows, engine_environment(runner.engine, backend, threads)
    finally:
        runner.stop()


def calibration_engine(model_dir: str, adapter_dir: str | None,
                       scheduler: SchedulerConfig | None = None,
                       kv_cache_tokens: int = 131072, threads: int = 0,
                       backend: str = "torch", device: str | None = None) -> EngineThread:
    """An engine thread (built and stepped in its own thread, as in serving), started."""
    from orthrus_real.server.backends import make_engine
    from orthrus_real.server.metrics import EngineMetrics

    def make():
        return make_engine(backend, model_dir, adapter_dir, "ibs",
                           scheduler or SchedulerConfig(),
                           kv_cache_tokens, device=device, threads=threads)

    runner = EngineThread(make, max_queued=10**6)
    EngineMetrics.attach(runner)
    return runner.start()
