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
    """Chunk items attended together: either one item with cached context (``slots`` of its
    positions 0 .. context + n - 1 and an offset causal ``mask``), or ``count`` consecutive
    fresh items (context 0) of equal length ``n``, which need no cache read at all."""

    rows: slice  # rows of the batch's hidden states
    n: int
    count: int = 1
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of every new token
    positions: torch.Tensor  # (T,) position of every token in its sequence
    chunks: list[ChunkPlan]
    decode_rows: slice  # contiguous rows of the decodes (sorted last)
    decode_slots: torch.Tensor | None  # (B, L) padded context slots
    decode_bias: torch.Tensor | None  # (B, 1, 1, L) 0 where a slot is real, -inf on padding


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
            last = chunks[-1] if chunks else None
            if ctx == 0 and last is not None and last.slots is None and last.n == n \
                    and last.rows.stop == row:
                last.rows, last.count = slice(last.rows.start, row + n), last.count + 1
            elif ctx == 0:
                chunks.append(ChunkPlan(rows, n))
            else:
                mask = torch.ones(n, ctx + n, dtype=torch.bool).tril(diagonal=ctx).to(device)
                chunks.append(ChunkPlan(rows, n, 1, _slots(table, 0, item.end, block_size).to(device),
                                        mask))
        row += item.num_tokens
    decode_slots = decode_bias = None
    if decode_items:
        longest = max(it.end for it, _ in decode_items)
        decode_slots = torch.zeros(len(decode_items), longest, dtype=torch.long)
        decode_bias = torch.full((len(decode_items), 1, 1, longest), float("-inf"))
        for i, (it, table) in enumerate(decode_items):
            decode_slots[i, :it.end] = _slots(table, 0, it.end, block_size)
            decode_bias[i, 0, 0, :it.end] = 0.0
        decode_slots, decode_bias = decode_slots.to(device), decode_bias.to(device)
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_parts).to(device), positions=torch.cat(pos_parts).to(device),
        chunks=chunks,
        decode_rows=slice(decode_start, row) if decode_start is not None else slice(row, row),
        decode_slots=decode_slots, decode_bias=decode_bias,
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D), cache (slots, 2, KVH, D) -> (T, H, D)."""
    cache.index_copy_(0, meta.slot_mapping, torch.stack((k, v), 1))
    out = torch.empty_like(q)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    gqa = heads != kv_heads
    for chunk in meta.chunks:
        if chunk.slots is None:  # fresh chunks: their own keys and values, plain causal
            shape = (chunk.count, chunk.n)
            qc = q[chunk.rows].view(*shape, heads, dim).transpose(1, 2)  # (B, H, n, D)
            kc = k[chunk.rows].view(*shape, kv_heads, dim).transpose(1, 2)
            vc = v[chunk.rows].view(*shape, kv_heads, dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
            out[chunk.rows] = o.transpose(1, 2).reshape(-1, heads, dim)
            continue
        kv = cache.index_select(0, chunk.slots)  # (ctx+n, 2, KVH, D)
        qc = q[chunk.rows].transpose(0, 1)  # (H, n, D)
        kc, vc = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # (KVH, ctx+n, D)
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk.mask, scale=scale,
                                           enable_gqa=gqa)
        out[chunk.rows] = o.transpose(0, 1)
    if meta.decode_slots is not None:
        # All decodes at once: (B, KVH, G, D) queries against their padded contexts, matmuls in
        # the model dtype, softmax in fp32 (SDPA with a mask is several times slower on CPU).
        n = meta.decode_slots.shape[0]
        qd = q[meta.decode_rows].view(n, kv_heads, heads // kv_heads, dim)
        # index_select on the flat slot list is several times faster than fancy indexing
        kv = cache.index_select(0, meta.decode_slots.view(-1)).view(n, -1, *cache.shape[1:])
        kd = kv[:, :, 0].permute(0, 2, 3, 1)  # (B, KVH, D, L)
        vd = kv[:, :, 1].transpose(1, 2)  # (B, KVH, L, D)
        scores = torch.matmul(qd, kd).float() * scale + meta.decode_bias
        probs = torch.softmax(scores, -1).to(q.dtype)
        out[meta.decode_rows] = torch.matmul(probs, vd).reshape(n, heads, dim)
    return out
