"""Runs of identical decode iterations, advanced at once: the simulator's fast path
(``sim/replica.py`` is its only user; real executors step every iteration).

A run is exact, i.e. gives what stepping one iteration at a time gives, when nothing the
policy's ``fill`` looks at changes during it. Queues and the KV cache change only at arrivals
(the caller cuts the run at the first iteration boundary after one) and at finishes (a phase
ends there). The clock changes every step: a policy whose choice depends on it (``clock_free =
False``, as Unified-Homo, which picks the side that waited longest) gets a run only while
nothing waits, when its ``fill`` has nothing to choose between.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orthrus_sim.engine.batch import BatchUnit, ItemKind
from orthrus_sim.engine.request import Request, RequestState

if TYPE_CHECKING:
    from orthrus_sim.engine.policy import Policy


def steady_decode_phases(policy: Policy, batch: BatchUnit) -> list[tuple[int, list[Request]]]:
    """The phases of a run of decode iterations starting with ``batch``: for each, the step
    count at which it ends (counted from the run's start) and the requests that finish then;
    [] when there is no run.

    A run exists only when ``batch`` holds every request holding blocks and each is a decode,
    and no budget claim is pending. Within a phase the same decodes run, each one token further
    a step; a phase ends where some requests finish. If requests wait, ``fill`` admitted none
    of them: what kept them out (KV blocks, which decodes only take; the sequence cap; a budget
    the decodes fill) stays while the decodes run but not past a finish, so the run is one
    phase (and there is none for a policy that is not ``clock_free``). If nothing waits, it
    goes on through the finishes (a finish changes nothing else), to the last request's last
    token. Either way the KV cache must hold every step's growth (else the run is cut short,
    and its one phase ends with nobody finishing). Arrivals are the caller's business: it must
    cut the run at the first iteration boundary after one.
    """
    if not policy.decode_runs or policy._budget_claim is not None:
        return []
    running = policy._running
    if len(batch.items) != len(running) or len(policy._holding) != len(running):
        return []
    if not batch.items or batch.items[0].kind is not ItemKind.DECODE:
        return []
    nothing_waits = len(policy._requests) == len(running)
    if not (nothing_waits or policy.clock_free):
        return []
    if policy.target is not None and policy._embeddings and not nothing_waits:
        # an embedding refused for the target rides after PROGRESS_AFTER iterations, or once
        # the decodes alone grow past it (iteration_target.py): it may not stay out for the run
        return []
    remaining = [r.max_output_tokens - r.num_generated for r in running]
    first = min(remaining)
    if first < 1:
        return []
    last = max(remaining) if nothing_waits else first
    blocks = policy.blocks
    bs = blocks.block_size
    free = blocks.num_free
    if len(running) * -(-(last - 1) // bs) <= free:
        # each decode holds its next token's block: k - 1 more need at most this many
        ends: dict[int, list[Request]] = {}
        for r, n in zip(running, remaining):
            if n <= last:
                ends.setdefault(n, []).append(r)
        return sorted(ends.items())
    tables = blocks.tables
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


def complete_decode_run(policy: Policy, batch: BatchUnit, steps: int, now: float,
                        finishing: list[Request] | None = None) -> list[Request]:
    """Apply the first ``steps`` iterations of a decode run starting with ``batch`` at once;
    ``now`` is the end of the last one.

    With ``finishing`` (the requests a phase of ``steady_decode_phases`` ends with), only
    those are brought forward, and they finish; the others are applied once, when the run
    ends, by a call without it, which skips requests that finished already.
    """
    left: list[Request] = []
    if finishing is None:
        policy.iterations += steps
    bs = policy.blocks.block_size
    tables = policy.blocks.tables
    running = RequestState.RUNNING
    grow = policy.blocks.grow
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
            policy._finish(req, now)
            left.append(req)
    return left
