"""The policy interface and the scheduling steps every policy shares.

A policy owns one replica's queues and KV-cache accounting. An executor (the simulator's replica
process, the PyTorch engine, the vLLM scheduler plug-in) drives it with three calls::

    policy.add(request, now)            # False (request REJECTED, reason set) if it can never run
    batch = policy.schedule(now)        # the next batch unit; empty when there is nothing to do
    left = policy.complete(batch, now)  # advance requests; returns those that left the replica

``complete`` returns requests that finished (state FINISHED) and, for a prefill-only replica,
generation requests handed off after their first token (state WAITING, KV to be transferred).

A policy decides only *which* work enters a batch: it implements ``fill(batch, now)`` with the
public helpers below and the views of ``engine/queues.py``. What it builds on lives one concept
a file: the queues and waiting work (``queues.py``), KV admission in both modes, holding back
and preemption (``admission.py``), snapshots (``snapshot.py``) and the simulator's decode-run
fast path (``decode_run.py``). So every policy keeps the same invariants (docs/scheduler.md):

* an embedding reserves blocks for every chunk but its last (``embed_kv_tokens``: the last
  chunk's keys and values are read in its own pass only, so a one-chunk embedding takes none)
  when its first chunk is scheduled, so once admitted it always completes; an embedding head
  refused for lack of blocks holds them back from every later admission of that iteration;
* a decode that cannot grow takes blocks from the newest *generation* request holding any; it
  never evicts an embedding (it waits for the embedding's blocks instead);
* an embedding chunk that is offered but does not fit the budget left gets its tokens reserved
  at the start of the next iteration, ahead of the decodes (a budget claim).
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Iterable

from orthrus_sim.engine.admission import KVAdmission
from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.iteration_target import IterationTarget, IterationTimePredictor
from orthrus_sim.engine.queues import EMBEDDING, GENERATION, insert_in_order
from orthrus_sim.engine.request import Request, RequestKind, RequestState
from orthrus_sim.engine.snapshot import PolicySnapshot, take_snapshot

__all__ = ["EMBEDDING", "GENERATION", "Policy", "PolicySnapshot"]


class Policy(KVAdmission, abc.ABC):
    """Base policy: subclasses implement ``fill`` (and set ``serves`` for single-type replicas).

    ``decode_runs``: the simulator may advance runs of identical all-decode iterations at once
    (``engine/decode_run.py``); False turns that off. ``clock_free``: ``fill`` depends on the
    queues and the KV cache only, not on the clock, so a run is exact even while requests wait;
    a policy whose choices depend on the time (Unified-Homo) sets it False and gets runs only
    while nothing waits.

    ``predictor``: the iteration-time predictor that ``config.tpot_target_s`` needs (the
    executor's cost model); a target without one is refused.
    """

    name = "base"
    serves: tuple[RequestKind, ...] = (EMBEDDING, GENERATION)
    decode_runs = True
    clock_free = True

    def __init__(self, config: SchedulerConfig | None = None,
                 predictor: IterationTimePredictor | None = None) -> None:
        super().__init__(config or SchedulerConfig())
        self.target: IterationTarget | None = None
        if self.config.tpot_target_s is not None:
            if predictor is None:
                raise ValueError(
                    "scheduler.tpot_target_s needs an iteration-time predictor: the simulator "
                    "uses its cost model; a real engine needs a calibration (serve --calibration "
                    "FILE, from `orthrus-real calibrate`)")
            self.target = IterationTarget(self.config.tpot_target_s, self.config.min_chunk_tokens,
                                          predictor)
        self.iterations = 0
        self._added = 0
        self._budget_claim: tuple[str, int] | None = None
        # state of the iteration being filled
        self._claimant: Request | None = None  # its turn was taken last iteration: it goes first
        self._in_batch: set[str] = set()
        self._embed_cursor = 0

    # ----- the interface -----------------------------------------------------------------
    def add(self, request: Request, now: float = 0.0) -> bool:
        """Queue a request; rejects (and returns False) one that could never be served."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already here "
                             f"({self._requests[request.request_id].state.value}): ids must be unique")
        if request.state is not RequestState.WAITING:
            raise ValueError(f"request {request.request_id}: only a waiting request can be added, "
                             f"this one is {request.state.value}")
        reason = self._reject_reason(request)
        if reason is not None:
            request.reject(reason)
            request.finished_at = now
            return False
        self._requests[request.request_id] = request
        request.ready_since = now
        self._added += 1
        request.order = (request.arrival_time, self._added)
        insert_in_order(self._embeddings if request.is_embedding else self._waiting_gen, request)
        self._queue_work(request)
        return True

    def schedule(self, now: float = 0.0) -> BatchUnit:
        batch = BatchUnit(self.config.token_budget)
        claim, self._budget_claim = self._budget_claim, None
        self._claimant = self._requests.get(claim[0]) if claim is not None else None
        if self._claimant is not None:
            batch.reserve(*claim)
        self._in_batch = set()
        self._embed_cursor = 0
        self._held_back = 0
        self._held_for = {}
        self.fill(batch, now)
        return batch.finalize()

    def complete(
        self, batch: BatchUnit, now: float = 0.0, stopped: Collection[str] = ()
    ) -> list[Request]:
        """Apply a finished forward pass; ``stopped`` names generation requests that hit a stop."""
        self.iterations += 1
        left: list[Request] = []
        running = RequestState.RUNNING
        embed_chunk, decode = ItemKind.EMBED_CHUNK, ItemKind.DECODE
        hands_off = type(self)._hands_off is not Policy._hands_off
        for item in batch.items:
            req = item.request
            if req.state is not running:
                continue  # aborted while the pass ran
            req.num_computed += item.num_tokens
            req.ready_since = now
            kind = item.kind
            if kind is not decode:  # a chunk (a decode is one token whose next one is sampled)
                req.chunks_done += 1
                if req.first_chunk_at is None:
                    req.first_chunk_at = now
                if kind is embed_chunk:
                    if req.num_computed >= req.input_len:
                        self._finish(req, now)
                        left.append(req)
                    continue
                if req.num_computed != req.input_len + req.num_generated:
                    continue  # more of the prompt to go
                self._prefilling.remove(req)  # prompt (or recompute) done: it decodes now
            generated = req.num_generated = req.num_generated + 1
            if req.first_token_at is None:
                req.first_token_at = now
            if generated >= req.max_output_tokens or (stopped and req.request_id in stopped):
                self._finish(req, now)
                left.append(req)
            elif hands_off and self._hands_off(req):
                self._release(req)
                req.transition(RequestState.WAITING)
                left.append(req)
        return left

    def abort(self, request_id: str, now: float = 0.0) -> Request | None:
        """Drop a request wherever it is and free its blocks; None if it is not here."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._release(req)
        req.transition(RequestState.ABORTED)
        req.finished_at = now
        return req

    # ----- what a policy implements ----------------------------------------------------------
    @abc.abstractmethod
    def fill(self, batch: BatchUnit, now: float) -> None:
        """Add this iteration's work to ``batch`` with the ``schedule_*`` helpers."""

    def _hands_off(self, request: Request) -> bool:
        """True where a generation request leaves after its first token (prefill replicas)."""
        return False
    def snapshot(self) -> PolicySnapshot:
        return take_snapshot(self, self._credits_view(),
                             self._budget_claim[0] if self._budget_claim else None)

    def _credits_view(self) -> dict[str, float] | None:
        return None
    # ----- helpers for ``fill`` ---------------------------------------------------------------
    def next_embedding(self) -> Request | None:
        """The earliest unfinished embedding with no chunk in this batch yet; a budget
        claimant (its chunk did not fit last iteration) comes first."""
        claimant = self._claimant
        in_batch = self._in_batch
        if (claimant is not None and claimant.request_id not in in_batch
                and not claimant.state.is_final):
            return claimant
        q = self._embeddings
        while self._embed_cursor < len(q):
            req = q[self._embed_cursor]
            if req.request_id not in in_batch:
                return req
            self._embed_cursor += 1
        return None

    def next_generation(self) -> Request | None:
        """The generation request whose prompt work comes next: an admitted prompt not yet in
        this batch (admission order), else the head of the waiting queue."""
        in_batch = self._in_batch
        for req in self._prefilling:
            if req.request_id not in in_batch:
                return req
        for req in self._waiting_gen:
            if req.request_id not in in_batch:
                return req
        return None

    def schedule_running(self, batch: BatchUnit) -> int:
        """Decodes, then the admitted prompts' next chunks (vLLM's order for running work)."""
        used = self.schedule_decodes(batch)
        for req in list(self._prefilling):
            if batch.budget_left <= 0:
                break
            if req.request_id not in self._in_batch:
                used += self._add_prompt_chunk(batch, req)
        return used

    def schedule_decodes(self, batch: BatchUnit) -> int:
        """Every running decode, in admission order, while the budget lasts.

        A decode whose next token needs a block it cannot get takes one from the newest
        generation request holding blocks (recompute preemption, as vLLM does); if it is the
        newest, it waits for embeddings' blocks when embeddings hold any, else it preempts itself.
        (This loop runs for every decode of every iteration, hence the inlined arithmetic.)
        """
        room = batch.budget_left  # the reservation stays untouched
        block_size = self.blocks.block_size
        tables, grow = self.blocks.tables, self.blocks.grow
        in_batch = self._in_batch
        check_batch = bool(in_batch)  # usually empty: decodes are scheduled first
        mark = in_batch.add
        running = RequestState.RUNNING
        decode = ItemKind.DECODE
        item = BatchItem
        ready: list[BatchItem] = []
        append = ready.append
        n = 0
        for req in list(self._running):
            generated = req.num_generated
            if not generated or req.state is not running:
                continue  # still prefilling, or preempted earlier in this loop
            computed = req.num_computed
            seq_len = req.input_len + generated
            if seq_len - computed != 1:
                continue
            rid = req.request_id
            if check_batch and rid in in_batch:
                continue
            if n >= room:
                break
            if len(tables[rid]) * block_size < seq_len and not (
                    grow(rid, seq_len) or self._grow_decode(req, seq_len)):
                continue
            append(item(req, decode, computed, 1))
            mark(rid)
            n += 1
        batch.add_decodes(ready)
        return n

    def _grow_decode(self, req: Request, seq_len: int) -> bool:
        """Blocks for a decode's next token, preempting newer generation requests if needed."""
        while not self.blocks.grow(req.request_id, seq_len):
            victim = None
            for r in reversed(self._running):  # newest first, down to the decode itself
                if r is req:
                    break
                if r.request_id not in self._in_batch:
                    victim = r
                    break
            if victim is not None:
                self._preempt(victim)
                continue
            if self.embedding_blocks():
                return False  # embeddings give their blocks back within a few iterations
            self._preempt(req)
            return False
        return True

    def schedule_embedding(self, batch: BatchUnit, request: Request, now: float) -> int:
        """One chunk of ``request`` (``schedule_one(Qe, B)``): its tokens, or 0 if it cannot go
        this iteration (already in the batch, no request slot, no KV blocks, or the chunk does
        not fit the budget left: chunks are never split; that one claims the next batch).
        Admission takes the blocks of every chunk but the last (``embed_kv_tokens``)."""
        rid = request.request_id
        if rid in self._in_batch or request.state.is_final:
            return 0
        n = self._embed_chunk_len(request)
        waiting = request.state is RequestState.WAITING
        need = 0
        if waiting:
            if self._embed_slots_full():
                return 0
            need = self.blocks.blocks_for(self.embed_kv_tokens(request))
            if not (self._kv_allows(need, rid) and self._reserve_fits(need, rid)):
                self._hold_back(rid, need)
                return 0
        if n > batch.budget_for(rid):
            if self._budget_claim is None:
                self._budget_claim = (rid, n)
            if waiting:
                self._hold_back(rid, need)
            return 0
        if self.target is not None:
            n = self.target.tokens_within(batch, request, ItemKind.EMBED_CHUNK, n)
            if not n:
                return 0  # beside these decodes no chunk meets the target: it waits
        n = self._embed_chunk_kv(request, n, need)
        if not n:
            return 0
        end = request.num_computed + n
        stores = end if end < request.input_len else 0  # the last chunk stores nothing
        if waiting:
            self._admit(request, max(self.embed_kv_tokens(request), stores), now)
        elif not self.blocks.grow(rid, stores):
            raise RuntimeError(f"request {rid}: embedding chunk scheduled without its blocks")
        batch.add(request, ItemKind.EMBED_CHUNK, n)
        self._in_batch.add(rid)
        return n

    def _embed_chunk_kv(self, request: Request, n: int, need: int) -> int:
        """Tokens of a chunk of ``n`` whose keys and values (if it is not the last chunk) the
        cache can hold. Chunks of ``chunk_size`` fit what admission took; a chunk the
        iteration-time target cut short moves the last chunk later, so a later chunk may need
        more: the blocks grow where they fit (``need``: what a waiting request's admission
        takes anyway, else 0); else the chunk ends where its blocks end, and an admitted
        embedding with none past its start sends its remainder (at most ``chunk_size``
        tokens) as its last chunk, over the target once, so that it always completes; a
        waiting one waits."""
        start = request.num_computed
        end = start + n
        if end >= request.input_len or self.config.embedding_kv == "all":
            return n
        rid = request.request_id
        waiting = request.state is RequestState.WAITING
        base = need if waiting else self.blocks.held(rid)
        extra = self.blocks.blocks_for(end) - base
        if extra <= 0:
            return n
        if self._kv_allows(need + extra, rid) and self._reserve_fits(need + extra, rid):
            return n
        room = base * self.blocks.block_size - start
        if room > 0:
            return room
        if waiting:
            self._hold_back(rid, need + extra)
            return 0
        return request.input_len - start

    def schedule_generation(self, batch: BatchUnit, request: Request, now: float) -> int:
        """The next prompt chunk of ``request`` (``schedule_one(Qg, B)``), admitting it if it is
        waiting: its tokens, or 0 if it cannot go (sequence cap, no budget, no KV blocks)."""
        rid = request.request_id
        if rid in self._in_batch or request.state.is_final:
            return 0
        left = batch.budget_for(rid)
        if left <= 0:
            return 0
        if self.target is not None and not request.is_decode:
            left = self.target.tokens_within(batch, request, ItemKind.PREFILL_CHUNK,
                                             min(request.num_uncomputed, left))
            if not left:
                return 0
        if request.state is RequestState.WAITING:
            if len(self._running) >= self.config.max_num_seqs:
                return 0
            if not self._kv_allows(self.blocks.extra_blocks(rid, request.seq_len), rid):
                return 0
            if not self._reserve_fits(self._final_blocks(request), rid):
                return 0
            self._admit(request, request.seq_len, now)
            self._waiting_gen.remove(request)
            self._running.append(request)
            if not request.is_decode:
                self._prefilling.append(request)
        return self._add_prompt_chunk(batch, request, left)

    def _add_prompt_chunk(self, batch: BatchUnit, request: Request, limit: int | None = None) -> int:
        """An admitted request's next tokens, chunked to the budget left (or its decode) and,
        with an iteration-time target, to what meets it (``limit``: already so cut)."""
        n = min(request.num_uncomputed, batch.budget_for(request.request_id))
        if limit is not None:
            n = min(n, limit)
        elif self.target is not None and n > 0 and not request.is_decode:
            n = self.target.tokens_within(batch, request, ItemKind.PREFILL_CHUNK, n)
        if n <= 0:
            return 0
        batch.add(request, ItemKind.DECODE if request.is_decode else ItemKind.PREFILL_CHUNK, n)
        self._in_batch.add(request.request_id)
        return n

    def fill_fcfs(self, batch: BatchUnit, now: float, kinds: Iterable[RequestKind]) -> int:
        """Admit new work in one global arrival order, stopping at the first that cannot go; a
        budget claimant goes first (its turn came last iteration)."""
        kinds = set(kinds)
        used = 0
        claimant = self._claimant
        if claimant is not None and claimant.kind in kinds and claimant.request_id not in self._in_batch:
            used += self.schedule_embedding(batch, claimant, now)
        while True:
            emb = self.next_embedding() if EMBEDDING in kinds else None
            gen = self.next_generation() if GENERATION in kinds else None
            if emb is None and gen is None:
                break
            if gen is None or (emb is not None and emb.order < gen.order):
                n = self.schedule_embedding(batch, emb, now)
            else:
                n = self.schedule_generation(batch, gen, now)
            if n == 0:
                break
            used += n
        return used

    def _embed_chunk_len(self, request: Request) -> int:
        size = self.config.chunk_size
        remaining = request.num_uncomputed
        return remaining if size is None else min(size, remaining)
