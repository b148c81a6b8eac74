"""The policy interface: what an executor calls, and the one method a policy implements.

A policy owns one replica's queues and KV-cache accounting. An executor (the simulator's replica
process, the PyTorch engine, the vLLM scheduler plug-in) drives it with three calls::

    policy.add(request, now)            # False (request REJECTED, reason set) if it can never run
    batch = policy.schedule(now)        # the next batch unit; empty when there is nothing to do
    left = policy.complete(batch, now)  # advance requests; returns those that left the replica

``complete`` returns requests that finished (state FINISHED) and, for a prefill-only replica,
generation requests handed off after their first token (state WAITING, KV to be transferred).

A policy decides only *which* work enters a batch: it implements ``fill(batch, now)`` with the
public steps of ``steps.py`` and the views of ``queues.py``. What it builds on lives one concept
a file: the scheduling steps (``steps.py``), the queues and waiting work (``queues.py``), KV
admission in both modes, holding back and preemption (``admission.py``), snapshots
(``snapshot.py``) and the simulator's decode-run fast path (``decode_run.py``). So every
policy keeps the same invariants (docs/scheduler.md):

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
from collections.abc import Collection

from orthrus_sim.engine.batch import DECODE, EMBED_CHUNK, BatchUnit
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.iteration_target import IterationTarget, IterationTimePredictor
from orthrus_sim.engine.queues import EMBEDDING, GENERATION, insert_in_order
from orthrus_sim.engine.request import RUNNING, WAITING, Request, RequestKind, RequestState
from orthrus_sim.engine.snapshot import PolicySnapshot, take_snapshot
from orthrus_sim.engine.steps import SchedulingSteps

__all__ = ["EMBEDDING", "GENERATION", "Policy", "PolicySnapshot"]


class Policy(SchedulingSteps, abc.ABC):
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
        if self.config.tpot_target_s is not None:
            if predictor is None:
                raise ValueError(
                    "scheduler.tpot_target_s needs an iteration-time predictor: the simulator "
                    "uses its cost model; a real engine needs a calibration (serve --calibration "
                    "FILE, from `orthrus-real calibrate`)")
            self.target = IterationTarget(self.config.tpot_target_s, self.config.min_chunk_tokens,
                                          predictor, self.config.tpot_slack_iterations,
                                          self.config.tpot_credit)
        self.iterations = 0
        self._added = 0

    # ----- the interface -----------------------------------------------------------------
    def add(self, request: Request, now: float = 0.0) -> bool:
        """Queue a request; rejects (and returns False) one that could never be served."""
        rid = request.request_id
        requests = self._requests
        if rid in requests:
            raise ValueError(f"request id {rid!r} is already here "
                             f"({requests[rid].state.value}): ids must be unique")
        if request.state is not WAITING:
            raise ValueError(f"request {rid}: only a waiting request can be added, "
                             f"this one is {request.state.value}")
        reason = self._reject_reason(request)
        if reason is not None:
            request.reject(reason)
            request.finished_at = now
            return False
        requests[rid] = request
        request.ready_since = now
        self._added += 1
        request.order = (request.arrival_time, self._added)
        insert_in_order(self._embeddings if request.is_embedding else self._waiting_gen, request)
        self._queue_work(request)
        return True

    def schedule(self, now: float = 0.0) -> BatchUnit:
        batch = self._start_iteration()
        batch.started_at = now
        self.fill(batch, now)
        return batch.finalize()

    def complete(
        self, batch: BatchUnit, now: float = 0.0, stopped: Collection[str] = ()
    ) -> list[Request]:
        """Apply a finished forward pass; ``stopped`` names generation requests that hit a stop."""
        self.iterations += 1
        slack = self.target.slack if self.target is not None else None
        if slack is not None:
            slack.spent(batch.started_at, now, batch.num_decodes > 0)
        left: list[Request] = []
        running = RUNNING
        embed_chunk, decode = EMBED_CHUNK, DECODE
        hands_off = type(self)._hands_off is not Policy._hands_off
        cohort = self._cohort
        joining: list[Request] = []  # decodes that join the cohort after this iteration
        pending = batch.cohort_decodes > 0  # the cohort's segment: it comes before decode items
        for item in batch.items:
            req = item.request
            if pending and item.kind is decode:
                self._advance_cohort(1, now, left)
                pending = False
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
                req.transition(WAITING)
                left.append(req)
            else:
                if slack is not None and kind is not decode:  # its prompt done: it decodes now
                    slack.began(req)
                if cohort is not None:
                    joining.append(req)
        if pending:
            self._advance_cohort(1, now, left)
        if joining:
            self._join_cohort(joining)
        return left

    def abort(self, request_id: str, now: float = 0.0) -> Request | None:
        """Drop a request wherever it is and free its blocks; None if it is not here."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if self._cohort is not None:
            self._cohort.settle_one(request_id)
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
