"""What vLLM's CPU LoRA path costs per iteration for generation rows, which carry no adapter
(docs/history.md#fidelity-issue-22, "Why the fit-on-baselines predictions missed").

A batch without prefill rows (all decodes) takes vLLM's per-token ("bgmv") ops, which gather one
copy of the adapter weights per row; a batch with a prefill or embedding chunk takes the segment
("sgmv") ops. The plug-in installs its own versions of both (``orthrus_real/vllm_backend/
lora_cpu.py``), which skip rows without an adapter. This times the LoRA calls of one iteration
(every LoRA linear of every layer, the `small` model's shapes by default) for rows that all lack
the adapter, with vLLM's ops and with the plug-in's, on one thread. The harness allocates each
call's input and buffer: what is left with the plug-in's ops is mostly that.

Run (the vLLM environment): python -m benchmarks.engine.vllm_lora_rows [--rows 8,14] [--layers 12]
"""

from __future__ import annotations

import time

import torch
from vllm.lora.ops import torch_ops

from benchmarks.common import parser
from orthrus_real.vllm_backend import lora_cpu


def linears(hidden: int, intermediate: int, kv: int) -> list[tuple[int, list[int]]]:
    """(input width, output slices) of each LoRA linear of a layer: qkv, o, gate_up, down."""
    return [(hidden, [hidden, kv, kv]), (hidden, [hidden]), (hidden, [intermediate] * 2),
            (intermediate, [hidden])]


def one_iteration(ops, rows: int, layers: int, shapes, weights, rank: int, per_token: bool) -> None:
    idx = torch.full((rows,), -1, dtype=torch.long)
    starts, lengths = torch.arange(rows), torch.ones(rows, dtype=torch.long)
    for _ in range(layers):
        for (n_in, outs), stack in zip(shapes, weights):
            x = torch.randn(rows, n_in, dtype=torch.bfloat16)
            y = torch.zeros(rows, sum(outs), dtype=torch.bfloat16)
            offset = 0
            for (a, b), n_out in zip(stack, outs):
                buf = torch.zeros(rows, rank, dtype=torch.float32)
                if per_token:
                    ops.bgmv_shrink(x, a, buf, idx, 1.0)
                    ops.bgmv_expand_slice(buf, b, y, idx, offset, n_out, True)
                else:
                    meta = (starts, lengths, idx, rows, 1, rows)
                    ops.sgmv_shrink(x, a, buf, *meta, 1.0)
                    ops.sgmv_expand_slice(buf, b, y, *meta, offset, n_out, True)
                offset += n_out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", default="8,14", help="generation rows of the batch")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--kv", type=int, default=256, help="width of the k and v projections")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = linears(args.hidden, args.intermediate, args.kv)
    # two slots, the last kept empty (what -1 reaches in vLLM's ops), as the engine keeps them
    weights = [[(torch.zeros(2, 1, args.rank, n_in, dtype=torch.bfloat16),
                 torch.zeros(2, 1, n_out, args.rank, dtype=torch.bfloat16)) for n_out in outs]
               for n_in, outs in shapes]
    cases = [("vLLM per-token (decode-only batch)", torch_ops, True),
             ("plug-in per-token (decode-only batch)", lora_cpu, True),
             ("plug-in segments (mixed batch)", lora_cpu, False)]
    for rows in (int(r) for r in args.rows.split(",")):
        for name, ops, per_token in cases:
            one_iteration(ops, rows, args.layers, shapes, weights, args.rank, per_token)
            start = time.perf_counter()
            for _ in range(args.repeat):
                one_iteration(ops, rows, args.layers, shapes, weights, args.rank, per_token)
            ms = (time.perf_counter() - start) / args.repeat * 1e3
            print(f"{rows:3d} rows without an adapter, {name}: {ms:.1f} ms per iteration")


if __name__ == "__main__":
    main()
