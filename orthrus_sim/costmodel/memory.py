"""Device memory: weights, activations, and how many KV blocks fit in what is left."""

from __future__ import annotations

from orthrus_sim.costmodel.hardware import Hardware
from orthrus_sim.costmodel.model import LoRASpec, ModelSpec
from orthrus_sim.costmodel.operators import lora_shapes


def lora_bytes(model: ModelSpec, lora: LoRASpec | None) -> int:
    if lora is None:
        return 0
    per_layer = sum(lora.rank * (n_in + n_out) for n_in, n_out in lora_shapes(model, lora))
    return per_layer * model.num_layers * model.dtype_bytes


def activation_bytes(model: ModelSpec, token_budget: int, max_num_seqs: int) -> int:
    """Peak transient memory of one forward pass: the widest per-token buffers of a layer for
    every token of the budget, plus fp32 logits for every sequence that may sample."""
    widest = model.hidden_size * 4 + model.mlp_in_width + model.intermediate_size
    return token_budget * widest * model.dtype_bytes + max_num_seqs * model.vocab_size * 4


def kv_cache_blocks(hardware: Hardware, model: ModelSpec, block_size: int,
                    token_budget: int, max_num_seqs: int, memory_utilization: float = 0.9,
                    lora: LoRASpec | None = None) -> int:
    """Number of KV blocks that fit once weights, adapter and activations are placed.

    ``memory_utilization`` is the fraction of device memory the replica may use (vLLM's
    ``gpu_memory_utilization``).
    """
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    usable = hardware.mem_capacity * memory_utilization
    fixed = (model.weight_bytes + lora_bytes(model, lora)
             + activation_bytes(model, token_budget, max_num_seqs))
    free = usable - fixed
    per_block = block_size * model.kv_bytes_per_token
    blocks = int(free // per_block)
    if blocks <= 0:
        raise ValueError(
            f"model {model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) leaves no room "
            f"for a KV cache on {hardware.name} ({hardware.mem_capacity / 1e9:.0f} GB at "
            f"memory_utilization {memory_utilization})"
        )
    return blocks
