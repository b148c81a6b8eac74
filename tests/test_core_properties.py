"""Property tests of the scheduling core over random workloads and knobs."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orthrus_sim.engine import (
    POLICIES,
    Credits,
    ItemKind,
    RequestState,
    SchedulerConfig,
    make_policy,
    pool,
)
from tests.helpers import drive, make_requests

MIXED = ["orthrus", "unified-hetero", "unified-homo", "prefill-only"]
SINGLE = {"embedding-only": "embedding", "generation": "generation", "decode-only": "generation"}

request_spec = st.tuples(
    st.sampled_from(["embedding", "generation"]),
    st.integers(0, 20).map(float),
    st.integers(1, 300),
    st.integers(1, 40),
)

knobs = st.fixed_dictionaries({
    "token_budget": st.sampled_from([64, 256, 1024]),
    "chunk": st.sampled_from([16, 64, 1.0]),  # 1.0 -> chunk_size = token_budget
    "max_num_seqs": st.sampled_from([4, 64, 256]),
    "block_size": st.sampled_from([4, 16]),
    "num_blocks": st.sampled_from([40, 200, 4000]),
    "waiting_work": st.sampled_from(["prompt", "prompt+output"]),
    "max_num_embeds": st.sampled_from([None, 1, 3]),
})


def config_from(k: dict) -> SchedulerConfig:
    chunk = k["token_budget"] if k["chunk"] == 1.0 else min(k["chunk"], k["token_budget"])
    return SchedulerConfig(token_budget=k["token_budget"], chunk_size=chunk,
                           max_num_seqs=k["max_num_seqs"], block_size=k["block_size"],
                           num_blocks=k["num_blocks"], waiting_work=k["waiting_work"],
                           max_num_embeds=k["max_num_embeds"])


def invariant_checker(scheduled_tokens: dict[str, int], first_seen: list):
    def check(policy, batch, now):
        cfg = policy.config
        assert batch.total_tokens <= cfg.token_budget
        assert sum(1 for it in batch.items if not it.request.is_embedding) <= cfg.max_num_seqs
        assert len(policy.running) <= cfg.max_num_seqs
        if cfg.max_num_embeds is not None:  # the vLLM backend's request slots
            assert sum(r.is_embedding for r in policy.holding.values()) <= cfg.max_num_embeds
        kinds = [it.kind for it in batch.items]
        assert kinds == sorted(kinds), "items not sorted by type"
        ids = [it.request.request_id for it in batch.items]
        assert len(ids) == len(set(ids)), "a request appears twice in one batch"
        for it in batch.items:
            assert it.num_tokens >= 1
            if it.kind is ItemKind.EMBED_CHUNK:
                assert it.num_tokens <= cfg.chunk_size
            if it.kind is ItemKind.DECODE:
                assert it.num_tokens == 1
            assert it.request.state is RequestState.RUNNING
            # the KV cache holds every token the item writes
            assert policy.blocks.held(it.request.request_id) * cfg.block_size >= it.end
            scheduled_tokens[it.request.request_id] = (
                scheduled_tokens.get(it.request.request_id, 0) + it.num_tokens)
            if it.request.request_id not in {r.request_id for r in first_seen}:
                first_seen.append(it.request)
        # KV accounting: blocks held add up, never exceed the pool, only live holders
        held = sum(len(t) for t in policy.blocks.tables.values())
        assert held == policy.blocks.num_used <= cfg.num_blocks
        assert set(policy.blocks.tables) <= set(policy.holding)
        # each kind's slice is contiguous and covers exactly its items
        for kind in ItemKind:
            assert all(it.kind is kind for it in batch.items[batch.item_slice(kind)])
            assert batch.tokens_of(kind) == (batch.token_slice(kind).stop
                                             - batch.token_slice(kind).start)
    return check


def check_conservation(policy, reqs, scheduled_tokens):
    assert policy.blocks.num_used == 0, "KV blocks leaked"
    assert not policy.holding and not policy.requests
    for r in reqs:
        if r.state is RequestState.REJECTED:
            assert r.reject_reason
            continue
        assert r.state is RequestState.FINISHED, (r.request_id, r.state)
        if r.is_embedding:
            assert r.num_computed == r.input_len
        else:
            assert r.num_generated == r.max_output_tokens
            assert r.num_computed == r.input_len + r.max_output_tokens - 1
        if r.num_preemptions == 0:
            assert scheduled_tokens.get(r.request_id, 0) == r.num_computed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy_name=st.sampled_from(MIXED), specs=st.lists(request_spec, min_size=1, max_size=40),
       k=knobs)
def test_mixed_policies_keep_invariants(policy_name, specs, k):
    policy = make_policy(policy_name, config_from(k))
    reqs = make_requests(specs)
    scheduled, first_seen = {}, []
    drive(policy, reqs, invariant_checker(scheduled, first_seen))
    if policy_name == "prefill-only":
        # generation requests leave after their first token: the hand-off point
        for r in reqs:
            if r.kind.value == "generation" and r.state is not RequestState.REJECTED:
                assert r.num_generated >= 1 and r.first_token_at is not None
        return
    check_conservation(policy, reqs, scheduled)
    # FCFS inside each type: first admission order equals arrival order
    for kind in ("embedding", "generation"):
        order = [r for r in first_seen if r.kind.value == kind]
        assert [r.arrival_time for r in order] == sorted(r.arrival_time for r in order)
        by_id = [int(r.request_id[1:]) for r in order]
        same_time_ok = all(
            a < b or order[i].arrival_time < order[i + 1].arrival_time
            for i, (a, b) in enumerate(zip(by_id, by_id[1:])))
        assert same_time_ok


@settings(max_examples=30, deadline=None)
@given(policy_name=st.sampled_from(sorted(SINGLE)),
       specs=st.lists(request_spec, min_size=1, max_size=30), k=knobs)
def test_single_type_policies(policy_name, specs, k):
    policy = make_policy(policy_name, config_from(k))
    kind = SINGLE[policy_name]
    specs = [(kind, *rest) for _, *rest in specs]
    reqs = make_requests(specs)
    scheduled, first_seen = {}, []
    drive(policy, reqs, invariant_checker(scheduled, first_seen))
    check_conservation(policy, reqs, scheduled)


@settings(max_examples=40, deadline=None)
@given(policy_name=st.sampled_from(["orthrus", "unified-hetero", "generation"]),
       specs=st.lists(request_spec, min_size=2, max_size=40))
def test_running_decodes_come_before_new_work(policy_name, specs):
    if policy_name == "generation":
        specs = [("generation", *rest) for _, *rest in specs]
    policy = make_policy(policy_name, SchedulerConfig(token_budget=512, chunk_size=64,
                                                      num_blocks=100_000))
    decoding_before: list = []

    def check(pol, batch, now):
        in_batch = {it.request.request_id for it in batch.items}
        for rid in decoding_before:
            assert rid in in_batch, "a running decode was left out for new work"
        decoding_before.clear()

    def step_hook(pol, batch, now):
        check(pol, batch, now)
        # after this batch completes, every running generation request that is decoding
        for it in batch.items:
            r = it.request
            will_decode = (it.kind is not ItemKind.EMBED_CHUNK and it.end == r.seq_len
                           and r.num_generated + 1 < r.max_output_tokens)
            if will_decode:
                decoding_before.append(r.request_id)
        # requests still mid-prefill also continue
    drive(policy, make_requests(specs), step_hook)


@settings(max_examples=200, deadline=None)
@given(we=st.integers(1, 10_000), wg=st.integers(1, 10_000), n=st.integers(1, 400))
def test_credits_stay_within_one_opportunity_of_ideal_share(we, wg, n):
    credits = Credits()
    picks_e = 0
    for i in range(1, n + 1):
        if credits.pick(we, wg, True, True) == "e":
            picks_e += 1
        ideal = i * we / (we + wg)
        assert abs(picks_e - ideal) <= 1.0 + 1e-9


@settings(max_examples=25, deadline=None)
@given(n_embed=st.integers(200, 600), n_gen=st.integers(200, 600), size=st.sampled_from([64, 128]))
def test_ibs_token_ratio_follows_remaining_work(n_embed, n_gen, size):
    """Fixed backlog of equal-size items: the scheduled e:g ratio tracks we:wg."""
    policy = make_policy("orthrus", SchedulerConfig(token_budget=2048, chunk_size=size,
                                                    num_blocks=1_000_000, max_num_seqs=100_000))
    specs = ([("embedding", 0.0, size, 0)] * n_embed) + ([("generation", 0.0, size, 1)] * n_gen)
    for r in make_requests(specs):
        policy.add(r)
    we, wg = policy.waiting_work()
    tokens = {"e": 0, "g": 0}
    for _ in range(5):
        batch = policy.schedule(0.0)
        tokens["e"] += batch.tokens_of(ItemKind.EMBED_CHUNK)
        tokens["g"] += batch.tokens_of(ItemKind.PREFILL_CHUNK)
        policy.complete(batch, 1.0)
    share = tokens["e"] / (tokens["e"] + tokens["g"])
    assert abs(share - we / (we + wg)) <= 0.05


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(request_spec, min_size=2, max_size=60),
       budget=st.sampled_from([1024, 2048, 4096]))
def test_orthrus_starves_neither_type(specs, budget):
    """With both queues non-empty and memory to spare, neither side waits unboundedly."""
    chunk = 256
    specs = [(kind, t, min(n, 256), o) for kind, t, n, o in specs]
    policy = make_policy("orthrus", SchedulerConfig(token_budget=budget, chunk_size=chunk,
                                                    num_blocks=1_000_000, max_num_seqs=100_000))
    streak = {"e": 0, "g": 0}
    bound = {"e": 0, "g": 0}

    def check(pol, batch, now):
        e_wait = any(r.request_id not in pol.holding for r in pol.embed_queue) or bool(
            pol.embed_queue)
        g_wait = bool(pol.gen_queue)
        if not (e_wait and g_wait):
            streak.update(e=0, g=0)
            return
        we, wg = pol.waiting_work()
        per_iter = max(1, budget // 256 - 1)
        got = {"e": batch.tokens_of(ItemKind.EMBED_CHUNK) > 0,
               "g": any(it.request.admitted_at == now for it in batch.items
                        if not it.request.is_embedding)}
        for side, w in (("e", we), ("g", wg)):
            if got[side]:
                streak[side] = 0
                continue
            if streak[side] == 0:
                bound[side] = 2 + math.ceil((we + wg) / max(w, 1) / per_iter)
            streak[side] += 1
            assert streak[side] <= bound[side], f"{side} starved for {streak[side]} iterations"

    drive(policy, make_requests(specs), check)


@settings(max_examples=100, deadline=None)
@given(length=st.integers(1, 300), chunk=st.integers(1, 128), dim=st.integers(1, 16),
       head=st.sampled_from(["mean", "weighted-mean", "cls", "last", "buffer"]),
       normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_chunked_pooling_equals_single_pass(length, chunk, dim, head, normalize, seed):
    h = np.random.default_rng(seed).standard_normal((length, dim))
    fn = (lambda m: m.max(0)) if head == "buffer" else None
    single = pool(h, head, normalize, fn)
    chunked = pool(h, head, normalize, fn, chunk_size=chunk)
    np.testing.assert_allclose(chunked, single, rtol=1e-10, atol=1e-12)
    if head == "weighted-mean":
        w = np.arange(1, length + 1)[:, None]
        expected = (h * w).sum(0) / (length * (length + 1) / 2)
        if normalize:
            expected = expected / np.linalg.norm(expected)
        np.testing.assert_allclose(chunked, expected, rtol=1e-10, atol=1e-12)


def test_all_policies_registered():
    assert set(POLICIES) >= {"orthrus", "unified-hetero", "unified-homo", "embedding-only",
                             "generation", "prefill-only", "decode-only"}
