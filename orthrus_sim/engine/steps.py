"""The scheduling steps every policy's ``fill`` is made of: pick the next embedding or
generation request, schedule the running decodes and prompts, one embedding chunk, one prompt
chunk, or new work in one global arrival order. Each step keeps the invariants of
docs/scheduler.md (an admitted embedding always completes, a decode preempts only newer
generation requests, a chunk that does not fit claims the next batch) and, with an
iteration-time target, cuts its chunk to what meets it. ``Policy`` (``policy.py``) drives them
once per iteration; a policy of one's own calls them from its ``fill``."""

from __future__ import annotations

from collections.abc import Iterable

from orthrus_sim.engine.admission import KVAdmission
from orthrus_sim.engine.batch import DECODE, EMBED_CHUNK, PREFILL_CHUNK, BatchItem, BatchUnit
from orthrus_sim.engine.cohort import DecodeCohort
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.iteration_target import IterationTarget
from orthrus_sim.engine.queues import EMBEDDING, GENERATION
from orthrus_sim.engine.request import RUNNING, WAITING, Request, RequestKind


class SchedulingSteps(KVAdmission):
    """The public helpers for ``fill`` and the state of the iteration being filled."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.target: IterationTarget | None = None  # the iteration-time target, if any
        self._budget_claim: tuple[str, int] | None = None  # (request, tokens) for next batch
        # state of the iteration being filled
        self._claimant: Request | None = None  # its turn was taken last iteration: it goes first
        self._in_batch: set[str] = set()
        self._embed_cursor = 0
        # the simulator's fast path: running decodes kept as one cohort (``use_cohort``)
        self._cohort: DecodeCohort | None = None
        # a router's cap on the generations running here (``cap_running``), below max_num_seqs
        self.running_cap: int | None = None

    def cap_running(self, cap: int | None) -> None:
        """Admit no generation while ``cap`` of them run (None: ``max_num_seqs`` alone): the
        cap a placement puts on a decoding replica so that its decodes hold an iteration-time
        target, the generations past it waiting here in arrival order."""
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"a running cap must be a positive integer or None, got {cap!r}")
        self.running_cap = cap

    def use_cohort(self) -> None:
        """Keep the running decodes as a decode cohort (``engine/cohort.py``): the simulator's
        fast path. Every result is the same; only how often each decode is touched changes."""
        if self._requests:
            raise RuntimeError("use_cohort() must be called before any request is added")
        self._cohort = DecodeCohort(self.blocks)

    def _sync_cohort(self) -> None:
        if self._cohort is not None:
            self._cohort.sync()

    def _dissolve_cohort(self) -> None:
        if self._cohort is not None and self._cohort.members:
            self._cohort.settle_all()

    def _schedule_cohort(self, batch: BatchUnit) -> int | None:
        """The cohort's decodes as one segment, if stepping would schedule exactly them: every
        running decode is a member, all fit the budget and their next tokens' blocks fit (else
        None, the cohort settled, and the decodes go one by one: preemption, budget cuts)."""
        c = self._cohort
        n = len(c.members)
        if not n:
            return None
        in_batch = self._in_batch
        if (n != len(self._running) - len(self._prefilling) or n > batch.budget_left
                or (in_batch and any(rid in c for rid in in_batch)) or not c.take_blocks(c.steps)):
            c.settle_all()
            return None
        batch.add_cohort(n, c.decode_kv())
        return n

    def _advance_cohort(self, steps: int, now: float, left: list[Request]) -> None:
        """The cohort's decodes ran ``steps`` iterations, the last ending at ``now``; members
        that finish then leave (into ``left``)."""
        for req in self._cohort.advance(steps, now):
            self._finish(req, now)
            left.append(req)

    def _join_cohort(self, requests: list[Request]) -> None:
        """Decodes that came out of an iteration's items join the cohort."""
        c = self._cohort
        order = self._running_order
        for req in requests:
            if c.can_join(req):
                c.join(req, order[req.request_id])

    def _start_iteration(self) -> BatchUnit:
        """An empty batch, with last iteration's budget claim reserved, and fresh per-iteration
        state (nothing in the batch, nothing held back)."""
        batch = BatchUnit(self.config.token_budget)
        claim, self._budget_claim = self._budget_claim, None
        self._claimant = self._requests.get(claim[0]) if claim is not None else None
        if self._claimant is not None:
            batch.reserve(*claim)
        self._in_batch = set()
        self._embed_cursor = 0
        self._held_back = 0
        self._held_for = {}
        return batch

    def next_embedding(self) -> Request | None:
        """The earliest unfinished embedding with no chunk in this batch yet; a budget
        claimant (its chunk did not fit last iteration) comes first."""
        claimant = self._claimant
        in_batch = self._in_batch
        if (claimant is not None and claimant.request_id not in in_batch
                and not claimant.state.is_final):
            return claimant
        q = self._embeddings
        i, n = self._embed_cursor, len(q)
        while i < n:
            req = q[i]
            if req.request_id not in in_batch:
                self._embed_cursor = i
                return req
            i += 1
        self._embed_cursor = i
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
        if not self._prefilling:
            return used
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
        if self._cohort is not None:
            n = self._schedule_cohort(batch)
            if n is not None:
                return n
        room = batch.budget_left  # the reservation stays untouched
        block_size = self.blocks.block_size
        tables, grow = self.blocks.tables, self.blocks.grow
        in_batch = self._in_batch
        check_batch = bool(in_batch)  # usually empty: decodes are scheduled first
        mark = in_batch.add
        running = RUNNING
        decode = DECODE
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
        Admission takes the blocks of every chunk but the last (``embed_kv_tokens``).
        (Runs once per embedding chunk, hence the inlined arithmetic.)"""
        rid = request.request_id
        if rid in self._in_batch or request.state.is_final:
            return 0
        cfg = self.config
        start, input_len = request.num_computed, request.input_len
        n = input_len - start  # an embedding generates nothing: its uncomputed tokens
        if cfg.chunk_size is not None and cfg.chunk_size < n:
            n = cfg.chunk_size
        waiting = request.state is WAITING
        need = kv_tokens = 0
        if waiting:
            if self._embed_slots_full():
                return 0
            kv_tokens = self.embed_kv_tokens(request)
            need = -(-kv_tokens // self.blocks.block_size)  # blocks_for, inlined
            if not (self._kv_allows(need, rid) and (cfg.kv_admission != "reserve"
                                                   or self._reserve_fits(need, rid))):
                self._hold_back(rid, need)
                return 0
        if n > batch.budget_for(rid):
            if self._budget_claim is None:
                self._budget_claim = (rid, n)
            if waiting:
                self._hold_back(rid, need)
            return 0
        if self.target is not None:
            n = self.target.tokens_within(batch, request, EMBED_CHUNK, n)
            if not n:
                return 0  # beside these decodes no chunk meets the target: it waits
        if start + n < input_len:  # not its last chunk: its keys and values are stored
            n = self._embed_chunk_kv(request, n, need)
            if not n:
                return 0
        end = start + n
        stores = end if end < input_len else 0  # the last chunk stores nothing
        if waiting:
            self._admit(request, kv_tokens if kv_tokens > stores else stores, now)
        elif stores and not self.blocks.grow(rid, stores):
            raise RuntimeError(f"request {rid}: embedding chunk scheduled without its blocks")
        batch.add(request, EMBED_CHUNK, n)
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
        waiting = request.state is WAITING
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
            left = self.target.tokens_within(batch, request, PREFILL_CHUNK,
                                             min(request.num_uncomputed, left))
            if not left:
                return 0
        if request.state is WAITING:
            cfg = self.config
            running = len(self._running)
            if running >= cfg.max_num_seqs or (self.running_cap is not None
                                               and running >= self.running_cap):
                return 0
            seq_len = request.input_len + request.num_generated
            if not self._kv_allows(self.blocks.extra_blocks(rid, seq_len), rid):
                return 0
            if cfg.kv_admission == "reserve" and not self._reserve_fits(
                    self._final_blocks(request), rid):
                return 0
            self._admit(request, seq_len, now)
            self._waiting_gen.remove(request)
            self._running.append(request)
            self._admissions += 1
            self._running_order[rid] = self._admissions
            if not request.is_decode:
                self._prefilling.append(request)
        return self._add_prompt_chunk(batch, request, left)

    def _add_prompt_chunk(self, batch: BatchUnit, request: Request, limit: int | None = None) -> int:
        """An admitted request's next tokens, chunked to the budget left (or its decode) and,
        with an iteration-time target, to what meets it (``limit``: already so cut)."""
        rid = request.request_id
        decode = request.is_decode
        n = min(request.num_uncomputed, batch.budget_for(rid))
        if limit is not None:
            n = min(n, limit)
        elif self.target is not None and n > 0 and not decode:
            n = self.target.tokens_within(batch, request, PREFILL_CHUNK, n)
        if n <= 0:
            return 0
        batch.add(request, DECODE if decode else PREFILL_CHUNK, n)
        self._in_batch.add(rid)
        return n

    def fill_fcfs(self, batch: BatchUnit, now: float, kinds: Iterable[RequestKind]) -> int:
        """Admit new work in one global arrival order, stopping at the first that cannot go; a
        budget claimant goes first (its turn came last iteration)."""
        kinds = tuple(kinds)  # membership by identity: no enum hashing in this loop
        embeddings, generations = EMBEDDING in kinds, GENERATION in kinds
        used = 0
        claimant = self._claimant
        if claimant is not None and claimant.kind in kinds and claimant.request_id not in self._in_batch:
            used += self.schedule_embedding(batch, claimant, now)
        while True:
            emb = self.next_embedding() if embeddings else None
            gen = self.next_generation() if generations else None
            if emb is None:
                if gen is None:
                    break
                embeddings = False  # scheduling a generation adds no embedding: none comes later
            elif gen is None:
                generations = False  # nor the other way round
            if gen is None or (emb is not None and emb.order < gen.order):
                n = self.schedule_embedding(batch, emb, now)
            else:
                n = self.schedule_generation(batch, gen, now)
            if n == 0:
                break
            used += n
        return used
