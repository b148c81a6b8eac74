"""Pooling-equivalence report (brief §2.2 protocol) through the real engine.

250 inputs spanning 16 to 2,048 tokens; chunk sizes 256, 512, 1024; heads mean, CLS and
weighted-mean; fp32 and bf16. Each embedding is computed chunked (the engine with that chunk
size) and single-pass (chunk size = budget = 2,048, one pass); prints min cosine similarity and
mean / p99 relative L2 error per configuration.

Run: python -m benchmarks.engine.pooling_equivalence [--size tiny|small] [--inputs 250]
(tiny is the default: the protocol is about the pooler's arithmetic, and 3 M tokens per dtype
through the 100 M-parameter small model take ~30 min on 2 CPU cores.)
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from benchmarks.common import model_dir, parser, percentile, random_tokens, table
from orthrus_real.engine.torch_engine import Engine
from orthrus_sim.engine import SchedulerConfig

HEADS = ("mean", "cls", "weighted-mean")
CHUNKS = (256, 512, 1024)
MAX_LEN = 2048


def embed_all(model: Path, dtype: str, chunk: int, inputs: list[list[int]]) -> dict:
    engine = Engine(model, dtype=dtype, kv_cache_tokens=64 * MAX_LEN,
                    scheduler=SchedulerConfig(token_budget=MAX_LEN, chunk_size=chunk, block_size=16))
    for i, ids in enumerate(inputs):
        for head in HEADS:
            engine.add_embedding(f"{i}/{head}", token_ids=ids, pooling=head, normalize=False)
    out = engine.run_until_idle()
    return {k: np.asarray(v.embedding, dtype=np.float64) for k, v in out.items()}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--inputs", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(args.seed)
    lengths = np.linspace(16, MAX_LEN, args.inputs).astype(int)
    with model_dir(None, args.size, "m", seed=args.seed,
                   max_position_embeddings=MAX_LEN * 2) as model:
        vocab = 500 if args.size == "tiny" else 8000
        inputs = [random_tokens(rng, n, vocab) for n in lengths]
        out = table(f"Chunked vs single-pass pooling, {args.inputs} inputs of 16-{MAX_LEN} "
                    f"tokens, {args.size} model",
                    ["dtype", "head", "chunk", "min cosine", "mean rel L2", "p99 rel L2"])
        for dtype in ("float32", "bfloat16"):
            start = time.perf_counter()
            single = embed_all(model, dtype, MAX_LEN, inputs)
            for chunk in CHUNKS:
                chunked = embed_all(model, dtype, chunk, inputs)
                for head in HEADS:
                    cos, rel = [], []
                    for i in range(len(inputs)):
                        a, b = chunked[f"{i}/{head}"], single[f"{i}/{head}"]
                        cos.append(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
                        rel.append(np.linalg.norm(a - b) / np.linalg.norm(b))
                    out.add_row(dtype, head, str(chunk), f"{min(cos):.8f}", f"{np.mean(rel):.2e}",
                                f"{percentile(rel, 99):.2e}")
            Console().print(f"{dtype}: {time.perf_counter() - start:.0f} s")
        Console().print(out)
        Console().print("Chunked and single-pass pooling are the same sums; what differs is the "
                        "order of floating-point reductions (attention over cached keys in "
                        "blocks, matmul tiling over a different number of rows, and the pooler "
                        "adding per-chunk partial sums). Both paths read keys and values back from "
                        "the same KV cache, so fp32 residues are ~1e-7 (its 24-bit mantissa); in "
                        "bf16 (8-bit mantissa) each differently-ordered rounding is coarser. The "
                        "pooler itself accumulates in fp32 either way.")


if __name__ == "__main__":
    main()
