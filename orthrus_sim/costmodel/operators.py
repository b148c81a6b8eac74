"""FLOPs and bytes moved by each operator of one iteration (the roofline's inputs).

Operators follow a Llama-family layer: norm, fused QKV, RoPE, attention (chunks and decodes
separately), O projection, norm, fused gate/up, activation, down, two residual adds; an
embedding adapter adds LoRA shrink/expand on the embedding rows only. Once per iteration: token
embedding, final norm, the LM head and sampler on sampling rows only, the pooler.
Tensor parallelism is out of scope: one replica is one device.
"""

from __future__ import annotations

from orthrus_sim.costmodel.model import LoRASpec, ModelSpec
from orthrus_sim.costmodel.shape import BatchShape

# operator -> times it runs per layer (0 for once-per-iteration operators)
PER_LAYER = {
    "input_norm": 1, "qkv": 1, "rope": 1, "attn_prefill": 1, "attn_decode": 1, "o_proj": 1,
    "post_norm": 1, "gate_up": 1, "act": 1, "down": 1, "add": 2, "lora": 1,
}
ONCE = ("embed", "final_norm", "lm_head", "sampler", "pooler")
OPERATORS = tuple(PER_LAYER) + ONCE
LINEAR_OPS = ("qkv", "o_proj", "gate_up", "down", "lm_head")
ATTENTION_OPS = ("attn_prefill", "attn_decode")
ELEMENTWISE_OPS = ("input_norm", "rope", "post_norm", "act", "add", "embed", "final_norm",
                   "sampler", "pooler")


def _linear(rows: float, n_in: int, n_out: int, b: int) -> tuple[float, float]:
    """A dense matmul over ``rows`` rows: weights read once, activations in and out."""
    return 2.0 * rows * n_in * n_out, b * (n_in * n_out + rows * (n_in + n_out))


def lora_shapes(model: ModelSpec, lora: LoRASpec) -> list[tuple[int, int]]:
    d, i = model.hidden_size, model.intermediate_size
    dims = {"q_proj": (d, model.q_width), "k_proj": (d, model.kv_width),
            "v_proj": (d, model.kv_width), "o_proj": (model.q_width, d),
            "gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)}
    return [dims[t] for t in lora.targets]


def token_work(model: ModelSpec, tokens: int) -> dict[str, tuple[float, float]]:
    """Operators whose work depends only on the token count (per layer where per-layer)."""
    b = model.dtype_bytes
    t = tokens
    d = model.hidden_size
    q, kv = model.q_width, model.kv_width
    norm = (4.0 * t * d, b * (2 * t * d + d))
    return {
        "input_norm": norm,
        "post_norm": norm,
        "qkv": _linear(t, d, q + 2 * kv, b),
        "rope": (6.0 * t * (q + kv), b * 2 * t * (q + kv)),
        "o_proj": _linear(t, q, d, b),
        "gate_up": _linear(t, d, model.mlp_in_width, b),
        "act": (5.0 * t * model.intermediate_size,
                b * t * (model.mlp_in_width + model.intermediate_size)),
        "down": _linear(t, model.intermediate_size, d, b),
        "add": (1.0 * t * d, b * 3 * t * d),
        "embed": (0.0, b * 2 * t * d),
        "final_norm": norm,
    }


def variable_work(model: ModelSpec, shape: BatchShape,
                  lora: LoRASpec | None = None) -> dict[str, tuple[float, float]]:
    """Operators whose work depends on the batch's make-up: attention, LoRA, heads."""
    b = model.dtype_bytes
    d = model.hidden_size
    q, kv, hd = model.q_width, model.kv_width, model.head_dim
    work: dict[str, tuple[float, float]] = {}
    # causal attention of chunks: QK^T and PV, 2 FLOPs per multiply-add each
    work["attn_prefill"] = (4.0 * model.num_heads * hd * shape.chunk_pairs,
                            b * (2 * kv * shape.chunk_kv + 2 * q * shape.chunk_tokens))
    work["attn_decode"] = decode_attention_work(model, shape.decode_kv, shape.decodes)
    if lora is not None and shape.lora_rows:
        flops = bytes_ = 0.0
        r, rows = lora.rank, shape.lora_rows
        for n_in, n_out in lora_shapes(model, lora):
            flops += 2.0 * rows * r * (n_in + n_out)
            bytes_ += b * (r * (n_in + n_out) + rows * (n_in + n_out + 2 * r))
        work["lora"] = (flops, bytes_)
    else:
        work["lora"] = (0.0, 0.0)
    s = shape.sample_rows
    work["lm_head"] = _linear(s, d, model.vocab_size, b) if s else (0.0, 0.0)
    work["sampler"] = (5.0 * s * model.vocab_size, 4 * 3 * s * model.vocab_size)
    work["pooler"] = (2.0 * shape.pooled_rows * d, b * shape.pooled_rows * d)
    return work


def decode_attention_work(model: ModelSpec, decode_kv: int, decodes: int) -> tuple[float, float]:
    """Decodes: one query row each, the whole cached K/V streamed in (per layer)."""
    return decode_attention_work_at(decode_attention_rates(model), decode_kv, decodes)


def decode_attention_work_at(rates: tuple[float, int, int, int], decode_kv: int,
                             decodes: int) -> tuple[float, float]:
    """``decode_attention_work`` from the model's ``decode_attention_rates``."""
    flops_per_kv, b, kv_row, q_row = rates
    return flops_per_kv * decode_kv, b * (kv_row * decode_kv + q_row * decodes)


def decode_attention_work_steps(rates: tuple[float, int, int, int], decode_kv: int, decodes: int,
                                steps: int) -> list[tuple[float, float]]:
    """``decode_attention_work_at`` of ``steps`` consecutive decode iterations, each decode's
    context one token longer a step (the same arithmetic, without a call per step)."""
    flops_per_kv, b, kv_row, q_row = rates
    q_elems = q_row * decodes
    return [(flops_per_kv * rows, b * (kv_row * rows + q_elems))
            for rows in range(decode_kv, decode_kv + decodes * steps, decodes)]


def decode_attention_rates(model: ModelSpec) -> tuple[float, int, int, int]:
    """``decode_attention_work``'s factors: FLOPs per cached row, bytes per element, elements
    per cached row (K and V) and per decode (its query and output); a decode run prices many
    steps with them without a call per step."""
    return 4.0 * model.num_heads * model.head_dim, model.dtype_bytes, 2 * model.kv_width, 2 * model.q_width


def operator_work(model: ModelSpec, shape: BatchShape,
                  lora: LoRASpec | None = None) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of every operator, for ONE layer for per-layer operators."""
    return {**token_work(model, shape.tokens), **variable_work(model, shape, lora)}
