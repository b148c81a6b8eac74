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
    duration: Callable[[BatchUnit], float] | None = None,
) -> list[BatchUnit]:
    """Add requests at their arrival times and step until everything finished.

    ``aborts`` maps an iteration number to request ids aborted just before it is scheduled;
    ``duration`` says how long an iteration takes (1 s each without it).
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
        now += 1.0 if duration is None else duration(batch)
        policy.complete(batch, now)
        if len(batches) > max_iterations:
            raise AssertionError(f"more than {max_iterations} iterations")
    return batches


def slo_from_rows(rows: list[dict], slo: dict, start: float = 0.0) -> dict[str, tuple[int, int]]:
    """Per kind, ``(met, counted)`` recomputed from per-request rows of a run to completion
    (every fate known): a request counts when it arrived at or after ``start``; it meets the SLOs
    when it finished within every bound given for its kind (TPOT as vLLM: (e2e - ttft) /
    (outputs - 1), none for one output token)."""
    out = {}
    for kind in ("embedding", "generation"):
        met = counted = 0
        for r in rows:
            if r["kind"] != kind or r["arrival_s"] < start - 1e-9:
                continue
            counted += 1
            if r["state"] != "finished":
                continue
            e2e = r["finished_s"] - r["arrival_s"]
            if kind == "embedding":
                ok = e2e <= slo.get("latency_s", float("inf"))
            else:
                ttft = r["first_token_s"] - r["arrival_s"]
                n = r["output_tokens"]
                tpot = (e2e - ttft) / (n - 1) if n > 1 else 0.0
                ok = (ttft <= slo.get("ttft_s", float("inf")) and tpot <= slo.get("tpot_s", float("inf"))
                      and e2e <= slo.get("e2e_s", float("inf")))
            met += ok
        out[kind] = (met, counted)
    return out
