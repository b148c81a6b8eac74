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
* the limit is the target, or with slack (``tpot_slack_iterations`` > 0, ``slack.py``) the
  paced target plus the least slack of the decodes running: what the iterations since each
  began decoding left of the target, plus a credit it repays over its output. So a decode's
  TPOT (its mean time per token) holds the target while a prompt may go whole now and then,
  as a split's decode server lets it, instead of cut to crumbs beside decodes that nearly fill
  the target; ``tpot_slack_iterations = 0`` caps every iteration at the target;
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

from typing import Protocol, runtime_checkable

from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind
from orthrus_sim.engine.request import Request
from orthrus_sim.engine.slack import DecodeSlack

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
    limit (the target, or with ``slack`` the paced target plus the running decodes' least
    slack)."""

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
        # the running decodes' slack (``slack.py``); none without it: every iteration capped
        self.slack = DecodeSlack(target_s, slack_iterations, credit) if slack_iterations else None

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
        slack = self.slack
        limit = target if slack is None else slack.limit_s()
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
