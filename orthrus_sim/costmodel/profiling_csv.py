"""Read per-operator profiling CSVs (Vidur's ``mlp.csv`` layout, as in ``calibration/data``)."""

from __future__ import annotations

import csv
from pathlib import Path

from orthrus_sim.costmodel.model import ModelSpec
from orthrus_sim.costmodel.operators import token_work

# CSV operator name -> this package's operator name
CSV_OPS = {
    "emb": "embed",
    "input_layernorm": "input_norm",
    "attn_pre_proj": "qkv",
    "attn_rope": "rope",
    "attn_post_proj": "o_proj",
    "post_attention_layernorm": "post_norm",
    "mlp_up_proj": "gate_up",
    "mlp_act": "act",
    "mlp_down_proj": "down",
    "add": "add",
}


def spec_from_row(row: dict, name: str) -> ModelSpec:
    d = int(row["n_embd"])
    heads = int(row["n_head"])
    return ModelSpec(name=name, hidden_size=d, num_layers=1, num_heads=heads,
                     num_kv_heads=int(row["n_kv_head"]), head_dim=d // heads,
                     intermediate_size=int(row["n_expanded_embd"]),
                     vocab_size=int(row["vocab_size"]),
                     gated_mlp=row["use_gated_mlp"] in ("True", "true", "1"))


def load_operator_rows(path: str | Path, tensor_parallel: int = 1) -> list[dict]:
    """Rows ``{model, tokens, op, flops, bytes, seconds}`` (median time, seconds per layer)."""
    path = Path(path)
    name = path.name.split("_")[0]
    out = []
    with path.open() as fh:
        for row in csv.DictReader(fh):
            if int(row["num_tensor_parallel_workers"]) != tensor_parallel:
                continue
            spec = spec_from_row(row, name)
            tokens = int(row["num_tokens"])
            work = token_work(spec, tokens)
            for csv_op, op in CSV_OPS.items():
                flops, bytes_ = work[op]
                out.append({"model": name, "tokens": tokens, "op": op, "flops": flops,
                            "bytes": bytes_,
                            "seconds": float(row[f"time_stats.{csv_op}.median"]) * 1e-3})
    return out
