"""The policy interface and the mechanics every policy shares.

A policy owns one replica's queues and KV-cache accounting. An executor (the simulator's replica
process, the PyTorch engine, the vLLM scheduler plug-in) drives it with three calls::

    policy.add(request, now)            # False (request REJECTED, reason set) if it can never run
    batch = policy.schedule(now)        # the next batch unit; empty when there is nothing to do
    left = policy.complete(batch, now)  # advance requests; returns those that left the replica

``complete`` returns requests that finished (state FINISHED) and, for a prefill-only replica,
generation requests handed off after their first token (state WAITING, KV to be transferred).
A policy decides only *which* work enters a batch (``_fill``); admission, decode growth,
preemption and completion live here so every policy keeps the same invariants.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Collection, Iterable

from orthrus_sim.engine.batch import BatchUnit, ItemKind
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.kv_cache import BlockManager
from orthrus_sim.engine.request import Request, RequestKind, RequestState


class Policy:
    """Base policy: subclasses override ``_fill`` (and ``serves`` for single-type replicas)."""

    name = "base"
    serves: tuple[RequestKind, ...] = (RequestKind.EMBEDDING, RequestKind.GENERATION)

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.blocks = BlockManager(self.config.num_blocks, self.config.block_size)
        self.embed_queue: deque[Request] = deque()  # Qe: unfinished embeddings, arrival order
        self.gen_queue: deque[Request] = deque()  # Qg: generation requests not admitted
        self.running: list[Request] = []  # admitted generation requests, admission order
        self.holding: dict[str, Request] = {}  # every request holding blocks, admission order
        self.requests: dict[str, Request] = {}  # every live request by id
        self.num_preemptions = 0
        self.iterations = 0
        self._embed_cursor = 0
        self._in_batch: set[str] = set()
        self._added = 0

    # ----- the interface -----------------------------------------------------------------
    def add(self, request: Request, now: float = 0.0) -> bool:
        """Queue a request; rejects (and returns False) one that could never be served."""
        reason = self._reject_reason(request)
        if reason is not None:
            request.reject(reason)
            request.finished_at = now
            return False
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already queued")
        self.requests[request.request_id] = request
        request.ready_since = now
        self._added += 1
        request.order = (request.arrival_time, self._added)
        if request.is_embedding:
            self.embed_queue.append(request)
        else:
            self._enqueue_gen(request)
        return True

    def schedule(self, now: float = 0.0) -> BatchUnit:
        batch = BatchUnit(self.config.token_budget)
        self._embed_cursor = 0
        self._in_batch = set()
        self._fill(batch, now)
        self._in_batch = set()
        return batch.finalize()

    def complete(
        self, batch: BatchUnit, now: float = 0.0, stopped: Collection[str] = ()
    ) -> list[Request]:
        """Apply a finished forward pass; ``stopped`` names generation requests that hit a stop."""
        self.iterations += 1
        left: list[Request] = []
        running = RequestState.RUNNING
        embed_chunk, prefill_chunk = ItemKind.EMBED_CHUNK, ItemKind.PREFILL_CHUNK
        for item in batch.items:
            req = item.request
            if req.state is not running:
                continue  # aborted while the pass ran
            req.num_computed += item.num_tokens
            req.ready_since = now
            kind = item.kind
            if kind is embed_chunk:
                req.chunks_done += 1
                if req.first_chunk_at is None:
                    req.first_chunk_at = now
                if req.num_computed >= req.input_len:
                    self._finish(req, now)
                    left.append(req)
                continue
            if kind is prefill_chunk:
                req.chunks_done += 1
                if req.first_chunk_at is None:
                    req.first_chunk_at = now
            if req.num_computed == req.input_len + req.num_generated:
                req.num_generated += 1
                if req.first_token_at is None:
                    req.first_token_at = now
                if req.num_generated >= req.max_output_tokens or req.request_id in stopped:
                    self._finish(req, now)
                    left.append(req)
                elif self._hands_off(req):
                    self._release(req)
                    req.transition(RequestState.WAITING)
                    left.append(req)
        return left

    def abort(self, request_id: str, now: float = 0.0) -> Request | None:
        """Drop a request wherever it is and free its blocks; None if it is not here."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._release(req)
        if req in self.gen_queue:
            self.gen_queue.remove(req)
        req.transition(RequestState.ABORTED)
        req.finished_at = now
        return req

    # ----- what a policy customises --------------------------------------------------------
    def _fill(self, batch: BatchUnit, now: float) -> None:
        raise NotImplementedError

    def _hands_off(self, request: Request) -> bool:
        """True where a generation request leaves after its first token (prefill replicas)."""
        return False

    # ----- views ---------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.embed_queue or self.gen_queue or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def queue_depth(self) -> dict[str, int]:
        waiting_embed = sum(1 for r in self.embed_queue if r.state is RequestState.WAITING)
        return {
            "embedding_waiting": waiting_embed,
            "embedding_running": len(self.embed_queue) - waiting_embed,
            "generation_waiting": len(self.gen_queue),
            "generation_running": len(self.running),
        }

    def waiting_work(self) -> tuple[int, int]:
        """Remaining token work of Qe and of Qg (``we``, ``wg`` in the brief)."""
        count_output = self.config.count_waiting_output
        we = sum(r.num_uncomputed for r in self.embed_queue)
        wg = sum(r.remaining_work(count_output) for r in self.gen_queue)
        return we, wg

    # ----- shared mechanics ---------------------------------------------------------------
    def _reject_reason(self, request: Request) -> str | None:
        cfg = self.config
        if request.kind not in self.serves:
            return f"this replica ({self.name}) does not serve {request.kind.value} requests"
        total = request.input_len + request.max_output_tokens
        if cfg.max_model_len is not None and total > cfg.max_model_len:
            return (
                f"input_len + max_output_tokens = {total} exceeds the model's maximum length "
                f"{cfg.max_model_len}"
            )
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            return (
                f"{total} tokens need {self.blocks.blocks_for(total)} KV blocks but the cache "
                f"holds {self.blocks.num_blocks}"
            )
        if request.is_embedding and cfg.chunk_size is None and request.input_len > cfg.token_budget:
            return (
                f"input_len {request.input_len} exceeds the token budget {cfg.token_budget} and "
                "embeddings are not chunked (scheduler.chunk_size is null)"
            )
        return None

    def _enqueue_gen(self, request: Request) -> None:
        """Insert into Qg in arrival order (preempted requests go back to their place)."""
        q = self.gen_queue
        if not q or q[-1].order <= request.order:
            q.append(request)
        elif q[0].order > request.order:
            q.appendleft(request)
        else:
            items = list(q)
            items.insert(bisect.bisect_right(items, request.order, key=lambda r: r.order),
                         request)
            self.gen_queue = deque(items)

    def _admit(self, request: Request, num_tokens: int, now: float) -> bool:
        """Reserve blocks for ``num_tokens`` tokens and mark running; False if they don't fit."""
        if not request.is_embedding and len(self.running) >= self.config.max_num_seqs:
            return False
        if not self.blocks.grow(request.request_id, num_tokens):
            return False
        request.transition(RequestState.RUNNING)
        if request.admitted_at is None:
            request.admitted_at = now
        self.holding[request.request_id] = request
        return True

    def _release(self, request: Request) -> None:
        self.blocks.free(request.request_id)
        self.holding.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        if request.is_embedding:
            if request in self.embed_queue:
                self.embed_queue.remove(request)
        elif request in self.running:
            self.running.remove(request)

    def _finish(self, request: Request, now: float) -> None:
        self._release(request)
        request.transition(RequestState.FINISHED)
        request.finished_at = now

    def _preempt(self, victim: Request) -> None:
        """Recompute-preemption: free the victim's blocks and put it back in its queue."""
        self.blocks.free(victim.request_id)
        del self.holding[victim.request_id]
        victim.transition(RequestState.WAITING)
        victim.reset_for_recompute()
        self.num_preemptions += 1
        if not victim.is_embedding:
            self.running.remove(victim)
            self._enqueue_gen(victim)

    def _schedule_running(self, batch: BatchUnit) -> int:
        """Running generation requests first: decodes, then unfinished prefills (chunked).

        A decode that cannot grow its blocks preempts the newest request holding blocks, as
        vLLM does; if that is the decode itself, it steps aside for this iteration.
        (This loop runs for every decode of every iteration, hence the inlined arithmetic.)
        """
        used = 0
        budget = batch.token_budget
        block_size = self.blocks.block_size
        tables = self.blocks.tables
        running = RequestState.RUNNING
        for req in list(self.running):
            if req.state is not running:
                continue  # preempted earlier in this loop
            if batch.total_tokens >= budget:
                break
            seq_len = req.input_len + req.num_generated
            table = tables.get(req.request_id)
            if table is None or len(table) * block_size < seq_len:
                while not self.blocks.grow(req.request_id, seq_len):
                    victim = next(reversed(self.holding.values()))
                    self._preempt(victim)
                    if victim is req:
                        break
                if req.state is not running:
                    continue
            n = seq_len - req.num_computed
            kind = ItemKind.DECODE if n == 1 and req.num_generated else ItemKind.PREFILL_CHUNK
            n = min(n, budget - batch.total_tokens)
            batch.add(req, kind, n)
            used += n
        return used

    def _next_embedding(self) -> Request | None:
        """The earliest embedding request with no chunk in this batch yet."""
        q = self.embed_queue
        while self._embed_cursor < len(q):
            req = q[self._embed_cursor]
            if req.request_id not in self._in_batch:
                return req
            self._embed_cursor += 1
        return None

    def _embed_chunk_len(self, request: Request) -> int:
        size = self.config.chunk_size
        remaining = request.num_uncomputed
        return remaining if size is None else min(size, remaining)

    def _schedule_embedding(self, batch: BatchUnit, now: float) -> int:
        """``schedule_one(Qe, B)``: one whole chunk of the earliest embedding, or 0."""
        req = self._next_embedding()
        if req is None:
            return 0
        n = self._embed_chunk_len(req)
        if n > batch.budget_left:
            return 0  # chunks are never split to fit the budget
        if req.state is RequestState.WAITING and (
                self._embed_slots_full() or not self._admit(req, req.input_len, now)):
            return 0
        batch.add(req, ItemKind.EMBED_CHUNK, n)
        self._in_batch.add(req.request_id)
        self._embed_cursor += 1
        return n

    def _embed_slots_full(self) -> bool:
        cap = self.config.max_num_embeds
        return cap is not None and sum(r.is_embedding for r in self.holding.values()) >= cap

    def _schedule_generation(self, batch: BatchUnit, now: float) -> int:
        """``schedule_one(Qg, B)``: admit the earliest waiting generation request, or 0."""
        if not self.gen_queue or len(self.running) >= self.config.max_num_seqs:
            return 0
        if batch.budget_left <= 0:
            return 0
        req = self.gen_queue[0]
        if not self._admit(req, req.seq_len, now):
            return 0
        self.gen_queue.popleft()
        self.running.append(req)
        n = min(req.num_uncomputed, batch.budget_left)
        batch.add(req, ItemKind.DECODE if req.is_decode else ItemKind.PREFILL_CHUNK, n)
        return n

    def _fill_fcfs(self, batch: BatchUnit, now: float, kinds: Iterable[RequestKind]) -> int:
        """Admit new work in one global arrival order, stopping at the first that cannot go."""
        kinds = set(kinds)
        used = 0
        while batch.budget_left > 0:
            emb = self._next_embedding() if RequestKind.EMBEDDING in kinds else None
            gen = self.gen_queue[0] if RequestKind.GENERATION in kinds and self.gen_queue else None
            if emb is None and gen is None:
                break
            if gen is None or (emb is not None and emb.order < gen.order):
                n = self._schedule_embedding(batch, now)
            else:
                n = self._schedule_generation(batch, now)
            if n == 0:
                break
            used += n
        return used

    # ----- runs of identical decode iterations (a simulator fast path) ----------------------
    def steady_decode_steps(self, batch: BatchUnit) -> int:
        """How many iterations, starting with ``batch``, would be the same all-decode batch.

        Nonzero only when nothing waits (no new work could join), every running request is a
        decode in ``batch``, and the KV cache can grow for the whole run. The run ends at the
        first step where some request finishes. Arrivals are the caller's business: it must cut
        the run at the first iteration boundary after one.
        """
        if len(batch.items) != len(self.running) or len(self.holding) != len(self.running):
            return 0
        if not batch.items or batch.items[0].kind is not ItemKind.DECODE:
            return 0
        if (self.embed_queue or self.gen_queue) and not self._admission_blocked(batch):
            return 0
        steps = min(r.max_output_tokens - r.num_generated for r in self.running)
        if steps < 1:
            return 0
        bs = self.config.block_size
        free = self.blocks.num_free

        def extra_blocks(k: int) -> int:
            # step k computes the token at position seq_len + k - 2, so holds seq_len + k - 1
            return sum(max(0, -(-(r.seq_len + k - 1) // bs) - len(self.blocks.tables[r.request_id]))
                       for r in self.running)

        if extra_blocks(steps) > free:
            lo, hi = 1, steps  # largest k whose growth fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if extra_blocks(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            steps = lo if extra_blocks(lo) <= free else 0
        return steps

    def _admission_blocked(self, batch: BatchUnit) -> bool:
        """True when no waiting request can join for as long as the decodes run: the decodes
        fill the budget, or each queue's head is held back by the generation sequence cap or
        needs more KV blocks than are free (decodes only ever take blocks, so that stays)."""
        if batch.total_tokens >= batch.token_budget:
            return True
        free = self.blocks.num_free
        head = self.gen_queue[0] if self.gen_queue else None
        if (head is not None and len(self.running) < self.config.max_num_seqs
                and self.blocks.blocks_for(head.seq_len) <= free):
            return False
        head = next((r for r in self.embed_queue if r.state is RequestState.WAITING), None)
        return head is None or self.blocks.blocks_for(head.input_len) > free

    def complete_decode_run(self, batch: BatchUnit, steps: int, now: float) -> list[Request]:
        """Apply ``steps`` identical decode iterations at once (``steps`` from
        ``steady_decode_steps``); ``now`` is the end of the last one."""
        left: list[Request] = []
        self.iterations += steps
        for item in batch.items:
            req = item.request
            if req.state is not RequestState.RUNNING:
                continue
            if not self.blocks.grow(req.request_id, req.seq_len + steps - 1):
                raise RuntimeError("decode run outgrew the KV cache: steady_decode_steps was not used")
            req.num_computed += steps
            req.num_generated += steps
            req.ready_since = now
            if req.is_done:
                self._finish(req, now)
                left.append(req)
        return left
