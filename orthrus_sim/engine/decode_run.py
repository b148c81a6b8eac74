"""Runs of identical decode iterations, advanced at once: the simulator's fast path
(``sim/replica.py`` is its only user; real executors step every iteration).

A run is a batch that is the decode cohort alone (``engine/cohort.py``) and the iterations
that follow it unchanged. It is exact, i.e. gives what stepping one iteration at a time gives,
when nothing the policy's ``fill`` looks at changes during it. Queues and the KV cache change
only at arrivals (the caller cuts the run at the first iteration boundary after one) and at
finishes (the run ends there, and ``fill`` runs again). The clock changes every step: a policy
whose choice depends on it (``clock_free = False``, as Unified-Homo, which picks the side that
waited longest) gets a run only while nothing waits, when its ``fill`` has nothing to choose
between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from orthrus_sim.engine.batch import BatchUnit
from orthrus_sim.engine.request import Request

if TYPE_CHECKING:
    from orthrus_sim.engine.policy import Policy


def decode_run_length(policy: Policy, batch: BatchUnit) -> int:
    """How many iterations starting with ``batch`` are the same cohort decodes, each one token
    further: up to and including the one where the next member finishes, as far as the KV
    cache holds every step's growth; 0 when ``batch`` starts no run.

    A run needs ``batch`` to be the cohort alone, holding every request that holds blocks, and
    no budget claim pending. If requests wait, ``fill`` admitted none of them: what kept them
    out (KV blocks, which decodes only take; the sequence cap; a budget the decodes fill)
    stays while the decodes run but not past a finish, where the run ends. A policy that is
    not ``clock_free`` gets none while anything waits. Arrivals are the caller's business: it
    must cut the run at the first iteration boundary after one.
    """
    cohort = policy._cohort
    if (cohort is None or not policy.decode_runs or policy._budget_claim is not None
            or batch.items or not batch.cohort_decodes):
        return 0
    members = len(cohort.members)
    if len(policy._holding) != members:
        return 0
    nothing_waits = len(policy._requests) == members
    if not (nothing_waits or policy.clock_free):
        return 0
    target = policy.target
    if target is not None and not nothing_waits and (target.slack is not None
                                                    or policy._embeddings):
        # an embedding refused for the target rides after PROGRESS_AFTER iterations, or once
        # the decodes alone grow past it, and with slack any chunk may go as the decodes save
        # (iteration_target.py, slack.py): what waits may not stay out for the run
        return 0
    return cohort.steps_fitting(cohort.next_finish() - cohort.steps)


def run_on(policy: Policy) -> int:
    """After members finished at a run's end: how many more iterations the run may go on
    for, ``fill`` skipped (0: it ends, and the executor schedules again).

    Only while nothing else is here: the batch stepping would schedule next is then the cohort
    alone again (one token further, without those that left), if its decodes fit the budget
    and their next tokens' blocks fit; the blocks of that iteration are taken here, as
    scheduling it would. A ``fill`` run with the same queues already decided the run's first
    batch, so whatever it does besides scheduling (IBS resets the credits of empty queues) is
    done; after any other iteration the executor calls ``fill`` again."""
    cohort = policy._cohort
    members = len(cohort.members)
    if (not members or len(policy._requests) != members or len(policy._holding) != members
            or policy._budget_claim is not None or members > policy.config.token_budget
            or not cohort.take_blocks(cohort.steps)):
        return 0
    return cohort.steps_fitting(cohort.next_finish() - cohort.steps)


def complete_decode_run(policy: Policy, now: float, start: float,
                        ends: Sequence[float]) -> list[Request]:
    """Apply at once the iterations of a run that began at ``start`` and ended at ``ends``
    (``now``: the last end); returns the members that finish then (only at the run's last
    step)."""
    steps = len(ends)
    slack = policy.target.slack if policy.target is not None else None
    if slack is not None:
        for end in ends:
            slack.spent(start, end, True)
            start = end
    cohort = policy._cohort
    cohort.set_blocks(cohort.steps + steps - 1)  # the last step scheduled grew these
    policy.iterations += steps
    left: list[Request] = []
    policy._advance_cohort(steps, now, left)
    return left
