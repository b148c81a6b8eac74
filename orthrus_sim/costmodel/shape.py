"""A batch unit reduced to the counts that set its cost."""

from __future__ import annotations

from dataclasses import dataclass

from orthrus_sim.engine.batch import DECODE, EMBED_CHUNK, PREFILL_CHUNK, BatchUnit, ItemKind


@dataclass(slots=True)
class BatchShape:
    """Counts over one iteration's items.

    chunk_pairs: causal query-key pairs of the chunk items, sum of n*(ctx + (n+1)/2);
    chunk_kv / decode_kv: KV rows each kind of attention reads, sum of (ctx + n);
    lora_rows: rows of embedding requests (the adapter's slice); sample_rows: rows that produce
    a next token; pooled_rows: rows folded into a pooler.
    """

    tokens: int = 0
    num_seqs: int = 0
    decodes: int = 0
    decode_kv: int = 0
    chunk_tokens: int = 0
    chunk_pairs: float = 0.0
    chunk_kv: int = 0
    lora_rows: int = 0
    sample_rows: int = 0
    pooled_rows: int = 0

    def add_decodes(self, n: int, kv_rows: int) -> None:
        """``n`` one-token decodes reading ``kv_rows`` KV rows in all (their contexts + 1)."""
        self.tokens += n
        self.num_seqs += n
        self.decodes += n
        self.sample_rows += n
        self.decode_kv += kv_rows

    def add_item(self, kind: ItemKind, num_tokens: int, context_len: int,
                 samples: bool = False, adapter: bool = True) -> None:
        self.tokens += num_tokens
        self.num_seqs += 1
        if kind is DECODE:
            self.decodes += 1
            self.decode_kv += context_len + 1
            self.sample_rows += 1
            return
        self.chunk_tokens += num_tokens
        self.chunk_pairs += num_tokens * (context_len + (num_tokens + 1) / 2)
        self.chunk_kv += context_len + num_tokens
        if kind is EMBED_CHUNK:
            self.pooled_rows += num_tokens
            if adapter:
                self.lora_rows += num_tokens
        elif samples:
            self.sample_rows += 1

    @classmethod
    def from_batch(cls, batch: BatchUnit, adapter: bool = True) -> BatchShape:
        shape = cls()
        items = batch.items
        if not items:  # the decode cohort alone: a decode run's first batch
            if batch.cohort_decodes:
                shape.add_decodes(batch.cohort_decodes, batch.cohort_kv)
            return shape
        add_item = shape.add_item
        first_decode = len(items)  # items are sorted by kind: decodes come last
        for i, it in enumerate(items):
            kind = it.kind
            if kind is DECODE:
                first_decode = i
                break
            add_item(kind, it.num_tokens, it.start, kind is PREFILL_CHUNK and it.samples, adapter)
        n = len(items) - first_decode
        if n:  # the common case, in bulk
            shape.add_decodes(n, sum([it.start for it in items[first_decode:]]) + n)
        if batch.cohort_decodes:
            shape.add_decodes(batch.cohort_decodes, batch.cohort_kv)
        return shape

    @classmethod
    def from_items(cls, items, adapter: bool = True) -> BatchShape:
        """From ``(kind, num_tokens, context_len)`` tuples; a prefill chunk samples if it is
        given as a 4th element True (calibration rows say so)."""
        shape = cls()
        for item in items:
            kind, n, ctx = ItemKind(item[0]), int(item[1]), int(item[2])
            samples = bool(item[3]) if len(item) > 3 else kind is not ItemKind.EMBED_CHUNK
            shape.add_item(kind, n, ctx, samples, adapter)
        return shape
