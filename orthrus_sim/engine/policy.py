"""The policy interface and the mechanics every policy shares.

A policy owns one replica's queues and KV-cache accounting. An executor (the simulator's replica
process, the PyTorch engine, the vLLM scheduler plug-in) drives it with three calls::

    policy.add(request, now)            # False (request REJECTED, reason set) if it can never run
    batch = policy.schedule(now)        # the next batch unit; empty when there is nothing to do
    left = policy.complete(batch, now)  # advance requests; returns those that left the replica

``complete`` returns requests that finished (state FINISHED) and, for a prefill-only replica,
generation requests handed off after their first token (state WAITING, KV to be transferred).

A policy decides only *which* work enters a batch: it implements ``fill(batch, now)`` with the
public helpers below. Admission, KV blocks, decode growth, preemption, budget claims and
completion live here, so every policy keeps the same invariants (docs/scheduler.md):

* an embedding reserves blocks for its whole input when its first chunk is scheduled, so once
  admitted it always completes; an embedding head refused for lack of blocks holds them back
  from every later admission of that iteration;
* a decode that cannot grow takes blocks from the newest *generation* request holding any; it
  never evicts an embedding (it waits for the embedding's blocks instead);
* an embedding chunk that is offered but does not fit the budget left gets its tokens reserved
  at the start of the next iteration, ahead of the decodes (a budget claim).
"""

from __future__ import annotations

import abc
import bisect
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.iteration_target import IterationTarget, IterationTimePredictor
from orthrus_sim.engine.kv_cache import BlockManager
from orthrus_sim.engine.request import Request, RequestKind, RequestState

EMBEDDING, GENERATION = RequestKind.EMBEDDING, RequestKind.GENERATION


@dataclass(frozen=True)
class PolicySnapshot:
    """A read-only picture of a policy for observers (metrics, monitors, tests)."""

    policy: str
    embeddings_waiting: int  # not holding KV blocks yet
    embeddings_running: int  # holding blocks, chunks still to go
    generations_waiting: int  # not holding blocks (new or preempted)
    generations_running: int  # holding blocks: prefilling or decoding
    embedding_work: int  # ``we``: tokens IBS weighs the embedding queue with
    generation_work: int  # ``wg``
    kv_blocks_used: int
    kv_blocks_total: int
    credits: dict[str, float] | None  # IBS only
    preemptions: dict[str, int]  # recompute preemptions so far, by kind
    iterations: int
    budget_claim: str | None  # request whose tokens the next batch reserves

    @property
    def waiting(self) -> int:
        return self.embeddings_waiting + self.generations_waiting

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


def _insert_in_order(queue: list[Request], request: Request) -> None:
    """Insert by FCFS key (arrival, then add order); appending is the common case."""
    if not queue or queue[-1].order <= request.order:
        queue.append(request)
    else:
        queue.insert(bisect.bisect_right(queue, request.order, key=lambda r: r.order), request)


class Policy(abc.ABC):
    """Base policy: subclasses implement ``fill`` (and set ``serves`` for single-type replicas).

    ``decode_runs``: the simulator may advance runs of identical all-decode iterations at once
    (``steady_decode_phases``). That is exact when ``fill`` depends on the queues and the KV cache
    only; a policy whose choices depend on the clock sets it False.

    ``predictor``: the iteration-time predictor that ``config.tpot_target_s`` needs (the
    executor's cost model); a target without one is refused.
    """

    name = "base"
    serves: tuple[RequestKind, ...] = (EMBEDDING, GENERATION)
    decode_runs = True

    def __init__(self, config: SchedulerConfig | None = None,
                 predictor: IterationTimePredictor | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.target: IterationTarget | None = None
        if self.config.tpot_target_s is not None:
            if predictor is None:
                raise ValueError(
                    "scheduler.tpot_target_s needs an iteration-time predictor: the simulator "
                    "uses its cost model; a real engine needs a calibration (serve --calibration "
                    "FILE, from `orthrus-real calibrate`)")
            self.target = IterationTarget(self.config.tpot_target_s, self.config.min_chunk_tokens,
                                          predictor)
        self.blocks = BlockManager(self.config.num_blocks, self.config.block_size)
        self.iterations = 0
        self.preemptions = {EMBEDDING.value: 0, GENERATION.value: 0}
        self._embeddings: list[Request] = []  # unfinished embeddings, FCFS order
        self._waiting_gen: list[Request] = []  # generation requests holding no blocks, FCFS
        self._running: list[Request] = []  # generation requests holding blocks, admission order
        self._prefilling: list[Request] = []  # those of them with prompt work left
        self._holding: dict[str, Request] = {}  # every request holding blocks, admission order
        self._embeds_holding: dict[str, Request] = {}  # the embeddings among them
        self._requests: dict[str, Request] = {}  # every live request by id
        # ``waiting_work`` of the requests holding no blocks, kept as they come and go so that
        # an iteration's cost does not grow with the queues (it is fixed while one waits)
        self._queued_work: dict[str, int] = {}
        self._queued_sum = {EMBEDDING: 0, GENERATION: 0}
        self._added = 0
        self._budget_claim: tuple[str, int] | None = None
        # state of the iteration being filled
        self._claimant: Request | None = None  # its turn was taken last iteration: it goes first
        self._in_batch: set[str] = set()
        self._embed_cursor = 0
        self._held_back = 0
        self._held_for: dict[str, int] = {}

    # ----- the interface -----------------------------------------------------------------
    def add(self, request: Request, now: float = 0.0) -> bool:
        """Queue a request; rejects (and returns False) one that could never be served."""
        if request.state is not RequestState.WAITING:
            raise ValueError(f"request {request.request_id}: only a waiting request can be added, "
                             f"this one is {request.state.value}")
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already queued")
        reason = self._reject_reason(request)
        if reason is not None:
            request.reject(reason)
            request.finished_at = now
            return False
        self._requests[request.request_id] = request
        request.ready_since = now
        self._added += 1
        request.order = (request.arrival_time, self._added)
        _insert_in_order(self._embeddings if request.is_embedding else self._waiting_gen, request)
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

    # ----- views ---------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._embeddings or self._waiting_gen or self._running)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def get(self, request_id: str) -> Request | None:
        """The live request with this id (None once it finished, was aborted or left)."""
        return self._requests.get(request_id)

    def holds_kv(self, request_id: str) -> bool:
        return request_id in self._holding

    def live(self) -> tuple[Request, ...]:
        """Every request queued or running here, in the order it was added."""
        return tuple(self._requests.values())

    def embeddings(self) -> tuple[Request, ...]:
        """Unfinished embedding requests (waiting or in flight), FCFS."""
        return tuple(self._embeddings)

    def waiting_generations(self) -> tuple[Request, ...]:
        """Generation requests waiting for (re-)admission, FCFS."""
        return tuple(self._waiting_gen)

    def running_generations(self) -> tuple[Request, ...]:
        """Generation requests holding KV blocks (prefilling or decoding), admission order."""
        return tuple(self._running)

    def waiting_work(self) -> tuple[int, int]:
        """``we`` and ``wg`` of the brief: the remaining prompt work of the embedding queue
        and of the generation requests that still have prompt work (waiting or prefilling),
        each weighed by ``Request.waiting_work``."""
        count_output = self.config.count_waiting_output
        we = self._queued_sum[EMBEDDING]
        for r in self._embeds_holding.values():
            we += r.num_uncomputed
        wg = self._queued_sum[GENERATION]
        for r in self._prefilling:
            wg += r.waiting_work(count_output)
        return we, wg

    def _queue_work(self, request: Request) -> None:
        weight = request.waiting_work(self.config.count_waiting_output)
        self._queued_work[request.request_id] = weight
        self._queued_sum[request.kind] += weight

    def _unqueue_work(self, request: Request) -> None:
        weight = self._queued_work.pop(request.request_id, None)
        if weight is not None:
            self._queued_sum[request.kind] -= weight

    def snapshot(self) -> PolicySnapshot:
        we, wg = self.waiting_work()
        running_embed = len(self._embeds_holding)
        return PolicySnapshot(
            policy=self.name,
            embeddings_waiting=len(self._embeddings) - running_embed,
            embeddings_running=running_embed,
            generations_waiting=len(self._waiting_gen),
            generations_running=len(self._running),
            embedding_work=we, generation_work=wg,
            kv_blocks_used=self.blocks.num_used, kv_blocks_total=self.blocks.num_blocks,
            credits=self._credits_view(), preemptions=dict(self.preemptions),
            iterations=self.iterations,
            budget_claim=self._budget_claim[0] if self._budget_claim else None,
        )

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
            if self._embeds_holding:
                return False  # embeddings give their blocks back within a few iterations
            self._preempt(req)
            return False
        return True

    def schedule_embedding(self, batch: BatchUnit, request: Request, now: float) -> int:
        """One chunk of ``request`` (``schedule_one(Qe, B)``): its tokens, or 0 if it cannot go
        this iteration (already in the batch, no request slot, no KV blocks, or the chunk does
        not fit the budget left: chunks are never split; that one claims the next batch)."""
        rid = request.request_id
        if rid in self._in_batch or request.state.is_final:
            return 0
        n = self._embed_chunk_len(request)
        waiting = request.state is RequestState.WAITING
        if waiting:
            if self._embed_slots_full():
                return 0
            need = self.blocks.blocks_for(request.input_len)
            if not (self._kv_allows(need, rid) and self._reserve_fits(need, rid)):
                self._hold_back(rid, need)
                return 0
        if n > batch.budget_for(rid):
            if self._budget_claim is None:
                self._budget_claim = (rid, n)
            if waiting:
                self._hold_back(rid, self.blocks.blocks_for(request.input_len))
            return 0
        if self.target is not None:
            n = self.target.tokens_within(batch, request, ItemKind.EMBED_CHUNK, n)
            if not n:
                return 0  # beside these decodes no chunk meets the target: it waits
        if waiting:
            self._admit(request, request.input_len, now)
        batch.add(request, ItemKind.EMBED_CHUNK, n)
        self._in_batch.add(rid)
        return n

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

    def _embed_chunk_len(self, request: Request) -> int:
        size = self.config.chunk_size
        remaining = request.num_uncomputed
        return remaining if size is None else min(size, remaining)

    def _embed_slots_full(self) -> bool:
        cap = self.config.max_num_embeds
        return cap is not None and len(self._embeds_holding) >= cap

    def _kv_allows(self, blocks: int, request_id: str) -> bool:
        """Admission test: ``blocks`` fit beside what is held back for other requests."""
        held_for_others = self._held_back - self._held_for.get(request_id, 0)
        return blocks <= self.blocks.num_free - held_for_others

    def _final_blocks(self, request: Request) -> int:
        """Blocks a generation request will hold at its expected end."""
        final = request.input_len + max(request.expected_output_tokens, request.num_generated + 1)
        return max(self.blocks.held(request.request_id), self.blocks.blocks_for(final))

    def _reserve_fits(self, blocks: int, request_id: str) -> bool:
        """``kv_admission: reserve``: the running generations' expected final sizes, what
        embeddings hold, what is held back for other requests and ``blocks`` more (the
        newcomer's final size) all fit the cache. Embeddings are admitted by it too: blocks an
        embedding takes are blocks a running decode may need."""
        if self.config.kv_admission != "reserve":
            return True
        projected = sum(self._final_blocks(r) for r in self._running)
        held_for_others = self._held_back - self._held_for.get(request_id, 0)
        return (projected + self.embedding_blocks() + held_for_others + blocks
                <= self.blocks.num_blocks)

    def _hold_back(self, request_id: str, blocks: int) -> None:
        """Set ``blocks`` of the free pool aside for a waiting embedding head for the rest of
        this iteration: later admissions of other requests cannot take them."""
        if request_id not in self._held_for:
            self._held_for[request_id] = blocks
            self._held_back += blocks

    def embedding_blocks(self) -> int:
        """KV blocks held by embeddings in flight."""
        held = self.blocks.held
        return sum(held(rid) for rid in self._embeds_holding)

    def _admit(self, request: Request, num_tokens: int, now: float) -> None:
        if not self.blocks.grow(request.request_id, num_tokens):
            raise RuntimeError(f"request {request.request_id}: admitted without free blocks")
        request.transition(RequestState.RUNNING)
        if request.admitted_at is None:
            request.admitted_at = now
        self._holding[request.request_id] = request
        if request.is_embedding:
            self._embeds_holding[request.request_id] = request
        self._unqueue_work(request)

    def _release(self, request: Request) -> None:
        rid = request.request_id
        self.blocks.free(rid)
        held = self._holding.pop(rid, None) is not None
        self._embeds_holding.pop(rid, None)
        self._requests.pop(rid, None)
        self._unqueue_work(request)
        if request.is_embedding:
            if request in self._embeddings:
                self._embeddings.remove(request)
        else:  # a request holding blocks is among the running, one holding none waits
            for queue in (self._running, self._prefilling) if held else (self._waiting_gen,):
                if request in queue:
                    queue.remove(request)

    def _finish(self, request: Request, now: float) -> None:
        self._release(request)
        request.transition(RequestState.FINISHED)
        request.finished_at = now

    def _preempt(self, victim: Request) -> None:
        """Recompute-preemption: free the victim's blocks and put it back in its queue."""
        self.blocks.free(victim.request_id)
        del self._holding[victim.request_id]
        self._embeds_holding.pop(victim.request_id, None)
        victim.transition(RequestState.WAITING)
        victim.reset_for_recompute()
        self._queue_work(victim)
        self.preemptions[victim.kind.value] += 1
        if not victim.is_embedding:
            self._running.remove(victim)
            if victim in self._prefilling:
                self._prefilling.remove(victim)
            _insert_in_order(self._waiting_gen, victim)

    # ----- runs of identical decode iterations (a simulator fast path) ----------------------
    def steady_decode_phases(self, batch: BatchUnit) -> list[tuple[int, list[Request]]]:
        """The phases of a run of decode iterations starting with ``batch``: for each, the step
        count at which it ends (counted from the run's start) and the requests that finish
        then; [] when there is no run.

        A run exists only when ``batch`` holds every request holding blocks and each is a
        decode, and no budget claim is pending. Within a phase the same decodes run, each one
        token further a step; a phase ends where some requests finish. If requests wait,
        ``fill`` admitted none of them: what kept them out (KV blocks, which decodes only
        take; the sequence cap; a budget the decodes fill) stays while the decodes run but not
        past a finish, so the run is one phase. If nothing waits, it goes on through the
        finishes (a finish changes nothing else), to the last request's last token. Either
        way the KV cache must hold every step's growth (else the run is cut short, and its one
        phase ends with nobody finishing). Arrivals are the caller's business: it must cut the
        run at the first iteration boundary after one.
        """
        if not self.decode_runs or self._budget_claim is not None:
            return []
        running = self._running
        if len(batch.items) != len(running) or len(self._holding) != len(running):
            return []
        if not batch.items or batch.items[0].kind is not ItemKind.DECODE:
            return []
        remaining = [r.max_output_tokens - r.num_generated for r in running]
        first = min(remaining)
        if first < 1:
            return []
        nothing_waits = len(self._requests) == len(running)
        if self.target is not None and self._embeddings and not nothing_waits:
            # decodes growing past the target let a progress chunk in (iteration_target.py):
            # what keeps a waiting embedding out may not stay for the run
            return []
        last = max(remaining) if nothing_waits else first
        bs = self.config.block_size
        free = self.blocks.num_free
        if len(running) * -(-(last - 1) // bs) <= free:
            # each decode holds its next token's block: k - 1 more need at most this many
            ends: dict[int, list[Request]] = {}
            for r, n in zip(running, remaining):
                if n <= last:
                    ends.setdefault(n, []).append(r)
            return sorted(ends.items())
        tables = self.blocks.tables
        # tokens held now and blocks' room, per request: step k holds seq_len + k - 1 tokens
        held = [(r.input_len + r.num_generated, len(tables[r.request_id]) * bs) for r in running]

        def extra_blocks(k: int) -> int:
            return sum([-(-(n + k - 1 - room) // bs) for n, room in held if n + k - 1 > room])

        steps = first
        if extra_blocks(steps) > free:
            lo, hi = 1, steps  # largest k whose growth fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if extra_blocks(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            steps = lo if extra_blocks(lo) <= free else 0
        if not steps:
            return []
        return [(steps, [r for r, n in zip(running, remaining) if n == steps])]

    def complete_decode_run(self, batch: BatchUnit, steps: int, now: float,
                            finishing: list[Request] | None = None) -> list[Request]:
        """Apply the first ``steps`` iterations of a decode run starting with ``batch`` at once;
        ``now`` is the end of the last one.

        With ``finishing`` (the requests a phase of ``steady_decode_phases`` ends with), only
        those are brought forward, and they finish; the others are applied once, when the run
        ends, by a call without it, which skips requests that finished already.
        """
        left: list[Request] = []
        if finishing is None:
            self.iterations += steps
        bs = self.blocks.block_size
        tables = self.blocks.tables
        running = RequestState.RUNNING
        grow = self.blocks.grow
        for req in finishing if finishing is not None else [it.request for it in batch.items]:
            if req.state is not running:
                continue
            generated = req.num_generated
            holds = req.input_len + generated + steps - 1
            if holds > len(tables[req.request_id]) * bs and not grow(req.request_id, holds):
                raise RuntimeError("decode run outgrew the KV cache: steady_decode_phases was not used")
            req.num_computed += steps
            req.num_generated = generated = generated + steps
            req.ready_since = now
            if generated >= req.max_output_tokens:
                self._finish(req, now)
                left.append(req)
        return left
