"""Slack: what the iterations since each running decode began left of the TPOT target.

TPOT is a decode's time per token over its whole output, so a target on it holds where every
decode's iterations *average* within it: an iteration may go over the target by what earlier
ones left for every decode running. ``DecodeSlack`` keeps that account for one replica
(``IterationTarget`` asks it how far the next iteration may go over, ``Policy.complete``
reports what each iteration took):

* a *ledger* sums, over every iteration, the paced target where the iteration carried decodes
  (each one token on) less the time since the previous iteration ended (so what the executor
  does between iterations counts too, and an iteration without decodes only takes);
* a decode's slack is the ledger now less the ledger when it began decoding, plus a *credit*
  it may take ahead (``tpot_credit`` of the target per decode it expects, at most
  ``tpot_slack_iterations`` targets in all) and repays over its output: the *paced* target
  each iteration counts is the target less that share;
* ``room_s``: the least slack of the running decodes, within minus and plus
  ``tpot_slack_iterations`` targets: below zero (iterations took more than the paced target
  allowed: a predictor that under-predicts, a progress chunk) the limit drops under the paced
  target until the decodes are repaid. A max-heap of the decodes' marks finds it; a decode
  that left (finished, preempted, aborted) is dropped when it surfaces.

Over the iterations a decode runs in, its time over the target is at most the credit it took,
so its TPOT ends within the target where the iterations after it left room to repay (it is
over by at most ``tpot_credit`` where the decodes alone take between the paced target and the
target; by its unrepaid credit where it stops before its expected length), the exceptions
aside that the policy cannot help (docs/scheduler.md, "Slack"). Times are the executor's clock
(the ``now`` handed to ``schedule`` and ``complete``): the core reads none.
"""

from __future__ import annotations

import heapq

from orthrus_sim.engine.request import Request, RequestState


class DecodeSlack:
    """The slack account of one replica's decodes (module docstring)."""

    def __init__(self, target_s: float, cap_iterations: int, credit: float) -> None:
        self.target_s = target_s
        self.cap_s = cap_iterations * target_s
        self.credit = credit
        self.paced_s = target_s * (1.0 - credit)  # what a decode-carrying iteration counts
        self.ledger_s = 0.0
        self.ended_at: float | None = None  # when the last iteration ended
        self._marks: list[tuple[float, int, Request]] = []  # (-mark, ticket, decode): max-heap
        self._tickets = 0
        self._compact_at = 64

    def began(self, request: Request) -> None:
        """``request`` decodes from now (its prompt, or its recompute, is done and its first
        token counted): its mark is the ledger now, less the credit it may take ahead."""
        self._tickets += 1
        request.slack_ticket = self._tickets
        left = (request.expected_output_tokens or 0) - request.num_generated
        credit = min(self.credit * self.target_s * left, self.cap_s) if left > 0 else 0.0
        heapq.heappush(self._marks, (credit - self.ledger_s, self._tickets, request))
        if len(self._marks) > self._compact_at:  # drop the marks of decodes gone
            self._marks = [m for m in self._marks if _live(m)]
            heapq.heapify(self._marks)
            self._compact_at = max(64, 2 * len(self._marks))

    def spent(self, started: float, ended: float, decodes: bool) -> None:
        """An iteration scheduled at ``started`` ended at ``ended``; ``decodes``: it carried
        decodes. Counted from the previous iteration's end where that is earlier."""
        last = self.ended_at
        begun = last if last is not None and last < started else started
        self.ledger_s += (self.paced_s if decodes else 0.0) - (ended - begun)
        self.ended_at = ended

    def room_s(self) -> float:
        """How far the next decode-carrying iteration may go over the paced target (under it,
        where negative): the least slack of the decodes running, within minus and plus the
        cap."""
        marks = self._marks
        while marks:
            if _live(marks[0]):
                slack = self.ledger_s + marks[0][0]
                cap = self.cap_s
                return cap if slack > cap else (slack if slack > -cap else -cap)
            heapq.heappop(marks)
        return 0.0


def _live(mark: tuple[float, int, Request]) -> bool:
    """Whether a mark's decode still runs as it was when marked."""
    request = mark[2]
    return request.slack_ticket == mark[1] and request.state is RequestState.RUNNING
