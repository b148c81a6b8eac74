"""The iteration-time target: how much a chunk may add to a batch that carries decodes.

A decode-heavy iteration is memory-bound: a chunk riding with the decodes uses compute the step
leaves idle, until it makes the step compute-bound and every running generation pays for it. The
target (``SchedulerConfig.tpot_target_s``) says how long an iteration that carries decodes may
take; the policy asks it, before adding a prompt or embedding chunk, how many of the chunk's
tokens fit. Time comes from an ``IterationTimePredictor`` handed to the policy by its executor
(the simulator's cost model, a real engine's calibration): the core never reads a clock.

The rule (docs/scheduler.md, "Iteration-time target"):

* no decode in the batch: the chunk goes whole (the token budget alone applies);
* else the chunk goes whole if the batch with it is predicted within the *limit*, else it is
  cut to the largest multiple of ``min_chunk_tokens`` that is (a remainder shorter than that
  goes whole or not at all), else it does not go this iteration;
* the limit is the target plus the *slack* of the decodes running. A decode's slack is what
  the iterations since it began decoding left of the target (each carried it one token on; an
  iteration without decodes only takes), less what they took over it, plus a *credit*: it may
  take ahead ``tpot_credit`` of the target for each decode it expects, and repays that over
  its output (each of its iterations counts a target shorter by that share). The least slack
  of the running decodes, kept between 0 and ``tpot_slack_iterations`` targets, is what the
  next iteration may take over the target (``slack_s``; iteration times come from the
  executor's clock: ``now`` at ``complete`` minus ``now`` at ``schedule``). TPOT is a
  decode's time per token over its whole output, and a decode whose slack never goes below
  zero ends within the target: so every decode that stops at its expected length holds the
  target on its TPOT (the progress chunks and decodes that alone miss the target aside),
  while a prompt may go whole now and then, as a split's decode server lets it, instead of
  cut to crumbs beside decodes that nearly fill the target. The cap bounds the one long
  iteration a decode sees (its inter-token time); ``tpot_slack_iterations = 0`` caps every
  iteration at the target;
* progress: an embedding chunk of at most ``min_chunk_tokens`` rides beside decodes that
  leave it no room (a) at once when the decodes *alone* are predicted above the target (that
  iteration misses it whatever is added), and (b) when ``PROGRESS_AFTER`` iterations in a row
  refused embedding chunks for the target and took none. So embeddings always progress, and
  only while they are starved does a decode pay one minimum chunk's cost over the limit, once
  in ``PROGRESS_AFTER`` + 1 iterations; while any embedding chunk goes, the limit holds.

The search needs the predictor to be monotone in the chunk's length (more tokens never take less
time), as any roofline is.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind
from orthrus_sim.engine.request import Request, RequestState

# iterations with an embedding chunk refused for the target before one minimum chunk rides anyway
PROGRESS_AFTER = 8


@runtime_checkable
class IterationTimePredictor(Protocol):
    """Seconds one iteration over ``batch``'s items (plus ``extra``, when given) will take.

    Called while ``batch`` is being filled: items are only appended between calls, so an
    implementation may keep a running summary of the items it has seen.
    """

    def predict(self, batch: BatchUnit, extra: BatchItem | None = None) -> float: ...


class IterationTarget:
    """``tokens_within``: the tokens of a chunk that keep a decode-carrying batch within the
    limit (the target plus the running decodes' least slack); ``started`` and ``spent``: what
    the executor reports (a decode begins; an iteration took this long), which the slack
    follows."""

    def __init__(self, target_s: float, min_chunk: int, predictor: IterationTimePredictor,
                 slack_iterations: int = 0, credit: float = 0.0) -> None:
        if not isinstance(predictor, IterationTimePredictor):
            raise TypeError(f"the iteration-time predictor must have predict(batch, extra=None), "
                            f"got {type(predictor).__name__}")
        self.target_s = target_s
        self.min_chunk = min_chunk
        self.predictor = predictor
        self.starved = 0  # iterations in a row that refused embedding chunks and took none
        self._refused_in: BatchUnit | None = None
        self.slack_cap_s = slack_iterations * target_s
        self.credit = credit if slack_iterations else 0.0  # no slack: nothing taken ahead
        # a decode begins with a credit (``started``) and repays it over its output: each
        # iteration counts a target shorter by the credit's share, so that the credit is repaid
        # at its expected last token
        self.paced_s = target_s * (1.0 - self.credit)
        # The slack ledger: the sum, over every iteration this policy ran, of the target (where
        # the iteration carried decodes) minus its time. A decode's own slack is the ledger now
        # less the ledger when it began decoding (its mark): what the iterations since have
        # left of the target for it (or taken over it).
        self.ledger_s = 0.0
        self._marks: list[tuple[float, int, Request]] = []  # min-heap of -(the decodes' marks)
        self._seq = 0
        self._compact_at = 64

    def started(self, request: Request) -> None:
        """``request`` begins decoding (its prompt, or its recompute, is done)."""
        if not self.slack_cap_s:
            return
        self._seq += 1
        request.slack_mark = self._seq
        # it may take ahead the credit's share of the target for each decode it expects to go
        # (called as its prompt's iteration completes, before that iteration's token counts)
        left = (request.expected_output_tokens or 0) - request.num_generated - 1
        credit = self.credit * self.target_s * left if left > 0 else 0.0
        heapq.heappush(self._marks, (credit - self.ledger_s, self._seq, request))
        if len(self._marks) > self._compact_at:  # drop the marks of decodes gone
            self._marks = [m for m in self._marks
                           if m[2].slack_mark == m[1] and m[2].state is RequestState.RUNNING]
            heapq.heapify(self._marks)
            self._compact_at = max(64, 2 * len(self._marks))

    def spent(self, seconds: float, decodes: bool = True) -> None:
        """An iteration took ``seconds``; ``decodes``: it carried decodes, each one token on."""
        self.ledger_s += (self.paced_s if decodes else 0.0) - seconds

    def spent_steps(self, start: float, ends: Sequence[float]) -> None:
        """``spent`` for each of a run of decode iterations from ``start`` ending at ``ends``."""
        ledger, target = self.ledger_s, self.paced_s
        for end in ends:
            ledger += target - (end - start)
            start = end
        self.ledger_s = ledger

    def slack_s(self) -> float:
        """What the next decode-carrying iteration may take over the target: the least slack
        of the decodes running, within 0 and the cap."""
        cap, marks = self.slack_cap_s, self._marks
        if not cap:
            return 0.0
        while marks:
            _, seq, request = marks[0]
            if request.slack_mark == seq and request.state is RequestState.RUNNING:
                slack = self.ledger_s + marks[0][0]
                return cap if slack > cap else (slack if slack > 0.0 else 0.0)
            heapq.heappop(marks)  # that decode is gone (finished, preempted, aborted)
        return 0.0

    def tokens_within(self, batch: BatchUnit, request: Request, kind: ItemKind, n: int) -> int:
        """How many of the ``n`` tokens ``request`` would add as one ``kind`` chunk may go."""
        tokens = self._within(batch, request, kind, n)
        if kind is ItemKind.EMBED_CHUNK and tokens > 0:
            self.starved = 0  # embeddings progress: later refusals this iteration are no starving
            self._refused_in = batch
        return tokens

    def _within(self, batch: BatchUnit, request: Request, kind: ItemKind, n: int) -> int:
        if not batch.num_decodes or n <= 0:
            return n
        predict, target, step = self.predictor.predict, self.target_s, self.min_chunk
        limit = self.paced_s + self.slack_s()
        start = request.num_computed

        def fits(tokens: int) -> bool:
            return predict(batch, BatchItem(request, kind, start, tokens)) <= limit

        if fits(n):
            return n
        hi = (n - 1) // step  # multiples of ``step`` below n
        if hi >= 1 and fits(step):
            lo = 1
            while lo < hi:  # the largest multiple that fits
                mid = (lo + hi + 1) // 2
                if fits(mid * step):
                    lo = mid
                else:
                    hi = mid - 1
            return lo * step
        if kind is ItemKind.EMBED_CHUNK:
            if self.starved >= PROGRESS_AFTER or (batch.num_decodes == batch.num_seqs
                                                  and predict(batch) > target):
                return min(n, step)  # the progress chunk
            if self._refused_in is not batch:
                self._refused_in = batch
                self.starved += 1
        return 0
