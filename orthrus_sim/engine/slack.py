"""Slack: what the iterations since each running decode began left of the TPOT target.

TPOT is a decode's time per token over its whole output, so a target on it holds where every
decode's iterations *average* within it: an iteration may go over the target by what earlier
ones left for every decode running. ``DecodeSlack`` keeps that account for one replica
(``IterationTarget`` asks it for the next iteration's limit, ``Policy.complete`` reports what
each iteration took):

* two *ledgers* sum, over every iteration, a target where the iteration carried decodes (each
  one token on) less the time since the previous iteration ended (so what the executor does
  between iterations counts too, and an iteration without decodes only takes): one counts the
  target, one the *paced* target (the target less ``tpot_credit`` of it);
* a decode begins with a *credit* it may take ahead, ``tpot_credit`` of the target per decode
  it expects, at most ``tpot_slack_iterations`` targets, and repays it on the paced ledger:
  for as many decode iterations as the credit took to earn, then on the full one. Its slack
  is its ledger now less the ledger when it began (its mark) plus what is left of the credit;
* ``limit_s``: the least of each running decode's reference (the paced target while it
  repays, the target after) plus its slack, within ``tpot_slack_iterations`` targets of the
  target either way: under the target where a decode is in debt (steps that took longer than
  predicted, a progress chunk), until the iterations repay it. A decode's debt is forgiven
  past that floor, so what one stretch of overruns costs the next ones is bounded. Max-heaps
  of the marks find the least; a decode that left (finished, preempted, aborted) is dropped
  when it surfaces.

Over the iterations a decode runs in, its time over the target is at most the credit it took,
so its TPOT ends within the target where the iterations after it left room to repay; it ends
over by at most its credit where the decodes alone take more than the paced target, or it
stops before its expected length, and the exceptions the policy cannot help aside
(docs/scheduler.md, "Slack"). Times are the executor's clock (the ``now`` handed to
``schedule`` and ``complete``): the core reads none.
"""

from __future__ import annotations

import heapq
import math

from orthrus_sim.engine.request import Request, RequestState

Mark = tuple[float, int, Request]  # (-mark, ticket, decode): a max-heap of marks


class DecodeSlack:
    """The slack account of one replica's decodes (module docstring)."""

    def __init__(self, target_s: float, cap_iterations: int, credit: float) -> None:
        self.target_s = target_s
        self.cap_s = cap_iterations * target_s
        self.credit = credit
        self.paced_s = target_s * (1.0 - credit)
        self.ledger_s = 0.0  # counting the target per decode-carrying iteration
        self.paced_ledger_s = 0.0  # counting the paced target
        self.decode_iterations = 0
        self.ended_at: float | None = None  # when the last iteration ended
        self._repaying: list[Mark] = []  # decodes repaying their credit (paced ledger)
        self._repaid: list[Mark] = []  # the others (full ledger)
        self._due: list[tuple[int, int, Request]] = []  # (decode iteration, ticket, decode)
        self._repaying_marks: dict[int, float] = {}  # ticket -> mark, while it repays
        self._tickets = 0
        self._compact_at = 64

    def began(self, request: Request) -> None:
        """``request`` decodes from now (its prompt, or its recompute, is done and its first
        token counted): marked with its credit, on the paced ledger until it has repaid it."""
        left = (request.expected_output_tokens or 0) - request.num_generated
        per_iteration = self.credit * self.target_s
        credit = min(per_iteration * left, self.cap_s) if left > 0 and per_iteration else 0.0
        if credit:
            ticket = self._mark(self._repaying, request, self.paced_ledger_s - credit)
            due = self.decode_iterations + math.ceil(credit / per_iteration - 1e-9)
            heapq.heappush(self._due, (due, ticket, request))
        else:
            self._mark(self._repaid, request, self.ledger_s)
        if len(self._repaying) + len(self._repaid) + len(self._due) > self._compact_at:
            self._compact()

    def spent(self, started: float, ended: float, decodes: bool) -> None:
        """An iteration scheduled at ``started`` ended at ``ended``; ``decodes``: it carried
        decodes. Counted from the previous iteration's end where there was one (the time
        between iterations is the decodes' too)."""
        last = self.ended_at
        elapsed = ended - (last if last is not None else started)
        self.ended_at = ended
        if not decodes:
            self.ledger_s -= elapsed
            self.paced_ledger_s -= elapsed
            return
        self.ledger_s += self.target_s - elapsed
        self.paced_ledger_s += self.paced_s - elapsed
        self.decode_iterations += 1
        due = self._due
        while due and due[0][0] <= self.decode_iterations:  # credit repaid: full ledger now
            _, ticket, request = heapq.heappop(due)
            mark = self._repaying_marks.pop(ticket, None)
            if mark is not None and request.slack_ticket == ticket \
                    and request.state is RequestState.RUNNING:
                slack = self.paced_ledger_s - mark
                self._mark(self._repaid, request, self.ledger_s - slack)

    def limit_s(self) -> float:
        """How long the next decode-carrying iteration may take: the least of each running
        decode's reference plus its slack, within the cap of the target either way."""
        target, cap = self.target_s, self.cap_s
        limit = target + cap
        for marks, ledger, reference in ((self._repaying, self.paced_ledger_s, self.paced_s),
                                         (self._repaid, self.ledger_s, target)):
            while marks and not _live(marks[0]):
                heapq.heappop(marks)
            if not marks:
                continue
            slack = ledger + marks[0][0]
            if slack < -cap:  # forgive the debt past the floor (module docstring)
                _, ticket, request = heapq.heappop(marks)
                self._mark(marks, request, ledger + cap, ticket)
                slack = -cap
            limit = min(limit, reference + slack)
        return limit if limit > target - cap else target - cap

    def _mark(self, marks: list[Mark], request: Request, mark: float,
              ticket: int | None = None) -> int:
        """Put ``request`` on ``marks`` with ``mark`` (a new ticket unless given)."""
        if ticket is None:
            self._tickets += 1
            ticket = request.slack_ticket = self._tickets
        heapq.heappush(marks, (-mark, ticket, request))
        if marks is self._repaying:
            self._repaying_marks[ticket] = mark
        return ticket

    def _compact(self) -> None:
        """Drop the marks of decodes gone (amortised: at twice the live count)."""
        self._repaying = [m for m in self._repaying if _live(m)]
        self._repaid = [m for m in self._repaid if _live(m)]
        heapq.heapify(self._repaying)
        heapq.heapify(self._repaid)
        self._due = [d for d in self._due if d[2].slack_ticket == d[1]
                     and d[2].state is RequestState.RUNNING]
        heapq.heapify(self._due)
        live = {m[1] for m in self._repaying}
        self._repaying_marks = {t: v for t, v in self._repaying_marks.items() if t in live}
        self._compact_at = max(64, 2 * (len(self._repaying) + len(self._repaid) + len(self._due)))


def _live(mark: Mark) -> bool:
    """Whether a mark's decode still runs as it was when marked."""
    request = mark[2]
    return request.slack_ticket == mark[1] and request.state is RequestState.RUNNING
