"""The decode cohort (orthrus_sim/engine/cohort.py) changes how often each decode is touched,
never what happens: a policy with it and one without, fed the same requests, schedule the same
work and end every request the same way, iteration by iteration (hypothesis over random
workloads, small KV caches so that preemption and settling happen)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from orthrus_sim.engine.batch import ItemKind
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.registry import make_policy
from orthrus_sim.engine.request import Request, RequestKind, RequestState

POLICIES = ["generation", "unified-hetero", "unified-homo", "ibs"]


def _requests(spec, policy_name):
    out = []
    for i, (step, embedding, n_in, n_out) in enumerate(spec):
        if embedding and policy_name != "generation":
            out.append((step, Request(f"e{i}", RequestKind.EMBEDDING, float(step), n_in)))
        else:
            out.append((step, Request(f"g{i}", RequestKind.GENERATION, float(step), n_in,
                                      max_output_tokens=n_out)))
    return out


def _work(batch):
    """What a batch computes: its totals and its items other than the cohort's."""
    return (batch.total_tokens, batch.num_decodes, batch.num_seqs,
            sorted((it.request.request_id, it.kind, it.start, it.num_tokens)
                   for it in batch.items if it.kind is not ItemKind.DECODE),
            sorted(it.request.request_id for it in batch.items if it.kind is ItemKind.DECODE)
            if not batch.cohort_decodes else None)


def _state(policy, requests):
    policy.live()  # a view: the cohort's members are brought up to date
    return ([(r.request_id, r.state, r.num_computed, r.num_generated, r.ready_since,
              r.first_token_at, r.finished_at, r.num_preemptions) for r in requests],
            policy.blocks.num_free, policy.blocks.num_used, policy.iterations,
            dict(policy.preemptions))


@settings(max_examples=60, deadline=None)
@given(
    policy_name=st.sampled_from(POLICIES),
    num_blocks=st.integers(min_value=6, max_value=40),
    token_budget=st.sampled_from([16, 48, 256]),
    spec=st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.integers(1, 70),
                            st.integers(1, 40)), min_size=1, max_size=14),
)
def test_cohort_schedules_and_ends_every_request_as_stepping_does(policy_name, num_blocks,
                                                                  token_budget, spec):
    cfg = SchedulerConfig(token_budget=token_budget, chunk_size=16, block_size=4,
                          num_blocks=num_blocks, max_num_seqs=6)
    plain, fast = make_policy(policy_name, cfg), make_policy(policy_name, cfg)
    fast.use_cohort()
    a, b = _requests(spec, policy_name), _requests(spec, policy_name)
    cohort_used = False
    for step in range(400):
        for (at, ra), (_, rb) in zip(a, b):
            if at == step:
                assert plain.add(ra, float(step)) == fast.add(rb, float(step))
        ba, bb = plain.schedule(float(step)), fast.schedule(float(step))
        wa, wb = _work(ba), _work(bb)
        cohort_used |= bb.cohort_decodes > 0
        assert wa[:4] == wb[:4]
        if wb[4] is not None:
            assert wa[4] == wb[4]
        left_a = [r.request_id for r in plain.complete(ba, step + 0.5)]
        left_b = [r.request_id for r in fast.complete(bb, step + 0.5)]
        assert left_a == left_b
        assert _state(plain, [r for _, r in a]) == _state(fast, [r for _, r in b])
        if all(r.state.is_final for _, r in a) and step > 30:
            break
    assert all(r.state in (RequestState.FINISHED, RequestState.REJECTED) for _, r in b)
    if any(r.max_output_tokens > 2 and r.state is RequestState.FINISHED for _, r in b):
        assert cohort_used


def _members_ready_key(cohort):
    """What ``DecodeCohort.ready_key`` must give, found the slow way: each member's
    ``(ready_since, order)`` as ``sync`` would write it, without writing it."""
    keys = [(cohort.last_end if cohort.steps > m.joined else m.request.ready_since,
             m.request.order) for m in cohort.members.values()]
    return min(keys, default=None)


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(min_value=6, max_value=40),
    token_budget=st.sampled_from([16, 48, 256]),
    spec=st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.integers(1, 70),
                            st.integers(1, 40)), min_size=1, max_size=14),
)
def test_unified_homo_picks_its_side_from_the_cohort_as_stepping_does(num_blocks, token_budget,
                                                                      spec):
    """Unified-Homo reads the running decodes' ready times from the cohort (``ready_key``)
    instead of writing them into the requests: with no view read between iterations (nothing
    syncs the members), it schedules what stepping schedules, and ``ready_key`` is always the
    members' least key."""
    cfg = SchedulerConfig(token_budget=token_budget, chunk_size=16, block_size=4,
                          num_blocks=num_blocks, max_num_seqs=6)
    plain, fast = make_policy("unified-homo", cfg), make_policy("unified-homo", cfg)
    fast.use_cohort()
    a, b = _requests(spec, "unified-homo"), _requests(spec, "unified-homo")
    for step in range(400):
        for (at, ra), (_, rb) in zip(a, b):
            if at == step:
                assert plain.add(ra, float(step)) == fast.add(rb, float(step))
        assert fast._cohort.ready_key() == _members_ready_key(fast._cohort)
        ba, bb = plain.schedule(float(step)), fast.schedule(float(step))
        wa, wb = _work(ba), _work(bb)
        assert wa[:4] == wb[:4]
        left_a = [r.request_id for r in plain.complete(ba, step + 0.5)]
        left_b = [r.request_id for r in fast.complete(bb, step + 0.5)]
        assert left_a == left_b
        if all(r.state.is_final for _, r in a) and step > 30:
            break
    assert _state(plain, [r for _, r in a]) == _state(fast, [r for _, r in b])


def test_abort_of_a_member_frees_its_blocks_as_without_the_cohort():
    cfg = SchedulerConfig(token_budget=64, chunk_size=16, block_size=4, num_blocks=32)
    plain, fast = make_policy("generation", cfg), make_policy("generation", cfg)
    fast.use_cohort()
    for policy in (plain, fast):
        for i in range(3):
            policy.add(Request(f"g{i}", RequestKind.GENERATION, 0.0, 10, max_output_tokens=50))
        for t in range(7):
            policy.complete(policy.schedule(float(t)), t + 0.5)
    assert len(fast._cohort) == 3
    aborted = [p.abort("g1", 8.0) for p in (plain, fast)]
    assert [(r.num_computed, r.num_generated, r.state) for r in aborted] == [
        (aborted[0].num_computed, aborted[0].num_generated, RequestState.ABORTED)] * 2
    assert plain.blocks.num_free == fast.blocks.num_free
    assert len(fast._cohort) == 2 and fast.blocks.virtual >= 0
    for t in range(8, 60):
        left = [[r.request_id for r in p.complete(p.schedule(float(t)), t + 0.5)] for p in (plain, fast)]
        assert left[0] == left[1]
    assert plain.blocks.num_free == fast.blocks.num_free == 32


def test_use_cohort_after_requests_is_refused():
    policy = make_policy("generation", SchedulerConfig())
    policy.add(Request("g", RequestKind.GENERATION, 0.0, 4, max_output_tokens=2))
    import pytest

    with pytest.raises(RuntimeError, match="before any request"):
        policy.use_cohort()
