"""Attention that reads the paged KV cache in place (``--attention paged``).

The whole step is one attention call: the T packed query rows against the cache itself, viewed
as one long sequence of slots, under a block-sparse mask built from the core's block tables. No
context is gathered: a query block visits the cache blocks its requests hold, in the order of
their tables, and a mask function keeps, inside those blocks, the slots of the query's own
request at positions up to its own.

* On CUDA it is PyTorch's FlexAttention, compiled (Triton): the block mask's ``kv_indices`` are
  the physical block ids, so the kernel loads each needed block once per query block, straight
  from the cache. Every input has a fixed shape for a given number of rows, which is what the
  static decode step (``static_decode.py``) captures in a CUDA graph.
* On a CPU (and wherever the compiled kernel cannot be used) the same block mask is run by
  ``blockwise_attention``, a plain-PyTorch twin of the kernel's loop: per query block, the listed
  cache blocks, the mask function, softmax. Tests hold it (and eager FlexAttention) to the
  gathering path in ``attention.py``; on a CPU it is slower than that path, which stays the CPU
  default (``docs/engine.md``).

Layout: the cache of a layer is (slots, 2, KVH, D), slot = block * block_size + offset; one
extra block at the end (``scratch``) takes the keys of padding rows and is in no table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from orthrus_real.engine.attention import slot_list
from orthrus_sim.engine.batch import BatchUnit

log = logging.getLogger("orthrus")

Q_BLOCK = 16  # query rows per block of the block mask (the kernel's BLOCK_M divides it)


@dataclass
class PagedMetadata:
    """Everything the in-place attention of one step reads, as device tensors of shapes fixed
    by (rows, cache blocks): so the static step can keep them in persistent buffers.

    ``owner[r]`` is the row of ``logical`` for query row r: ``logical[owner, b]`` is the
    position of physical block b in that request's table, -1 where the request does not hold
    it (the padding rows' owner holds nothing). ``kv_indices[0, 0, i, :kv_num_blocks[0, 0, i]]``
    are the cache blocks query block i visits."""

    slot_mapping: torch.Tensor  # (T,) where each row's key and value are written
    positions: torch.Tensor  # (T,)
    owner: torch.Tensor  # (T,) int32
    logical: torch.Tensor  # (R, NB) int32
    kv_num_blocks: torch.Tensor  # (1, 1, ceil(T / Q_BLOCK)) int32
    kv_indices: torch.Tensor  # (1, 1, ceil(T / Q_BLOCK), NB) int32
    block_size: int
    static: bool = False  # buffers of a static step: the kernel is compiled for this shape
    _block_mask: object = field(default=None, repr=False)

    def mask_mod(self):
        """FlexAttention's mask: slot ``kv`` is visible to row ``q``."""
        owner, logical, positions, bs = self.owner, self.logical, self.positions, self.block_size

        def visible(b, h, q, kv):
            held = logical[owner[q], kv // bs]
            return (held >= 0) & (held * bs + kv % bs <= positions[q])

        return visible

    def block_mask(self):
        """The FlexAttention ``BlockMask`` over (T rows, every cache slot), made once."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import BlockMask

            rows, slots = self.owner.shape[0], self.logical.shape[1] * self.block_size
            self._block_mask = BlockMask.from_kv_blocks(
                self.kv_num_blocks, self.kv_indices, BLOCK_SIZE=(Q_BLOCK, self.block_size),
                mask_mod=self.mask_mod(), seq_lengths=(rows, slots), compute_q_blocks=False)
        return self._block_mask


def host_plan(batch: BatchUnit, tables: dict[str, list[int]], block_size: int, rows: int,
              scratch_block: int) -> list[list[int]]:
    """The step as integer lists (no tensors): per row (padded to ``rows``) slot, position and
    owner; the (owner, block, logical) triples of ``logical``; per query block its count of
    blocks to visit; and the (query block, rank, block) triples of ``kv_indices``. Padding rows
    write to ``scratch_block`` and are owned by row ``rows`` of ``logical`` (which holds
    nothing)."""
    slots: list[int] = []
    positions: list[int] = []
    owner: list[int] = []
    held: list[int] = []
    owned: list[list[int]] = []  # per item: the blocks it reads (its table up to its end)
    for r, item in enumerate(batch.items):
        table = tables[item.request.request_id]
        n = item.num_tokens
        slots.extend(slot_list(table, item.start, item.end, block_size))
        positions.extend(range(item.start, item.end))
        owner.extend([r] * n)
        owned.append(table[:-(-item.end // block_size)])
        for j, b in enumerate(owned[-1]):
            held += (r, b, j)
    t = len(slots)
    if t > rows:
        raise ValueError(f"{t} rows do not fit a plan of {rows}")
    pad = rows - t
    slots += [scratch_block * block_size] * pad
    positions += [0] * pad
    owner += [rows] * pad
    # the blocks each query block visits: for each request with rows in it, its table up to the
    # block of its last row there (tables are disjoint: the core shares no blocks)
    counts: list[int] = []
    visits: list[int] = []
    for q, lo in enumerate(range(0, rows, Q_BLOCK)):
        last: dict[int, int] = {}
        for i in range(lo, min(lo + Q_BLOCK, t)):
            last[owner[i]] = positions[i]
        blocks: dict[int, None] = {}
        for r, pos in last.items():
            blocks.update(dict.fromkeys(owned[r][:pos // block_size + 1]))
        counts.append(len(blocks))
        for rank, b in enumerate(blocks):
            visits += (q, rank, b)
    return [slots, positions, owner, held, counts, visits]


def fill_plan(meta: PagedMetadata, host: torch.Tensor, sizes: list[int]) -> None:
    """Write one step's plan (``host``: ``host_plan``'s lists, concatenated, as one device
    tensor; ``sizes``: their lengths) into ``meta``'s tensors in place (the static step's
    buffers keep their addresses)."""
    slots, positions, owner, held, counts, visits = host.split(sizes)
    meta.slot_mapping.copy_(slots)
    meta.positions.copy_(positions)
    meta.owner.copy_(owner)
    held = held.view(-1, 3)
    meta.logical.fill_(-1)
    meta.logical.index_put_((held[:, 0], held[:, 1]), held[:, 2].to(meta.logical.dtype))
    meta.kv_num_blocks.view(-1).copy_(counts)
    visits = visits.view(-1, 3)
    meta.kv_indices.zero_()
    meta.kv_indices.view(counts.shape[0], -1).index_put_(
        (visits[:, 0], visits[:, 1]), visits[:, 2].to(meta.kv_indices.dtype))


def empty_metadata(rows: int, num_blocks: int, block_size: int,
                   device: torch.device) -> PagedMetadata:
    """Zeroed tensors for a plan of ``rows`` rows over ``num_blocks`` cache blocks (scratch
    included); ``logical`` has one more row, the padding rows' owner."""
    qblocks = -(-rows // Q_BLOCK)
    i32 = dict(dtype=torch.int32, device=device)
    return PagedMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.long, device=device),
        positions=torch.zeros(rows, dtype=torch.long, device=device),
        owner=torch.zeros(rows, **i32),
        logical=torch.full((rows + 1, num_blocks), -1, **i32),
        kv_num_blocks=torch.zeros(1, 1, qblocks, **i32),
        kv_indices=torch.zeros(1, 1, qblocks, num_blocks, **i32),
        block_size=block_size)


def build(batch: BatchUnit, tables: dict[str, list[int]], block_size: int, num_blocks: int,
          device: torch.device, meta: PagedMetadata | None = None) -> PagedMetadata:
    """The in-place attention's metadata for ``batch`` (``num_blocks`` counts the scratch
    block, the last). With ``meta`` (persistent buffers of a static step) it is filled in
    place, rows past the batch's being padding; else new tensors of the batch's own size."""
    rows = meta.owner.shape[0] if meta is not None else batch.total_tokens
    lists = host_plan(batch, tables, block_size, rows, num_blocks - 1)
    flat: list[int] = []
    for part in lists:
        flat += part
    host = torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
    if meta is None:
        meta = empty_metadata(rows, num_blocks, block_size, device)
    fill_plan(meta, host, [len(part) for part in lists])
    return meta


# ----- the attention -------------------------------------------------------------------------
_compiled: dict[bool, object] = {}  # static shapes? -> compiled flex_attention
_kernel_failed: str | None = None


def inplace_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                      meta: PagedMetadata, scale: float, layer: int = 0) -> torch.Tensor:
    """q (T, H, D), k/v (T, KVH, D), cache (slots, 2, KVH, D) -> (T, H, D): keys and values
    written to their slots, then every row attends over the cache in place (``layer``: unused,
    the gathering path's signature)."""
    cache.index_copy_(0, meta.slot_mapping, torch.stack((k, v), 1))
    if q.is_cuda and _kernel_failed is None:
        try:
            return flex_paged(q, cache, meta, scale)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot build: the twin, logged
            _note_kernel_failure(exc)
    return blockwise_attention(q, cache, meta, scale)


def _note_kernel_failure(exc: Exception) -> None:
    global _kernel_failed
    _kernel_failed = f"{type(exc).__name__}: {exc}"
    log.warning("paged attention: the compiled FlexAttention kernel failed (%s); using the "
                "block-wise PyTorch path from now on", _kernel_failed)


def flex_paged(q: torch.Tensor, cache: torch.Tensor, meta: PagedMetadata, scale: float,
               compiled: bool = True) -> torch.Tensor:
    """FlexAttention over the whole cache with the step's block mask (compiled on CUDA: one
    kernel per static bucket, one with dynamic shapes for the other steps, so that a new row
    count does not recompile; eager elsewhere, which evaluates the mask densely over every
    slot: for tests). The kernel's tiles are the mask's blocks (16 rows x one cache block, so
    the compiled kernel needs a block size of at least 16), and the main kernel is forced:
    flex-decoding takes no block list per query block of a packed batch."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if compiled:
        if meta.static not in _compiled:
            _compiled[meta.static] = torch.compile(flex_attention, dynamic=not meta.static)
        fn = _compiled[meta.static]
    heads, kv_heads = q.shape[1], cache.shape[2]
    qf = q.transpose(0, 1).unsqueeze(0)  # (1, H, T, D)
    kf = cache[:, 0].transpose(0, 1).unsqueeze(0)  # (1, KVH, slots, D): a view of the cache
    vf = cache[:, 1].transpose(0, 1).unsqueeze(0)
    options = {"BLOCK_M": Q_BLOCK, "BLOCK_N": meta.block_size,
               "FORCE_USE_FLEX_ATTENTION": True} if compiled else None
    out = fn(qf, kf, vf, block_mask=meta.block_mask(), scale=scale,
             enable_gqa=heads != kv_heads, kernel_options=options)
    return out[0].transpose(0, 1)


def blockwise_attention(q: torch.Tensor, cache: torch.Tensor, meta: PagedMetadata,
                        scale: float) -> torch.Tensor:
    """The kernel's loop in plain PyTorch: per query block, the cache blocks the block mask
    lists, masked by the same rule as ``mask_mod``. Rows that see nothing (padding) get 0."""
    t, heads, dim = q.shape
    kv_heads, bs = cache.shape[2], meta.block_size
    blocks_view = cache.view(-1, bs, *cache.shape[1:])  # (NB, bs, 2, KVH, D)
    counts = meta.kv_num_blocks.view(-1).tolist()
    indices = meta.kv_indices.view(len(counts), -1)
    offsets = torch.arange(bs, device=q.device)
    out = torch.zeros_like(q)
    for i, n in enumerate(counts):
        lo, hi = i * Q_BLOCK, min(t, (i + 1) * Q_BLOCK)
        if n == 0 or lo >= hi:
            continue
        blocks = indices[i, :n].long()
        kv = blocks_view.index_select(0, blocks).flatten(0, 1)  # (n * bs, 2, KVH, D)
        held = meta.logical[meta.owner[lo:hi].long()][:, blocks].long()  # (rows, n)
        pos = held[:, :, None] * bs + offsets  # (rows, n, bs) positions of the slots
        mask = (held[:, :, None] >= 0) & (pos <= meta.positions[lo:hi, None, None])
        mask = mask.flatten(1)  # (rows, n * bs)
        qc = q[lo:hi].transpose(0, 1)  # (H, rows, D)
        kc, vc = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale,
                                           enable_gqa=heads != kv_heads)
        seen = mask.any(1)
        out[lo:hi] = torch.where(seen[:, None, None], o.transpose(0, 1), 0.0)
    return out
