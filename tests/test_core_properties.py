"""Property tests of the scheduling core over random workloads and knobs."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orthrus_sim.engine import (
    POLICIES,
    Credits,
    ItemKind,
    Request,
    RequestKind,
    RequestState,
    SchedulerConfig,
    make_policy,
    pool,
)
from tests.helpers import drive, make_requests

MIXED = ["ibs", "unified-hetero", "unified-homo", "prefill-only"]
SINGLE = {"embedding-only": "embedding", "generation": "generation", "decode-only": "generation"}

request_spec = st.tuples(
    st.sampled_from(["embedding", "generation"]),
    st.integers(0, 20).map(float),
    st.integers(1, 300),
    st.integers(1, 40),
)

knobs = st.fixed_dictionaries({
    "token_budget": st.sampled_from([64, 256, 1024]),
    "chunk": st.sampled_from([16, 64, 1.0, None]),  # 1.0 -> the budget; None -> atomic
    "max_num_seqs": st.sampled_from([4, 64, 256]),
    "block_size": st.sampled_from([4, 16]),
    "num_blocks": st.sampled_from([40, 200, 4000]),
    "waiting_work": st.sampled_from(["prompt", "prompt+output"]),
    "max_num_embeds": st.sampled_from([None, 1, 3]),
    "embedding_kv": st.sampled_from(["read", "all"]),
})


def config_from(k: dict, **over) -> SchedulerConfig:
    chunk = k["chunk"]
    chunk = k["token_budget"] if chunk == 1.0 else (None if chunk is None else
                                                    min(chunk, k["token_budget"]))
    args = dict(token_budget=k["token_budget"], chunk_size=chunk, max_num_seqs=k["max_num_seqs"],
                block_size=k["block_size"], num_blocks=k["num_blocks"],
                waiting_work=k["waiting_work"], max_num_embeds=k["max_num_embeds"],
                embedding_kv=k.get("embedding_kv", "read"))
    args.update(over)
    return SchedulerConfig(**args)


def invariant_checker(scheduled_tokens: dict[str, int], first_seen: list):
    def check(policy, batch, now):
        cfg = policy.config
        assert batch.total_tokens <= cfg.token_budget
        running = policy.running_generations()
        assert len(running) <= cfg.max_num_seqs
        holding_embeds = [r for r in policy.embeddings() if policy.holds_kv(r.request_id)]
        if cfg.max_num_embeds is not None:  # the vLLM backend's request slots
            assert len(holding_embeds) <= cfg.max_num_embeds
        kinds = [it.kind for it in batch.items]
        assert kinds == sorted(kinds), "items not sorted by type"
        ids = [it.request.request_id for it in batch.items]
        assert len(ids) == len(set(ids)), "a request appears twice in one batch"
        for it in batch.items:
            assert it.num_tokens >= 1
            if it.kind is ItemKind.EMBED_CHUNK:
                assert it.num_tokens <= (cfg.chunk_size or cfg.token_budget)
                # while it is being chunked, an embedding holds blocks for every chunk but its
                # last (embedding_kv: read; its whole input with all): a one-chunk one none
                stored = (it.request.input_len if cfg.embedding_kv == "all" else
                          (it.request.input_len - 1) // (cfg.chunk_size or it.request.input_len)
                          * (cfg.chunk_size or it.request.input_len))
                assert policy.blocks.held(it.request.request_id) == policy.blocks.blocks_for(
                    stored)
                assert policy.writes_kv(it) == (cfg.embedding_kv == "all"
                                                or it.end < it.request.input_len)
            if it.kind is ItemKind.DECODE:
                assert it.num_tokens == 1
            assert it.request.state is RequestState.RUNNING
            # the KV cache holds every token the item writes, and the context it reads
            stores = it.end if policy.writes_kv(it) else it.start
            assert policy.blocks.held(it.request.request_id) * cfg.block_size >= stores
            scheduled_tokens[it.request.request_id] = (
                scheduled_tokens.get(it.request.request_id, 0) + it.num_tokens)
            if it.request.request_id not in {r.request_id for r in first_seen}:
                first_seen.append(it.request)
        # KV accounting: blocks held add up, never exceed the pool, only live holders
        held = sum(len(t) for t in policy.blocks.tables.values())
        assert held == policy.blocks.num_used <= cfg.num_blocks
        holders = {r.request_id for r in running} | {r.request_id for r in holding_embeds}
        assert set(policy.blocks.tables) <= holders
        assert all(policy.blocks.held(r.request_id) for r in running)
        # each kind's slice is contiguous and covers exactly its items
        for kind in ItemKind:
            assert all(it.kind is kind for it in batch.items[batch.item_slice(kind)])
            assert batch.tokens_of(kind) == (batch.token_slice(kind).stop
                                             - batch.token_slice(kind).start)
        # we and wg (kept as requests come and go) equal their definition over the queues
        co = cfg.count_waiting_output
        we = sum(r.num_uncomputed for r in policy.embeddings())
        wg = sum(r.waiting_work(co) for r in policy.waiting_generations())
        wg += sum(r.waiting_work(co) for r in policy.running_generations() if not r.is_decode)
        assert policy.waiting_work() == (we, wg)
        credits = policy.snapshot().credits
        if credits is not None:  # IBS credits stay within one budget (they used to grow forever)
            assert all(abs(v) <= cfg.token_budget for v in credits.values())
    return check


def check_conservation(policy, reqs, scheduled_tokens):
    assert policy.blocks.num_used == 0, "KV blocks leaked"
    assert not policy.has_work and policy.num_unfinished == 0
    for r in reqs:
        if r.state is RequestState.REJECTED:
            assert r.reject_reason
            continue
        assert r.state is RequestState.FINISHED, (r.request_id, r.state)
        if r.is_embedding:
            assert r.num_computed == r.input_len
            assert r.num_preemptions == 0  # embeddings are never preempted
        else:
            assert r.num_generated == r.max_output_tokens
            assert r.num_computed == r.input_len + r.max_output_tokens - 1
        if r.num_preemptions == 0:
            assert scheduled_tokens.get(r.request_id, 0) == r.num_computed


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy_name=st.sampled_from(["ibs", "unified-hetero", "unified-homo", "generation",
                                    "embedding-only"]),
       specs=st.lists(request_spec, min_size=1, max_size=25),
       block_size=st.sampled_from([4, 16]), chunk=st.sampled_from([16, 64, None]),
       budget=st.sampled_from([64, 256]))
def test_tightest_cache_still_completes_everything(policy_name, specs, block_size, chunk, budget):
    """A KV cache that holds just the largest request: every request completes, within a
    bounded number of iterations (no starvation, no livelock of preemptions)."""
    if policy_name in ("generation", "embedding-only"):
        kind = "generation" if policy_name == "generation" else "embedding"
        specs = [(kind, *rest) for _, *rest in specs]
    if chunk is None:  # atomic embeddings must fit the budget
        specs = [(k, t, min(n, budget) if k == "embedding" else n, o) for k, t, n, o in specs]
    reqs = make_requests(specs)
    largest = max(r.input_len + r.max_output_tokens for r in reqs)
    blocks = -(-largest // block_size)
    cfg = SchedulerConfig(token_budget=budget, chunk_size=chunk if chunk is None else
                          min(chunk, budget), block_size=block_size, num_blocks=blocks)
    policy = make_policy(policy_name, cfg)
    work = sum(r.input_len + r.max_output_tokens for r in reqs)
    bound = 2 * work + 4 * len(reqs) + 25  # each request alone needs <= its tokens
    batches = drive(policy, reqs, max_iterations=bound)
    assert len(batches) <= bound
    for r in reqs:
        assert r.state is RequestState.FINISHED, (r.request_id, r.state, r.reject_reason)
    assert policy.blocks.num_used == 0


@settings(max_examples=40, deadline=None)
@given(policy_name=st.sampled_from(["ibs", "unified-hetero", "generation"]),
       specs=st.lists(request_spec, min_size=2, max_size=40))
def test_running_decodes_come_before_new_work(policy_name, specs):
    if policy_name == "generation":
        specs = [("generation", *rest) for _, *rest in specs]
    policy = make_policy(policy_name, SchedulerConfig(token_budget=512, chunk_size=64,
                                                      num_blocks=100_000))
    decoding_before: list = []

    def step_hook(pol, batch, now):
        in_batch = {it.request.request_id for it in batch.items}
        for rid in decoding_before:
            assert rid in in_batch, "a running decode was left out for new work"
        decoding_before.clear()
        # after this batch completes, every running generation request that is decoding
        for it in batch.items:
            r = it.request
            will_decode = (it.kind is not ItemKind.EMBED_CHUNK and it.end == r.seq_len
                           and r.num_generated + 1 < r.max_output_tokens)
            if will_decode:
                decoding_before.append(r.request_id)
    drive(policy, make_requests(specs), step_hook)


@settings(max_examples=200, deadline=None)
@given(we=st.integers(1, 10_000), wg=st.integers(1, 10_000),
       sizes=st.lists(st.tuples(st.integers(1, 600), st.integers(1, 600)), min_size=1,
                      max_size=300))
def test_token_charged_credits_keep_within_one_item_of_the_ideal_share(we, wg, sizes):
    """Whatever each side's item sizes, the tokens each side got differ from the ``we:wg``
    share of all tokens by at most the largest item (the brief's bound, in tokens)."""
    credits = Credits()
    got = {"e": 0, "g": 0}
    for i, (e_size, g_size) in enumerate(sizes):
        side = credits.pick(embed_first_on_tie=i % 2 == 0)
        n = e_size if side == "e" else g_size
        got[side] += n
        credits.charge(side, n, we, wg, True, True)
        total = got["e"] + got["g"]
        largest = max(max(s) for s in sizes[:i + 1])
        assert abs(got["e"] - total * we / (we + wg)) <= largest + 1e-6


def test_credits_stay_bounded_when_one_side_is_blocked():
    """Defect: after a failed turn disabled one side, every later pick of the iteration kept
    adding its weight, so credits grew ~7,000 per iteration (700,000 after 100)."""
    policy = make_policy("ibs", SchedulerConfig(token_budget=100, chunk_size=64))
    reqs = make_requests([("embedding", 0, 64, 0)] * 300 + [("generation", 0, 36, 1)] * 300)
    for r in reqs:
        policy.add(r)
    for _ in range(100):
        policy.complete(policy.schedule(0.0), 0.0)
        credits = policy.snapshot().credits
        assert all(abs(v) <= 100 for v in credits.values()), credits


def test_generation_gets_its_share_right_after_embeddings_were_kv_blocked():
    """Defect: credits earned while embeddings were KV-blocked later shut new generations
    out for 35 iterations where the work ratio gives them one turn in three. Now a blocked
    phase moves no credit, and afterwards the token shares follow the work at once."""
    cfg = SchedulerConfig(token_budget=256, chunk_size=64, block_size=16, num_blocks=100)
    policy = make_policy("ibs", cfg)
    hog = make_requests([("generation", 0, 1500, 60)])[0]  # 98 of the 100 blocks
    policy.add(hog)
    now = 0.0
    while hog.num_generated == 0:
        now += 1
        policy.complete(policy.schedule(now), now)
    for i, r in enumerate(make_requests([("embedding", now, 200, 0)] * 10
                                        + [("generation", now, 32, 1)] * 30)):
        r.request_id = f"x{i}"
        policy.add(r, now)
    credits_before = policy.snapshot().credits
    while hog.state is not RequestState.FINISHED:  # both queues blocked on KV meanwhile
        now += 1
        batch = policy.schedule(now)
        assert [it.request for it in batch.items] == [hog]
        policy.complete(batch, now)
    assert policy.snapshot().credits == credits_before
    we, wg = policy.waiting_work()
    tokens = {ItemKind.EMBED_CHUNK: 0, ItemKind.PREFILL_CHUNK: 0}
    streak = 0
    for _ in range(12):
        now += 1
        batch = policy.schedule(now)
        for kind in tokens:
            tokens[kind] += batch.tokens_of(kind)
        streak = 0 if batch.tokens_of(ItemKind.PREFILL_CHUNK) else streak + 1
        assert streak <= 2, "new generations got no turn"
        policy.complete(batch, now)
    share = tokens[ItemKind.PREFILL_CHUNK] / sum(tokens.values())
    assert abs(share - wg / (we + wg)) <= 0.1


@settings(max_examples=25, deadline=None)
@given(n_embed=st.integers(200, 600), n_gen=st.integers(200, 600), size=st.sampled_from([64, 128]),
       prompt_ratio=st.sampled_from([1, 8]))
def test_ibs_token_ratio_follows_remaining_work(n_embed, n_gen, size, prompt_ratio):
    """Backlogs of equal-size items, prompts 1x or 8x the chunk: the scheduled e:g *token*
    ratio tracks we:wg (it was a turn ratio, 0.11 instead of 0.50 with 8x prompts)."""
    prompt = size * prompt_ratio
    policy = make_policy("ibs", SchedulerConfig(token_budget=2048, chunk_size=size,
                                                num_blocks=1_000_000, max_num_seqs=100_000))
    specs = ([("embedding", 0.0, size, 0)] * n_embed) + ([("generation", 0.0, prompt, 1)] * n_gen)
    for r in make_requests(specs):
        policy.add(r)
    we, wg = policy.waiting_work()
    tokens = {"e": 0, "g": 0}
    for _ in range(20):
        batch = policy.schedule(0.0)
        tokens["e"] += batch.tokens_of(ItemKind.EMBED_CHUNK)
        tokens["g"] += batch.tokens_of(ItemKind.PREFILL_CHUNK)
        policy.complete(batch, 1.0)
    share = tokens["e"] / (tokens["e"] + tokens["g"])
    assert abs(share - we / (we + wg)) <= 0.05


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(request_spec, min_size=2, max_size=60),
       budget=st.sampled_from([1024, 2048, 4096]))
def test_ibs_starves_neither_type(specs, budget):
    """With both queues non-empty and memory to spare, neither side waits unboundedly."""
    chunk = 256
    specs = [(kind, t, min(n, 256), o) for kind, t, n, o in specs]
    policy = make_policy("ibs", SchedulerConfig(token_budget=budget, chunk_size=chunk,
                                                num_blocks=1_000_000, max_num_seqs=100_000))
    streak = {"e": 0, "g": 0}
    bound = {"e": 0, "g": 0}

    def check(pol, batch, now):
        e_wait = bool(pol.embeddings())
        g_wait = bool(pol.waiting_generations())
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


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(out_len=st.integers(40, 160), emb_len=st.integers(100, 400),
       emb_times=st.lists(st.integers(0, 300), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_ibs_embedding_admission_wait_is_bounded_while_generations_saturate_kv(
        out_len, emb_len, emb_times, seed):
    """A generation arrives every iteration, more than the cache holds; an embedding that
    arrives meanwhile is admitted once the generations holding blocks at its arrival could
    have finished (once per embedding ahead of it in its FCFS queue), not after the whole
    generation stream: its blocks are held back from new generations, and decodes never evict
    it."""
    rng = np.random.default_rng(seed)
    cfg = SchedulerConfig(token_budget=512, chunk_size=128, block_size=16, num_blocks=120,
                          max_num_seqs=256)
    policy = make_policy("ibs", cfg)
    gens = [("generation", float(t), int(rng.integers(32, 96)), out_len) for t in range(400)]
    embs = [("embedding", float(t), emb_len, 0) for t in emb_times]
    reqs = make_requests(gens + embs)
    drive(policy, reqs)
    prompt_iters = 2  # a 96-token prompt needs one chunk; one iteration of slack
    embeds = reqs[len(gens):]
    for r in embeds:
        wait = r.admitted_at - r.arrival_time
        place = 1 + sum(1 for o in embeds if o.order < r.order and o.admitted_at > r.arrival_time)
        assert wait <= place * (out_len + prompt_iters + 3), (r.request_id, wait, place)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy_name=st.sampled_from(["ibs", "unified-hetero", "unified-homo"]),
       seed=st.integers(0, 999), gen_share=st.sampled_from([0.5, 0.8, 0.95]))
def test_atomic_open_loop_embeddings_complete(policy_name, seed, gen_share):
    """Atomic embeddings (chunk_size null) in an open-loop stream with a tight budget: a head
    that does not fit the budget left claims the next batch, so embeddings keep completing
    (under IBS none ever completed: the head blocked the queue for ever)."""
    rng = np.random.default_rng(seed)
    specs = []
    for t in range(300):
        if rng.random() < gen_share:
            specs.append(("generation", float(t), int(rng.integers(16, 128)),
                          int(rng.integers(32, 256))))
        else:
            specs.append(("embedding", float(t), int(rng.integers(32, 256)), 0))
    cfg = SchedulerConfig(token_budget=256, chunk_size=None, max_num_seqs=256, num_blocks=100_000)
    policy = make_policy(policy_name, cfg)
    reqs = make_requests(specs)
    drive(policy, reqs)
    embeds = [r for r in reqs if r.is_embedding]
    assert all(r.state is RequestState.FINISHED for r in embeds)
    if policy_name == "ibs":
        waits = [r.admitted_at - r.arrival_time for r in embeds]
        assert max(waits) <= 40, max(waits)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy_name=st.sampled_from(MIXED[:3]), specs=st.lists(request_spec, min_size=2, max_size=30),
       k=knobs, abort_at=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 29)), max_size=12))
def test_no_blocks_leak_after_preemptions_and_aborts(policy_name, specs, k, abort_at):
    policy = make_policy(policy_name, config_from(k, num_blocks=40))
    reqs = make_requests(specs)
    aborts: dict[int, list[str]] = {}
    for when, which in abort_at:
        aborts.setdefault(when, []).append(f"r{which % len(reqs)}")
    drive(policy, reqs, invariant_checker({}, []), aborts=aborts)
    assert policy.blocks.num_used == 0 and policy.num_unfinished == 0
    for r in reqs:
        assert r.state.is_final


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
    assert set(POLICIES) >= {"ibs", "unified-hetero", "unified-homo", "embedding-only",
                             "generation", "prefill-only", "decode-only"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy_name=st.sampled_from(["ibs", "unified-hetero", "unified-homo", "generation"]),
       specs=st.lists(request_spec, min_size=1, max_size=30), k=knobs)
@example(  # an embedding admitted into blocks a running decode was to grow into
    policy_name="unified-homo",
    specs=[("embedding", 0.0, 209, 1), ("embedding", 1.0, 65, 1), ("generation", 0.0, 58, 40),
           ("generation", 0.0, 187, 40), ("generation", 2.0, 1, 1)],
    k={"token_budget": 256, "chunk": 16, "max_num_seqs": 4, "block_size": 16, "num_blocks": 40,
       "waiting_work": "prompt", "max_num_embeds": None})
def test_reserve_admission_never_preempts(policy_name, specs, k):
    """kv_admission: reserve admits a generation only when every running one's final length
    fits, so (outputs ending at their expected length) no decode ever has to preempt."""
    if policy_name == "generation":
        specs = [("generation", *rest) for _, *rest in specs]
    policy = make_policy(policy_name, config_from(k, kv_admission="reserve"))
    reqs = make_requests(specs)
    drive(policy, reqs, invariant_checker({}, []))
    assert policy.preemptions == {"embedding": 0, "generation": 0}
    assert all(r.state in (RequestState.FINISHED, RequestState.REJECTED) for r in reqs)


@settings(max_examples=60, deadline=None)
@given(policy_name=st.sampled_from(["ibs", "unified-hetero"]),
       gen_blocks=st.lists(st.integers(1, 5), min_size=2, max_size=6),
       block_size=st.sampled_from([4, 16]), chunk=st.sampled_from([16, 64, None]),
       embed_frac=st.floats(0.01, 1.0), embedding_kv=st.sampled_from(["read", "all"]))
def test_one_chunk_embedding_is_admitted_with_no_free_block(policy_name, gen_blocks, block_size,
                                                            chunk, embed_frac, embedding_kv):
    """Running generations hold every block of the cache; an embedding that fits one chunk
    (or an atomic one) still goes at once, holds no block and preempts nobody (``read``);
    with ``embedding_kv: all`` it needs blocks and waits."""
    budget = 512  # every prompt in the first batch
    cfg = SchedulerConfig(token_budget=budget, chunk_size=chunk, block_size=block_size,
                          num_blocks=sum(gen_blocks), embedding_kv=embedding_kv, max_num_seqs=64)
    policy = make_policy(policy_name, cfg)
    # each prompt (k blocks less one token) and its first sampled token fill its k blocks
    gens = make_requests([("generation", 0, k * block_size - 1, 2) for k in gen_blocks])
    for g in gens:
        assert policy.add(g, 0.0)
    while any(g.num_generated == 0 for g in gens):
        policy.complete(policy.schedule(0.0), 0.0)
    assert policy.blocks.num_free == 0
    length = max(1, round(embed_frac * ((chunk or budget) - len(gens))))
    emb = Request("e", RequestKind.EMBEDDING, 1.0, length)
    added = policy.add(emb, 1.0)  # with ``all``, one larger than the whole cache is refused
    assert added or embedding_kv == "all"
    batch = policy.schedule(1.0)
    items = [it for it in batch.items if it.request is emb]
    if embedding_kv == "all":
        assert not items and emb.state in (RequestState.WAITING, RequestState.REJECTED)
        return
    assert [it.num_tokens for it in items] == [length]
    assert not policy.writes_kv(items[0])
    assert policy.blocks.held("e") == 0 and policy.blocks.num_free == 0
    assert sum(policy.preemptions.values()) == 0
    policy.complete(batch, 2.0)
    assert emb.state is RequestState.FINISHED
