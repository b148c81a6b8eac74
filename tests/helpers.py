"""Drive a policy through a workload, one iteration per time unit, checking invariants."""

from __future__ import annotations

from collections.abc import Callable

from orthrus_sim.engine import BatchUnit, Policy, Request, RequestKind


def make_requests(spec: list[tuple[str, float, int, int]]) -> list[Request]:
    """``(kind, arrival, input_len, max_output_tokens)`` tuples -> requests named by index."""
    out = []
    for i, (kind, arrival, n_in, n_out) in enumerate(spec):
        out.append(Request(f"r{i}", RequestKind(kind), arrival, n_in,
                           max_output_tokens=n_out if kind == "generation" else 0))
    return out


def drive(
    policy: Policy,
    requests: list[Request],
    check: Callable[[Policy, BatchUnit, float], None] | None = None,
    max_iterations: int = 200_000,
    aborts: dict[int, list[str]] | None = None,
) -> list[BatchUnit]:
    """Add requests at their arrival times and step until everything finished.

    ``aborts`` maps an iteration number to request ids aborted just before it is scheduled.
    """
    pending = sorted(requests, key=lambda r: r.arrival_time)
    batches: list[BatchUnit] = []
    now = 0.0
    i = 0
    aborts = aborts or {}
    while i < len(pending) or policy.has_work:
        while i < len(pending) and pending[i].arrival_time <= now:
            policy.add(pending[i], now)
            i += 1
        for rid in aborts.get(len(batches), ()):
            policy.abort(rid, now)
        batch = policy.schedule(now)
        if check is not None:
            check(policy, batch, now)
        if not batch:
            if policy.has_work:
                raise AssertionError(f"policy {policy.name} stalled with work queued at t={now}")
            now = pending[i].arrival_time if i < len(pending) else now + 1
            continue
        batches.append(batch)
        now += 1.0
        policy.complete(batch, now)
        if len(batches) > max_iterations:
            raise AssertionError(f"more than {max_iterations} iterations")
    return batches
