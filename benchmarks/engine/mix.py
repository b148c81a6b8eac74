"""The paper's claim on this CPU: one engine serving a mixed workload under Orthrus against the
unified baselines and a dedicated split (an embedding-only and a generation-only engine in two
processes, one core each), same clients and duration for all.

Clients are closed-loop streams: G generation streams (128-token prompt -> 128 tokens, greedy)
and E embedding streams (128-token inputs, mean pooling), E = G x (embedding share / generation
share), for mixes 5:5 and 1:9. Generation throughput is output tokens per second (a generation
request outlives a short window under load, so completed requests would mostly count zero);
embedding throughput is inputs per second; both after a warm-up. "Normalised" is
generation/generation-alone + embedding/embedding-alone, where "alone" is the same streams of
one type on an engine with both cores (the vLLM dedicated split measured 1.09).

With ``--calibration FILE`` (the engine's calibration, `orthrus-real calibrate`) it adds "ibs +
target": IBS with an iteration-time target of ``--target-x`` (default 1.5) times the decode-only
step the calibration predicts for the G streams (at mid-output context), and reports each
configuration's generation TPOT p99 against it (docs/scheduler.md, "Iteration-time target").

Run: python -m benchmarks.engine.mix [--duration 20] [--streams 4,16,64] [--mixes 5:5,1:9]
     [--backend torch|vllm] [--calibration calibration/cpu-2core-small.json --model DIR]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from rich.console import Console

from benchmarks.common import add_model_argument, greedy, model_dir, parser, percentile, random_tokens, table

PROMPT, OUTPUT, EMB_LEN = 128, 128, 128


def run_clients(model: str, policy: str, gen_streams: int, emb_streams: int, duration: float,
                warmup: float, threads: int, core: int | None = None, budget: int = 2048,
                backend: str = "torch", gpu_share: float | None = None,
                target: float | None = None, calibration: str | None = None) -> dict:
    """Closed-loop clients against one in-process engine; returns per-type counts and latencies."""
    if core is not None:
        os.sched_setaffinity(0, {core})
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)  # the vLLM worker's OpenMP team
    from orthrus_real.server.backends import make_engine
    from orthrus_sim.engine import SchedulerConfig

    chunk = None if policy == "embedding-only" else min(512, budget)
    engine = make_engine(backend, model, policy=policy,
                         kv_cache_tokens=(gen_streams + emb_streams + 4) * 320,
                         scheduler=SchedulerConfig(token_budget=budget, chunk_size=chunk,
                                                   max_num_seqs=256, tpot_target_s=target),
                         threads=threads, gpu_memory_utilization=gpu_share,
                         calibration=calibration)
    rng = np.random.default_rng(0)
    ids = iter(range(10**9))
    started: dict[str, tuple[str, float]] = {}

    def submit(kind: str) -> None:
        rid = f"{kind[0]}{next(ids)}"
        tokens = random_tokens(rng, PROMPT if kind == "generation" else EMB_LEN,
                               engine.cfg.vocab_size)
        if kind == "generation":
            engine.add_generation(rid, token_ids=tokens, params=greedy(OUTPUT))
        else:
            engine.add_embedding(rid, token_ids=tokens)
        started[rid] = (kind, time.perf_counter())

    # warm the kernels before the clock starts
    submit("generation") if gen_streams else submit("embedding")
    engine.run_until_idle()
    started.clear()
    for _ in range(gen_streams):
        submit("generation")
    for _ in range(emb_streams):
        submit("embedding")
    t0 = time.perf_counter()
    done = {"embedding": 0, "generation": 0}
    latency = {"embedding": [], "generation": []}
    tokens = 0
    first_token: dict[str, float] = {}
    tpots: list[float] = []
    while time.perf_counter() - t0 < duration:
        for out in engine.step():
            now = time.perf_counter()
            if out.kind == "generation":
                first_token.setdefault(out.request_id, now)
                if now - t0 >= warmup:
                    tokens += 1
            if not out.finished:
                continue
            kind, began = started.pop(out.request_id)
            if now - t0 >= warmup:
                done[kind] += 1
                latency[kind].append(now - began)
                if kind == "generation":
                    tpots.append((now - first_token[out.request_id]) / (OUTPUT - 1))
            first_token.pop(out.request_id, None)
            submit(kind)
    window = duration - warmup
    engine.close()
    return {"embedding": done["embedding"] / window, "generation": tokens / window,
            "lat_embedding": statistics.median(latency["embedding"]) if latency["embedding"] else None,
            "lat_generation": statistics.median(latency["generation"]) if latency["generation"] else None,
            "tpot_p99": percentile(tpots, 99)}


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def dedicated(model: str, gen_streams: int, emb_streams: int, duration: float, warmup: float,
              backend: str = "torch") -> dict:
    # non-daemonic workers: a vLLM engine starts a worker process of its own; on a GPU the two
    # engines share it, each with 40 % of its memory
    share = 0.4 if backend == "vllm" and _has_gpu() else None
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        emb = pool.submit(run_clients, model, "embedding-only", 0, emb_streams, duration,
                          warmup, 1, 0, 2048, backend, share)
        gen = pool.submit(run_clients, model, "generation", gen_streams, 0, duration,
                          warmup, 1, 1, 2048, backend, share)
        e, g = emb.result(), gen.result()
    return {"embedding": e["embedding"], "generation": g["generation"],
            "lat_embedding": e["lat_embedding"], "lat_generation": g["lat_generation"],
            "tpot_p99": g["tpot_p99"]}


def decode_step_target(calibration: str, model: str, streams: int, times: float) -> float:
    """``times`` x the decode-only step the calibration predicts for ``streams`` decodes."""
    from orthrus_sim.costmodel import calibrated_predictor
    from orthrus_sim.engine import BatchItem, BatchUnit, ItemKind, Request, RequestKind

    req = Request("probe", RequestKind.GENERATION, 0.0, PROMPT, max_output_tokens=OUTPUT)
    batch = BatchUnit(10**6)
    batch.add_decodes([BatchItem(req, ItemKind.DECODE, PROMPT + OUTPUT // 2, 1)] * streams)
    return times * calibrated_predictor(calibration, model).predict(batch)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--streams", default="4,16,64")
    ap.add_argument("--mixes", default="5:5,1:9")
    add_model_argument(ap, "small")
    ap.add_argument("--token-budget", type=int, default=2048,
                    help="budget of the unified engines (a small one keeps decode steps short); "
                    "the single-task engines keep 2048")
    ap.add_argument("--policies", default="ibs,unified-hetero,unified-homo")
    ap.add_argument("--backend", default="torch", choices=("torch", "vllm"),
                    help="the PyTorch engine, or vLLM with the Orthrus plug-in (every "
                         "configuration, the single-task engines included, on that backend)")
    ap.add_argument("--calibration", default=None,
                    help="the engine's calibration: adds IBS with an iteration-time target")
    ap.add_argument("--target-x", type=float, default=1.5,
                    help="the target in decode-only steps (predicted by --calibration)")
    args = ap.parse_args()
    with model_dir(args.model, "small") as model:
        mixes(args, str(model))


def mixes(args, model: str) -> None:
    """Every mix and stream count: each configuration beside the engines alone, one table."""
    console = Console(width=170)
    out = table(f"Mixed workloads ({args.backend} backend) on the small model, 2 CPU cores, "
                f"{args.duration:.0f} s each ({args.warmup:.0f} s warm-up)",
                ["mix e:g", "gen streams", "emb streams", "configuration", "emb inputs/s",
                 "gen tokens/s", "normalised", "vs dedicated", "emb p50 s", "gen p50 s",
                 "TPOT p99 ms", "target ms"])
    for mix in args.mixes.split(","):
        e_share, g_share = (float(x) for x in mix.split(":"))
        for g in (int(x) for x in args.streams.split(",")):
            e = max(1, round(g * e_share / g_share))
            b = args.backend
            gen_alone = run_clients(model, "generation", g, 0, args.duration, args.warmup, 2,
                                    backend=b)
            emb_alone = run_clients(model, "embedding-only", 0, e, args.duration, args.warmup, 2,
                                    backend=b)
            results = {"dedicated 1:1 cores": dedicated(model, g, e, args.duration, args.warmup, b)}
            for policy in args.policies.split(","):
                results[policy] = run_clients(model, policy, g, e, args.duration, args.warmup, 2,
                                              budget=args.token_budget, backend=b)
            target = None
            if args.calibration:
                target = decode_step_target(args.calibration, model, g, args.target_x)
                results["ibs + target"] = run_clients(
                    model, "ibs", g, e, args.duration, args.warmup, 2, budget=args.token_budget,
                    backend=b, target=target, calibration=args.calibration)
            base = results["dedicated 1:1 cores"]
            for name, r in results.items():
                norm = r["generation"] / gen_alone["generation"] + r["embedding"] / emb_alone["embedding"]
                base_norm = (base["generation"] / gen_alone["generation"]
                             + base["embedding"] / emb_alone["embedding"])
                out.add_row(mix, str(g), str(e), name, f"{r['embedding']:.2f}",
                            f"{r['generation']:.1f}", f"{norm:.2f}", f"{norm / base_norm:.2f}x",
                            f"{r['lat_embedding']:.2f}" if r["lat_embedding"] else "-",
                            f"{r['lat_generation']:.1f}" if r["lat_generation"] else "-",
                            f"{r['tpot_p99'] * 1e3:.1f}" if r["tpot_p99"] else "-",
                            f"{target * 1e3:.1f}" if target and name == "ibs + target" else "-")
            console.print(f"done {mix} G={g}: alone gen {gen_alone['generation']:.1f} tok/s, "
                          f"emb {emb_alone['embedding']:.2f}/s")
    console.print(out)


if __name__ == "__main__":
    main()
