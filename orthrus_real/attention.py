"""Packed causal attention over a paged KV cache.

Every item of a batch unit attends to its own cached context plus itself, causally. New keys
and values are written to their cache slots first; then each chunk item (embedding or prefill)
attends over its gathered context with an offset causal mask, and all decodes attend together
in one padded call. Slot of position p of a request = table[p // block_size] * block_size +
p % block_size, where ``table`` is the core's block table for that request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orthrus_sim.engine.batch import BatchUnit, ItemKind


@dataclass
class ChunkPlan:
    rows: slice  # rows of the batch's hidden states
    slots: torch.Tensor  # cache slots of positions 0 .. context + n - 1
    mask: torch.Tensor | None  # (n, context + n) bool, None when context == 0 (plain causal)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of every new token
    positions: torch.Tensor  # (T,) position of every token in its sequence
    chunks: list[ChunkPlan]
    decode_rows: slice  # contiguous rows of the decodes (sorted last)
    decode_slots: torch.Tensor | None  # (B, L) padded context slots
    decode_mask: torch.Tensor | None  # (B, 1, 1, L) True where a slot is real


def _slots(table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def build_metadata(batch: BatchUnit, tables: dict[str, list[int]], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    slot_parts, pos_parts, chunks = [], [], []
    decode_items = []
    row = 0
    decode_start = None
    for item in batch.items:
        rid = item.request.request_id
        table = tables[rid]
        pos_parts.append(torch.arange(item.start, item.end))
        slot_parts.append(_slots(table, item.start, item.end, block_size))
        rows = slice(row, row + item.num_tokens)
        if item.kind is ItemKind.DECODE:
            if decode_start is None:
                decode_start = row
            decode_items.append((item, table))
        else:
            n, ctx = item.num_tokens, item.start
            mask = None
            if ctx:
                mask = torch.ones(n, ctx + n, dtype=torch.bool).tril(diagonal=ctx)
                mask = mask.to(device)
            chunks.append(ChunkPlan(rows, _slots(table, 0, item.end, block_size).to(device), mask))
        row += item.num_tokens
    decode_slots = decode_mask = None
    if decode_items:
        longest = max(it.end for it, _ in decode_items)
        decode_slots = torch.zeros(len(decode_items), longest, dtype=torch.long)
        decode_mask = torch.zeros(len(decode_items), 1, 1, longest, dtype=torch.bool)
        for i, (it, table) in enumerate(decode_items):
            decode_slots[i, :it.end] = _slots(table, 0, it.end, block_size)
            decode_mask[i, 0, 0, :it.end] = True
        decode_slots, decode_mask = decode_slots.to(device), decode_mask.to(device)
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_parts).to(device), positions=torch.cat(pos_parts).to(device),
        chunks=chunks,
        decode_rows=slice(decode_start, row) if decode_start is not None else slice(row, row),
        decode_slots=decode_slots, decode_mask=decode_mask,
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D), caches (slots, KVH, D) -> (T, H, D)."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for chunk in meta.chunks:
        qc = q[chunk.rows].transpose(0, 1)  # (H, n, D)
        kc = k_cache[chunk.slots].transpose(0, 1)  # (KVH, ctx+n, D)
        vc = v_cache[chunk.slots].transpose(0, 1)
        if chunk.mask is None:
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk.mask, scale=scale,
                                               enable_gqa=gqa)
        out[chunk.rows] = o.transpose(0, 1)
    if meta.decode_slots is not None:
        qd = q[meta.decode_rows].unsqueeze(2)  # (B, H, 1, D)
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # (B, KVH, L, D)
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                           enable_gqa=gqa)
        out[meta.decode_rows] = o.squeeze(2)
    return out
