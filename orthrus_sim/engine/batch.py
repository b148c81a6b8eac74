"""The batch unit: everything one forward pass computes, sorted by item type.

Sorting by type (embedding chunks, then prefill chunks, then decodes) makes every output kernel
(pooler, LoRA delta, sampler) work on one contiguous slice of the hidden-state rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from operator import attrgetter

from orthrus_sim.engine.request import Request


class ItemKind(enum.IntEnum):
    EMBED_CHUNK = 0
    PREFILL_CHUNK = 1
    DECODE = 2


EMBED_CHUNK, PREFILL_CHUNK, DECODE = ItemKind.EMBED_CHUNK, ItemKind.PREFILL_CHUNK, ItemKind.DECODE


@dataclass(slots=True)
class BatchItem:
    """``num_tokens`` tokens of ``request`` starting at sequence position ``start``.

    ``context_len`` is how many of the request's tokens are already in the KV cache; the item
    attends to those plus itself, causally.
    """

    request: Request
    kind: ItemKind
    start: int
    num_tokens: int

    @property
    def context_len(self) -> int:
        return self.start

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True where the forward pass must produce a next token for this item."""
        return self.kind is not EMBED_CHUNK and self.end == self.request.seq_len


_KIND = attrgetter("kind")


@dataclass(slots=True)
class BatchUnit:
    """The items of one iteration. ``reserve`` sets tokens of the budget aside for one request
    (a budget claim, docs/scheduler.md): ``budget_left`` excludes them for everyone else, and
    ``budget_for`` that request includes them.

    In the simulator's fast path the running decodes come as one segment, the decode cohort
    (``engine/cohort.py``): ``cohort_decodes`` decodes reading ``cohort_kv`` KV rows, counted
    in every total but with no item each. Real executors never get one."""

    token_budget: int
    items: list[BatchItem] = field(default_factory=list)
    total_tokens: int = 0
    reserved: int = 0
    reserved_for: str | None = None
    num_decodes: int = 0
    cohort_decodes: int = 0
    cohort_kv: int = 0
    started_at: float = 0.0  # the executor's clock when scheduled: the target's slack reads it
    _sorted: bool = field(default=True, repr=False)

    def add(self, request: Request, kind: ItemKind, num_tokens: int) -> BatchItem:
        if request.request_id == self.reserved_for:
            self.reserve(None, 0)  # the claimant takes its reserved tokens
        item = BatchItem(request, kind, request.num_computed, num_tokens)
        items = self.items
        if items and items[-1].kind > kind:
            self._sorted = False
        if kind is DECODE:
            self.num_decodes += 1
        items.append(item)
        self.total_tokens += num_tokens
        return item

    def add_decodes(self, items: list[BatchItem]) -> None:
        """Decode items (one token each), in order: the bulk ``add`` of the hot path."""
        if items:
            self.items.extend(items)
            self.total_tokens += len(items)
            self.num_decodes += len(items)

    def add_cohort(self, decodes: int, kv_rows: int) -> None:
        """The decode cohort's segment: ``decodes`` one-token decodes reading ``kv_rows``."""
        self.total_tokens += decodes
        self.num_decodes += decodes
        self.cohort_decodes += decodes
        self.cohort_kv += kv_rows

    def reserve(self, request_id: str | None, num_tokens: int) -> None:
        """Set ``num_tokens`` of the budget aside for ``request_id`` (None: release)."""
        self.reserved_for, self.reserved = request_id, num_tokens

    def finalize(self) -> BatchUnit:
        """Sort items by type (stable, so FCFS order holds inside each type); a reservation
        not taken lapses."""
        self.reserved_for, self.reserved = None, 0
        if not self._sorted:
            self.items.sort(key=_KIND)
            self._sorted = True
        return self

    def __len__(self) -> int:
        return len(self.items) + self.cohort_decodes

    def __bool__(self) -> bool:
        return bool(self.items) or self.cohort_decodes > 0

    @property
    def num_seqs(self) -> int:
        return len(self.items) + self.cohort_decodes

    @property
    def budget_left(self) -> int:
        """Tokens any request may still add (reserved tokens excluded)."""
        return self.token_budget - self.total_tokens - self.reserved

    def budget_for(self, request_id: str) -> int:
        """Tokens ``request_id`` may still add: ``budget_left`` plus its reservation."""
        left = self.token_budget - self.total_tokens
        return left if request_id == self.reserved_for else left - self.reserved

    def item_slice(self, kind: ItemKind) -> slice:
        """The contiguous range of ``items`` holding items of ``kind``."""
        lo = hi = 0
        for i, it in enumerate(self.items):
            if it.kind < kind:
                lo = i + 1
            if it.kind <= kind:
                hi = i + 1
        return slice(lo, max(lo, hi))

    def token_slice(self, kind: ItemKind) -> slice:
        """The contiguous range of hidden-state rows belonging to items of ``kind``."""
        lo = hi = 0
        for it in self.items:
            if it.kind < kind:
                lo += it.num_tokens
            if it.kind <= kind:
                hi += it.num_tokens
        return slice(lo, max(lo, hi))

    def tokens_of(self, kind: ItemKind) -> int:
        return sum(it.num_tokens for it in self.items if it.kind is kind)

    def composition(self) -> dict[str, int]:
        """Counts for statistics: items and tokens per type."""
        out = {"embed_chunks": 0, "embed_tokens": 0, "prefill_chunks": 0, "prefill_tokens": 0,
               "decodes": 0}
        for it in self.items:
            if it.kind is ItemKind.EMBED_CHUNK:
                out["embed_chunks"] += 1
                out["embed_tokens"] += it.num_tokens
            elif it.kind is ItemKind.PREFILL_CHUNK:
                out["prefill_chunks"] += 1
                out["prefill_tokens"] += it.num_tokens
            else:
                out["decodes"] += 1
        out["decodes"] += self.cohort_decodes
        return out
