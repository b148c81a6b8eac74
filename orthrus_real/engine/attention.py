"""Packed causal attention over a paged KV cache.

Every item of a batch unit attends to its own cached context plus itself, causally. New keys
and values are written to their cache slots first; then each chunk item (embedding or prefill)
attends over its gathered context with an offset causal mask, and all decodes attend together
in one padded call. Slot of position p of a request = table[p // block_size] * block_size +
p % block_size, where ``table`` is the core's block table for that request.

On a CPU the decodes' gathered contexts are kept from one step to the next
(``KeptContexts``): while the same requests decode, each step only appends its new keys and
values to them instead of copying every context out of the cache again (the copy was a sixth
of a 64-stream decode step of the `small` model in fp32).

An item the core says stores nothing (``KVAdmission.writes_kv``: an embedding's last chunk)
writes no slot: it attends to its gathered context followed by its own keys and values, which
are the same numbers the cache would have handed back, so its output is bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind


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
    stored: bool = True  # its own keys and values are in the cache (else appended to the context)


class KeptContexts:
    """Per layer, the decodes' contexts as the last forward pass gathered them, ``width``
    tokens each (the longest plus headroom, padding masked), keys and values each contiguous
    (B, KVH, width, D). A step whose decodes are the same requests in the same order, each one
    token further, appends its new keys and values in place; any other step gathers afresh, as
    wide as needed. The state a step plans becomes current only once its forward pass
    succeeded (``commit``); a pass that raised may have appended in some layers only, so
    ``reset`` drops everything."""

    def __init__(self, num_layers: int, limit_tokens: int, headroom_blocks: int = 2) -> None:
        self.buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.limit_tokens = limit_tokens  # decodes x width at most this (the cache's own size)
        self.headroom_blocks = headroom_blocks  # a fresh gather is this much wider: 2 blocks
        # of 16 are 32 steps of appends before the next
        self.appended = self.gathered = 0  # steps of each kind (committed)
        self.ids: tuple[str, ...] = ()
        self.ends: list[int] = []
        self.width = 0
        self._planned: tuple[tuple[str, ...], list[int], int, bool] | None = None

    def plan(self, ids: tuple[str, ...], ends: list[int], block_size: int) -> tuple[bool, int]:
        """(append?, width in tokens) for a step whose decodes are ``ids`` with context
        lengths ``ends`` (its new token included); width 0: keep nothing, gather as wide as
        the longest."""
        longest = max(ends)
        append = (ids == self.ids and longest <= self.width
                  and all(e == p + 1 for e, p in zip(ends, self.ends)))
        width = self.width if append else \
            (-(-longest // block_size) + self.headroom_blocks) * block_size
        if len(ids) * width > self.limit_tokens:
            width, append = 0, False
        self._planned = (ids, ends, width, append)
        return append, width

    def commit(self) -> None:
        if self._planned is not None:
            self.ids, self.ends, self.width, append = self._planned
            self._planned = None
            if not self.width:
                self.buffers = [None] * len(self.buffers)
            elif append:
                self.appended += 1
            else:
                self.gathered += 1

    def reset(self) -> None:
        self.buffers = [None] * len(self.buffers)
        self.ids, self.ends, self.width, self._planned = (), [], 0, None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (W,) cache slot of every new token that is stored
    positions: torch.Tensor  # (T,) position of every token in its sequence
    chunks: list[ChunkPlan]
    decode_rows: slice  # contiguous rows of the decodes (sorted last)
    decode_blocks: torch.Tensor | None  # (B, N) each decode's context blocks, padded with 0
    decode_bias: torch.Tensor | None  # (B, 1, 1, N * block) 0 on a real position, -inf past it
    write_rows: torch.Tensor | None = None  # (W,) rows stored, where not every row is
    block_size: int = 1  # tokens per cache block (the decode gather takes whole blocks)
    kept: KeptContexts | None = None  # the decodes' contexts kept between steps (CPU)
    decode_append: bool = False  # kept contexts are this step's but for the new token
    decode_lengths: torch.Tensor | None = None  # (B,) each decode's context, its token included
    keep_decodes: bool = False  # this step's gathered contexts are kept for the next


def slot_list(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions ``start .. end - 1``, a block's run at a time."""
    out: list[int] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        n = min(block_size - offset, end - pos)
        base = table[block] * block_size + offset
        out.extend(range(base, base + n))
        pos += n
    return out


def build_metadata(batch: BatchUnit, tables: dict[str, list[int]], block_size: int,
                   device: torch.device,
                   writes_kv: Callable[[BatchItem], bool] | None = None,
                   kept: KeptContexts | None = None) -> AttentionMetadata:
    """The step's positions, slots and decode contexts as plain integers first, then one
    tensor copied to the device once and viewed in parts (per request, only Python lists).
    ``writes_kv`` (the policy's): which items store their keys and values (None: all).
    ``kept``: the decodes' contexts kept from the last step (planned here, committed by the
    caller once the pass succeeded)."""
    slots: list[int] = []
    positions: list[int] = []
    write_rows: list[int] = []  # filled only once an item is not stored
    skipped = False
    chunk_slots: list[list[int]] = []  # per chunk item with cached context
    chunks = []
    decode_items = []
    row = 0
    decode_start = None
    for item in batch.items:
        table = tables.get(item.request.request_id, ())  # an unstored one-chunk item has none
        positions.extend(range(item.start, item.end))
        stored = writes_kv is None or writes_kv(item)
        if stored:
            slots.extend(slot_list(table, item.start, item.end, block_size))
            if skipped:
                write_rows.extend(range(row, row + item.num_tokens))
        elif not skipped:
            skipped = True
            write_rows = list(range(row))
        rows = slice(row, row + item.num_tokens)
        if item.kind is ItemKind.DECODE:
            if decode_start is None:
                decode_start = row
            decode_items.append((item.end, table, item.request.request_id))
        else:
            n, ctx = item.num_tokens, item.start
            last = chunks[-1] if chunks else None
            if ctx == 0 and last is not None and last.mask is None and last.n == n \
                    and last.rows.stop == row:  # fresh chunks (no mask) of equal length
                last.rows, last.count = slice(last.rows.start, row + n), last.count + 1
            elif ctx == 0:
                chunks.append(ChunkPlan(rows, n))
            else:
                mask = torch.ones(n, ctx + n, dtype=torch.bool, device=device).tril(diagonal=ctx)
                chunks.append(ChunkPlan(rows, n, 1, None, mask, stored))
                chunk_slots.append(slot_list(table, 0, item.end if stored else ctx, block_size))
        row += item.num_tokens
    # one host list: slots, positions, the rows stored (if not all), each context chunk's
    # slots, the decodes' block tables padded to the longest and their lengths
    host = slots + positions + write_rows
    for part in chunk_slots:
        host += part
    ends = [end for end, _, _ in decode_items]
    longest = -(-max(ends, default=0) // block_size)  # in blocks
    append, width = False, 0
    if kept is not None and decode_items:
        append, width = kept.plan(tuple(rid for _, _, rid in decode_items), ends, block_size)
        longest = max(longest, width // block_size)  # a kept context's width, padded
    for end, table, _ in ([] if append else decode_items):
        used = -(-end // block_size)
        host += table[:used]
        host += [0] * (longest - used)
    host += ends
    flat = torch.tensor(host, dtype=torch.long).to(device, non_blocking=True)
    w, t = len(slots), len(positions)
    at = w + t + len(write_rows)
    for chunk in (c for c in chunks if c.mask is not None):
        size = chunk.mask.shape[1] - (0 if chunk.stored else chunk.n)
        chunk.slots, at = flat[at:at + size], at + size
    decode_blocks = decode_bias = lengths = None
    if decode_items:
        n = len(decode_items)
        if not append:
            decode_blocks, at = flat[at:at + n * longest].view(n, longest), at + n * longest
        lengths = flat[at:]
        real = torch.arange(longest * block_size, device=device)[None, :] < lengths[:, None]
        decode_bias = torch.zeros(real.shape, device=device).masked_fill_(~real, float("-inf"))
        decode_bias = decode_bias[:, None, None, :]
    return AttentionMetadata(
        slot_mapping=flat[:w], positions=flat[w:w + t], chunks=chunks,
        decode_rows=slice(decode_start, row) if decode_start is not None else slice(row, row),
        decode_blocks=decode_blocks, decode_bias=decode_bias,
        write_rows=flat[w + t:w + t + len(write_rows)] if skipped else None,
        block_size=block_size, kept=kept if decode_items else None, decode_append=append,
        decode_lengths=lengths, keep_decodes=bool(width),
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, layer: int = 0) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D), cache (slots, 2, KVH, D) -> (T, H, D); ``layer``: whose
    kept decode contexts (``meta.kept``) to use."""
    new_kv = torch.stack((k, v), 1)
    if meta.write_rows is not None:  # some items store nothing (an embedding's last chunk)
        new_kv = new_kv.index_select(0, meta.write_rows)
    if new_kv.shape[0]:
        cache.index_copy_(0, meta.slot_mapping, new_kv)
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
        if not chunk.stored:  # its own keys and values follow the context
            kv = torch.cat((kv, torch.stack((k[chunk.rows], v[chunk.rows]), 1)))
        qc = q[chunk.rows].transpose(0, 1)  # (H, n, D)
        kc, vc = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # (KVH, ctx+n, D)
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk.mask, scale=scale,
                                           enable_gqa=gqa)
        out[chunk.rows] = o.transpose(0, 1)
    if meta.decode_lengths is not None:
        n = meta.decode_lengths.shape[0]
        qd = q[meta.decode_rows].view(n, kv_heads, heads // kv_heads, dim)
        if meta.decode_append:  # the last step's contexts: add this step's keys and values
            keys, values = meta.kept.buffers[layer]
            rows, at = meta.decode_rows, meta.decode_lengths - 1
            index = torch.arange(n, device=keys.device)
            keys[index, :, at] = k[rows]
            values[index, :, at] = v[rows]
        else:
            # whole blocks gathered (padding masked by the bias): a quarter faster than slot
            # by slot on a CPU; index_select is several times faster than fancy indexing
            width = meta.decode_blocks.shape[1]
            blocks = cache.view(-1, meta.block_size, *cache.shape[1:])
            kv = blocks.index_select(0, meta.decode_blocks.view(-1))
            kv = kv.view(n, width * meta.block_size, *cache.shape[1:])
            keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
            if meta.keep_decodes:  # kept contiguous: attention reads them 1.3x faster
                keys, values = keys.contiguous(), values.contiguous()
                meta.kept.buffers[layer] = (keys, values)
        attend = _decodes_fp32_cpu if q.dtype == torch.float32 and not q.is_cuda else _decodes
        out[meta.decode_rows] = attend(qd, keys, values, meta.decode_bias,
                                       scale).reshape(n, heads, dim)
    return out


def _decodes(qd: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
             scale: float) -> torch.Tensor:
    """All decodes at once: (B, KVH, G, D) queries against their contexts' keys and values
    (B, KVH, L, D each), matmuls in the model dtype, softmax in fp32 (SDPA with a mask is
    several times slower on CPU). -> (B, KVH, G, D)"""
    scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale + bias
    probs = torch.softmax(scores, -1).to(qd.dtype)
    return torch.matmul(probs, values)


def _decodes_fp32_cpu(qd: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``_decodes`` through PyTorch's fused CPU attention (SDPA with the padding bias): in fp32
    on a CPU 1.3-1.5x faster than the two matmuls at 64 decodes of 128-256 tokens (AVX-512 and
    AVX2 alike), where in bf16 it is 3.5x slower (measured in docs/engine.md). -> (B, KVH, G, D)"""
    b, kvh, g, d = qd.shape
    out = F.scaled_dot_product_attention(qd.reshape(b, kvh * g, 1, d), keys, values,
                                         attn_mask=bias, scale=scale, enable_gqa=kvh != kvh * g)
    return out.view(b, kvh, g, d)
