"""What the Orthrus plug-in costs vLLM: the same offline generation workload through stock vLLM
(its own scheduler, ``LLM.generate``) and through ``VllmEngine`` (the core's policy deciding
every batch, the pooling mix-in in the runner), in one run on one machine.

Requests: N prompts of 128 random tokens -> 128 greedy tokens (ignore_eos), all submitted at
once; output tokens per second over the whole run (engine start-up excluded), each figure the
median of --repeats runs.

Run (vLLM installed): python -m benchmarks.engine.vllm_overhead [--requests 64] [--model DIR]
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks.common import add_model_argument, greedy, model_dir, parser, random_tokens

PROMPT, OUTPUT = 128, 128


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [random_tokens(rng, PROMPT, 8000) for _ in range(n)]


def stock(model: str, reqs: list[list[int]], repeats: int, budget: int) -> float:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=1024, max_num_batched_tokens=budget, max_num_seqs=256,
              enforce_eager=True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r} for r in reqs], params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    del llm
    return statistics.median(rates)


def plugin(model: str, reqs: list[list[int]], repeats: int, budget: int, policy: str) -> float:
    from orthrus_real.vllm_backend.engine import VllmEngine
    from orthrus_sim.engine import SchedulerConfig

    engine = VllmEngine(model, policy=policy, kv_cache_tokens=len(reqs) * 300,
                        scheduler=SchedulerConfig(token_budget=budget, max_num_seqs=256,
                                                  max_model_len=1024))
    params = greedy(OUTPUT)
    rates = []
    for rep in range(repeats):
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            engine.add_generation(f"{rep}-{i}", token_ids=r, params=params)
        done = engine.run_until_idle()
        rates.append(sum(len(o.token_ids) for o in done.values()) / (time.perf_counter() - t0))
    engine.close()
    return statistics.median(rates)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=2048)
    add_model_argument(ap, "small")
    args = ap.parse_args()
    with model_dir(args.model, "small") as model:
        from orthrus_real.vllm_backend.support import prepare_environment

        prepare_environment()  # the same KV-cache space and model runner for both
        reqs = prompts(args.requests)
        base = stock(str(model), reqs, args.repeats, args.token_budget)
        print(f"{args.requests} requests x {OUTPUT} tokens, budget {args.token_budget}")
        print(f"stock vLLM (its scheduler)        {base:8.1f} output tok/s")
        for policy in ("generation", "ibs"):
            rate = plugin(str(model), reqs, args.repeats, args.token_budget, policy)
            print(f"plug-in, policy {policy:<17} {rate:8.1f} output tok/s  ({rate / base:.2f}x stock)")


if __name__ == "__main__":
    main()
