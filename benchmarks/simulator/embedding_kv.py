"""What storing an embedding's KV only where a later chunk reads it frees (issue 24), simulated.

Runs a scenario's co-serving configurations twice, ``scheduler.embedding_kv=all`` (every
embedding token's keys and values stored, the behaviour before: identical results) and ``read``
(the default: an embedding's last chunk, so a one-chunk embedding entirely, stores none), and
prints one markdown table: mean and peak KV-cache use over the measurement window, all of it
and the embeddings' part (the timeline's samples, every ``timeline_interval_s``, averaged over
GPUs; in brackets blocks per GPU), preemptions, throughput and p99 latencies per kind. Simulated figures,
not timings: no benchmark lock needed.

With ``--engine``, the PyTorch engine instead (a seeded ``small`` Llama, or ``--model``; its
default dtype): the same inputs embedded by an engine of each mode, alternating, ``--repeats``
times after a warm-up: peak KV blocks in use during a pass and embeddings per second (a
timing: run it under the benchmark lock, ``flock /tmp/orthrus-bench.lock ...``), for inputs of
one chunk and of two.

Run: python -m benchmarks.simulator.embedding_kv scenarios/kv_pressure.yaml
     python -m benchmarks.simulator.embedding_kv scenarios/mix_sweep.yaml \
         --set workload.generation_share=0.5
     python -m benchmarks.simulator.embedding_kv --engine [--repeats 3] [--model DIR]
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from benchmarks.common import add_model_argument, alternate, model_dir, parser, random_tokens, timed
from orthrus_sim.experiment.plan import plan_configuration
from orthrus_sim.experiment.scenario import is_unified, load_scenario
from orthrus_sim.sim.run import simulate

MODES = ("all", "read")


def kv_use(timeline: list[dict], start: float, column: str) -> tuple[float, float]:
    """Mean and peak of a KV column (a fraction of the cache, averaged over GPUs) in the
    window."""
    per_sample = []
    for row in timeline:
        if row["time_s"] <= start:
            continue
        use = [v for k, v in row.items() if k.startswith(column)]
        per_sample.append(sum(use) / len(use))
    if not per_sample:
        return 0.0, 0.0
    return sum(per_sample) / len(per_sample), max(per_sample)


def measure(path: str, overrides: list[str], configurations: list[str] | None) -> list[dict]:
    rows = []
    base = load_scenario(path, overrides)
    names = configurations or [c for c in base.configurations if is_unified(c)]
    for name in names:
        for mode in MODES:
            sc = load_scenario(path, [*overrides, f"scheduler.embedding_kv={mode}"])
            blocks = plan_configuration(sc, name)[0].config.num_blocks
            run = simulate(sc, name, keep_rows=False)
            m = run.metrics
            mean, peak = kv_use(run.timeline, sc.warmup_s, "kv_usage_")
            emb_mean, emb_peak = kv_use(run.timeline, sc.warmup_s, "kv_embedding_")
            lat = m["latency_s"]
            rows.append({
                "configuration": name, "embedding_kv": mode, "blocks": blocks,
                "kv_mean": mean, "kv_peak": peak, "emb_mean": emb_mean, "emb_peak": emb_peak,
                "preempt": sum(m["preemptions"].values()),
                "emb_s": m["throughput_rps"]["embedding"], "gen_s": m["throughput_rps"]["generation"],
                "out_tok_s": m["output_tokens_per_s"],
                "emb_p99": lat["embedding"]["p99"], "ttft_p99": lat["ttft"]["p99"],
                "tpot_p99": lat["tpot"]["p99"], "gen_p99": lat["generation"]["p99"],
            })
    return rows


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    head = ("| configuration | embedding_kv | KV mean | KV peak | embeddings' KV mean | "
            "embeddings' KV peak | preemptions | emb/s | gen/s | out tok/s | emb p99 (s) | "
            "TTFT p99 (s) | TPOT p99 (s) | gen e2e p99 (s) |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        cells = [f"{r[k]:.1%} ({r[k] * r['blocks']:.0f})"
                 for k in ("kv_mean", "kv_peak", "emb_mean", "emb_peak")]
        lines.append(
            f"| {r['configuration']} | {r['embedding_kv']} | {' | '.join(cells)} | "
            f"{r['preempt']} | "
            f"{_f(r['emb_s'], '.3f')} | {_f(r['gen_s'], '.3f')} | {_f(r['out_tok_s'], '.0f')} | "
            f"{_f(r['emb_p99'], '.3f')} | {_f(r['ttft_p99'], '.2f')} | "
            f"{_f(r['tpot_p99'], '.4f')} | {_f(r['gen_p99'], '.1f')} |")
    return "\n".join(lines)


def engine_figures(model: Path, repeats: int) -> str:
    """Peak blocks in use and embeddings/s of the PyTorch engine, ``all`` against ``read``."""
    import statistics

    import numpy as np
    import torch

    from orthrus_real.engine.torch_engine import Engine
    from orthrus_sim.engine import SchedulerConfig

    torch.set_num_threads(2)
    count, chunk = 32, 512
    engines, peaks = {}, {}
    for mode in MODES:
        eng = Engine(model, scheduler=SchedulerConfig(token_budget=2048, chunk_size=chunk,
                                                      embedding_kv=mode),
                     kv_cache_tokens=count * 2 * chunk)
        forward = eng.forward

        def watched(batch, forward=forward, eng=eng, mode=mode):
            peaks[mode] = max(peaks.get(mode, 0), eng.policy.blocks.num_used)
            return forward(batch)

        eng.forward = watched
        engines[mode] = eng
    rng = np.random.default_rng(0)
    vocab = engines["read"].cfg.vocab_size
    names = iter(range(10**9))
    lines = [f"PyTorch engine, {model.name} model, {engines['read'].cfg.dtype}, "
             f"{count} inputs a run, chunk_size {chunk}, median of {repeats}:", "",
             "| input tokens | embedding_kv | peak KV blocks in use | embeddings/s | "
             "read / all |", "|---|---|---|---|---|"]

    def embed_all(eng: Engine, inputs: list[list[int]]) -> None:
        for x in inputs:
            eng.add_embedding(f"e{next(names)}", token_ids=x, pooling="mean")
        eng.run_until_idle()

    for length in (128, chunk + 128):
        inputs = [random_tokens(rng, length, vocab) for _ in range(count)]
        peaks.clear()
        times = alternate({m: partial(timed, partial(embed_all, engines[m], inputs))
                           for m in MODES}, repeats + 1, reverse=False)
        # the first round warms up
        rate = {m: count / statistics.median(times[m][1:]) for m in MODES}
        for mode in MODES:
            ratio = f"{rate['read'] / rate['all']:.3f}x" if mode == "read" else ""
            lines.append(f"| {length} | {mode} | {peaks.get(mode, 0)} | {rate[mode]:.2f} | "
                         f"{ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("scenario", nargs="?")
    ap.add_argument("--engine", action="store_true", help="the PyTorch engine, not a scenario")
    add_model_argument(ap, "small", "; with --engine")
    ap.add_argument("--repeats", type=int, default=3, help="--engine: timed rounds")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="section.key=value, as orthrus-sim run --set")
    ap.add_argument("--configurations", default="",
                    help="comma-separated (default: the scenario's unified ones, which co-serve)")
    args = ap.parse_args()
    if args.engine:
        with model_dir(args.model, "small") as model:
            print(engine_figures(model, args.repeats))
        return
    if not args.scenario:
        ap.error("give a scenario, or --engine")
    configs = [c for c in args.configurations.split(",") if c] or None
    print(table(measure(args.scenario, args.overrides, configs)))


if __name__ == "__main__":
    main()
