"""The static-shape step: decode-only and decode-heavy steps as a fixed-shape function.

A step of at most ``max(buckets)`` rows is padded to the smallest bucket that holds it; its
token ids and in-place attention metadata (``paged_attention.PagedMetadata``) are written into
persistent buffers of that bucket's shape, and the forward pass reads only those. So the pass
is one fixed function per bucket:

* on CUDA it is captured once per bucket as a ``torch.cuda.CUDAGraph`` and replayed (one
  launch instead of ~900); capture happens the first time a bucket is used, after an eager
  warm-up run on a side stream (which also compiles the attention kernel for that shape);
* elsewhere, or with graphs off, the very same function runs eagerly on the same buffers, so
  the CPU tests exercise everything but the capture call.

``torch.cuda.CUDAGraph`` rather than ``torch.compile(mode="reduce-overhead")``: the buckets,
buffers and padding are ours (as in vLLM and nano-vllm), so the captured code is exactly the
eager code the tests run, nothing is recompiled per batch size, and a capture that fails
falls back per bucket with its reason logged. Padding rows write their keys to the scratch
block and attend to nothing. Steps that cannot be static (more rows than the largest bucket,
or adapter rows, whose LoRA slice changes per step) take the eager path; each reason is
logged once and counted in ``fallbacks``.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from orthrus_real.engine.paged_attention import Q_BLOCK, PagedMetadata, build, empty_metadata
from orthrus_sim.engine.batch import BatchUnit

log = logging.getLogger("orthrus")

BUCKETS = (8, 16, 32, 64, 128, 256)


def default_buckets(token_budget: int) -> tuple[int, ...]:
    """The bucket sizes (rows) for a token budget: powers of two from 8, and the budget itself
    where it is under the largest."""
    cap = min(token_budget, BUCKETS[-1])
    sizes = [b for b in BUCKETS if b < cap]
    return (*sizes, cap)


class StaticStep:
    """Persistent buffers, one view per bucket, and (on CUDA, if asked) one graph per bucket."""

    def __init__(self, model, caches: list[torch.Tensor], num_blocks: int, block_size: int,
                 buckets: tuple[int, ...], device: torch.device, graphs: bool) -> None:
        if not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets):
            raise ValueError(f"static buckets must be positive integers, got {buckets!r}")
        if graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.caches, self.device = model, caches, device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs_on = graphs
        largest = self.buckets[-1]
        self.ids = torch.zeros(largest, dtype=torch.long, device=device)
        full = empty_metadata(largest, num_blocks, block_size, device)
        self.metas = {n: self._view(full, n) for n in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: dict[int, str] = {}  # bucket -> why it runs eagerly
        self.fallbacks: Counter[str] = Counter()  # why a step took the dynamic path
        self.replays = 0
        self._pool = None

    @staticmethod
    def _view(full: PagedMetadata, n: int) -> PagedMetadata:
        qblocks = -(-n // Q_BLOCK)
        return PagedMetadata(
            slot_mapping=full.slot_mapping[:n], positions=full.positions[:n], owner=full.owner[:n],
            logical=full.logical[:n + 1], kv_num_blocks=full.kv_num_blocks[:, :, :qblocks],
            kv_indices=full.kv_indices[:, :, :qblocks], block_size=full.block_size, static=True)

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def takes(self, batch: BatchUnit, lora_rows: slice) -> bool:
        """Whether ``batch`` runs static; if not, the reason is counted (and logged once)."""
        why = None
        if batch.total_tokens > self.buckets[-1]:
            why = f"more rows than the largest bucket ({self.buckets[-1]})"
        elif lora_rows.stop > lora_rows.start:
            why = "adapter rows (their LoRA slice changes per step)"
        if why is None:
            return True
        if why not in self.fallbacks:
            log.info("static step: a step took the dynamic path: %s", why)
        self.fallbacks[why] += 1
        return False

    def run(self, batch: BatchUnit, ids: list[int], tables: dict[str, list[int]]) -> torch.Tensor:
        """The hidden states of ``batch``'s rows (a view of a persistent buffer: read it before
        the next step)."""
        n = self.bucket(len(ids))
        meta = self.metas[n]
        build(batch, tables, self.block_size, self.num_blocks, self.device, meta)
        host = torch.tensor(ids + [0] * (n - len(ids)), dtype=torch.long)
        self.ids[:n].copy_(host, non_blocking=True)
        if self.graphs_on and n not in self.failed:
            if n not in self.graphs:
                self._capture(n)
            if n in self.graphs:
                graph, out = self.graphs[n]
                graph.replay()
                self.replays += 1
                return out[:len(ids)]
        return self._forward(n)[:len(ids)]

    def _forward(self, n: int) -> torch.Tensor:
        return self.model.forward(self.ids[:n], self.metas[n], self.caches)

    def _capture(self, n: int) -> None:
        """Warm up bucket ``n`` on a side stream, then capture it; on failure run it eagerly
        from now on, saying why. (The warm-up and the capture write this step's keys and
        values: the same values the replay writes.)"""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(n)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(n)
            self._pool = graph.pool()
            self.graphs[n] = (graph, out)
            log.info("static step: captured a CUDA graph for %d rows", n)
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager, with the reason
            self.failed[n] = f"{type(exc).__name__}: {exc}"
            log.warning("static step: no CUDA graph for %d rows (%s): running it eagerly", n,
                        self.failed[n])
            torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        mode = "CUDA graphs" if self.graphs_on else "eager (no capture)"
        return f"{mode}, buckets {', '.join(map(str, self.buckets))} rows"
