"""The iteration-time target (``tpot_target_s``) and the adaptive router."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orthrus_sim.engine import (
    BatchItem,
    BatchUnit,
    ItemKind,
    Request,
    RequestKind,
    RequestState,
    SchedulerConfig,
    make_policy,
)
from orthrus_sim.engine.iteration_target import PROGRESS_AFTER
from tests.helpers import drive, make_requests
from tests.test_core_properties import request_spec


class RooflinePredictor:
    """A monotone stand-in for a cost model: a fixed cost, then the larger of a compute term
    (every token) and a memory term (weights, plus each decode's context), plus a small
    per-sequence cost. Monotone in every item's length, as the target's search requires."""

    def __init__(self, fixed=1.0, per_token=0.01, weights=1.5, per_kv=0.002, per_seq=0.005):
        self.fixed, self.per_token, self.weights = fixed, per_token, weights
        self.per_kv, self.per_seq = per_kv, per_seq
        self.calls = 0

    def items_time(self, items) -> float:
        if not items:
            return 0.0
        tokens = sum(it.num_tokens for it in items)
        kv = sum(it.start + it.num_tokens for it in items)
        compute = self.per_token * tokens
        memory = self.weights + self.per_kv * kv
        return self.fixed + max(compute, memory) + self.per_seq * len(items)

    def predict(self, batch: BatchUnit, extra: BatchItem | None = None) -> float:
        self.calls += 1
        return self.items_time(batch.items + ([extra] if extra is not None else []))


def decodes_of(batch: BatchUnit) -> list[BatchItem]:
    return [it for it in batch.items if it.kind is ItemKind.DECODE]


def test_a_target_without_predictor_is_refused():
    with pytest.raises(ValueError, match="tpot_target_s needs an iteration-time predictor"):
        make_policy("ibs", SchedulerConfig(tpot_target_s=0.02))


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "fast"])
def test_a_bad_target_names_the_field(bad):
    with pytest.raises(ValueError, match="scheduler.tpot_target_s"):
        SchedulerConfig(tpot_target_s=bad)


def test_a_chunk_beside_decodes_is_cut_to_the_target_in_min_chunk_steps():
    pred = RooflinePredictor()
    cfg = SchedulerConfig(token_budget=1024, chunk_size=512, tpot_target_s=3.2, min_chunk_tokens=32,
                          tpot_slack_iterations=0)
    policy = make_policy("ibs", cfg, pred)
    gen = Request("g", RequestKind.GENERATION, 0.0, 8, max_output_tokens=50)
    policy.add(gen)
    policy.complete(policy.schedule(0.0), 1.0)  # the prompt: now it decodes
    policy.add(Request("e", RequestKind.EMBEDDING, 1.0, 900), 1.0)
    batch = policy.schedule(2.0)
    chunk = [it for it in batch.items if it.kind is ItemKind.EMBED_CHUNK]
    assert decodes_of(batch) and len(chunk) == 1
    n = chunk[0].num_tokens
    assert n % 32 == 0 and 32 <= n < 512
    assert pred.items_time(batch.items) <= 3.2
    # one more step of 32 would have missed the target: the cut is the largest that fits
    longer = BatchItem(chunk[0].request, ItemKind.EMBED_CHUNK, 0, n + 32)
    assert pred.items_time(decodes_of(batch) + [longer]) > 3.2
    # with no decode in the batch, the full chunk goes
    alone = make_policy("ibs", cfg, RooflinePredictor())
    alone.add(Request("e2", RequestKind.EMBEDDING, 0.0, 900))
    assert alone.schedule(0.0).items[0].num_tokens == 512


def test_no_target_means_the_briefs_ibs():
    """Without a target, IBS schedules exactly what it did (the predictor is never asked)."""
    spec = [("generation", 0.0, 40, 30), ("embedding", 0.0, 700, 0), ("generation", 2.0, 100, 9),
            ("embedding", 3.0, 64, 0), ("embedding", 3.0, 1000, 0)]
    cfg = SchedulerConfig(token_budget=256, chunk_size=128)
    a = drive(make_policy("ibs", cfg), make_requests(spec))
    pred = RooflinePredictor()
    b = drive(make_policy("ibs", cfg, pred), make_requests(spec))
    assert [[(it.request.request_id, it.kind, it.num_tokens) for it in x.items] for x in a] == \
        [[(it.request.request_id, it.kind, it.num_tokens) for it in x.items] for x in b]
    assert pred.calls == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(request_spec, min_size=1, max_size=40),
       st.sampled_from(["ibs", "unified-hetero", "unified-homo"]),
       st.sampled_from([1.6, 2.2, 3.0, 5.0]),
       st.sampled_from([8, 16, 32]),
       st.sampled_from([64, 256]))
def test_decode_iterations_stay_within_the_target(spec, policy_name, target, min_chunk, budget):
    """Without slack (``tpot_slack_iterations=0``), with any monotone predictor: an iteration
    that carries decodes is predicted above the target only if its decodes alone are, or if it
    carries a progress chunk (one embedding chunk of at most ``min_chunk_tokens``, at most once
    in ``PROGRESS_AFTER`` iterations beside decodes that fit); every request still finishes."""
    pred = RooflinePredictor()
    cfg = SchedulerConfig(token_budget=budget, chunk_size=min(64, budget), num_blocks=4000,
                          block_size=16, tpot_target_s=target, min_chunk_tokens=min_chunk,
                          tpot_slack_iterations=0)
    policy = make_policy(policy_name, cfg, pred)
    requests = make_requests(spec)
    over = []  # decode iterations over the target although their decodes alone are not
    iteration = [0]

    def check(policy, batch, now):
        iteration[0] += 1
        decodes = decodes_of(batch)
        if not decodes or pred.items_time(batch.items) <= target:
            return
        rest = [it for it in batch.items if it.kind is not ItemKind.DECODE]
        if pred.items_time(decodes) > target:
            assert len(rest) <= 1
        else:
            over.append(iteration[0])
            # without its one progress chunk the iteration is within the target
            small = [it for it in rest if it.kind is ItemKind.EMBED_CHUNK and it.num_tokens <= min_chunk]
            assert any(pred.items_time([it for it in batch.items if it is not p]) <= target
                       for p in small), "a chunk pushed the iteration over the target"
        for it in rest:
            if it.kind is ItemKind.EMBED_CHUNK and pred.items_time(decodes) > target:
                assert it.num_tokens <= min_chunk

    drive(policy, requests, check)
    assert all(r.state.value == "finished" for r in requests)
    assert all(b - a >= PROGRESS_AFTER for a, b in zip(over, over[1:]))


@settings(max_examples=60, deadline=None)
@given(st.lists(request_spec, min_size=1, max_size=40),
       st.sampled_from(["ibs", "unified-hetero", "unified-homo"]),
       st.sampled_from([1.6, 2.2, 3.0, 5.0]),
       st.sampled_from([8, 16, 32]),
       st.sampled_from([64, 256]),
       st.sampled_from([1, 3, 8]),
       st.sampled_from([0.0, 0.01, 0.05]))
def test_with_slack_every_decode_keeps_the_target_on_its_mean(spec, policy_name, target, min_chunk,
                                                              budget, slack, credit):
    """With slack and any monotone predictor (iterations take what it predicts): an iteration
    that carries decodes goes over the limit (the paced target plus the running decodes' least
    slack, at most ``slack`` targets over it) only by one progress chunk or by decodes that
    alone exceed it. And each decode's real time from its first token to its last (its clocks,
    so everything between counts) is at most the paced target per decode-carrying iteration,
    plus the credit it took ahead, plus what the policy cannot help: those overruns and the
    iterations that carried no decode (Unified-Homo's embedding side, a budget claim). Where it
    decoded in every iteration, ran its expected output and met none of those, its TPOT holds
    the target. Every request still finishes."""
    pred = RooflinePredictor()
    cfg = SchedulerConfig(token_budget=budget, chunk_size=min(64, budget), num_blocks=4000,
                          block_size=16, tpot_target_s=target, min_chunk_tokens=min_chunk,
                          tpot_slack_iterations=slack, tpot_credit=credit)
    policy = make_policy(policy_name, cfg, pred)
    requests = make_requests(spec)
    paced = target * (1 - credit)
    iterations = []  # (start, end, decodes carried, overrun or time without decodes)

    def check(policy, batch, now):
        if not batch:
            return
        t, decodes = pred.items_time(batch.items), decodes_of(batch)
        if not decodes:
            iterations.append((now, now + t, set(), t))
            return
        limit = policy.target.slack.limit_s()
        assert target - slack * target - 1e-9 <= limit <= target + slack * target + 1e-9
        overrun = 0.0
        if t > limit + 1e-9:
            overrun = t - limit
            if pred.items_time(decodes) <= limit:
                small = [it for it in batch.items
                         if it.kind is ItemKind.EMBED_CHUNK and it.num_tokens <= min_chunk]
                assert any(pred.items_time([it for it in batch.items if it is not p]) <= limit + 1e-9
                           for p in small), "a chunk pushed the iteration over the limit"
            else:
                assert len(batch.items) - len(decodes) <= 1
        iterations.append((now, now + t, {it.request.request_id for it in decodes}, overrun))

    drive(policy, requests, check, duration=lambda batch: pred.items_time(batch.items))
    assert all(r.state.value == "finished" for r in requests)
    for r in requests:
        if r.is_embedding or r.num_generated < 2:
            continue
        life = [it for it in iterations
                if it[0] >= r.first_token_at - 1e-9 and it[1] <= r.finished_at + 1e-9]
        carrying = [it for it in life if it[2]]
        taken = min(credit * target * (r.expected_output_tokens - 1), slack * target)
        repaying = math.ceil(taken / (credit * target) - 1e-9) if credit else 0
        allowed = (paced * min(len(carrying), repaying)
                   + target * max(len(carrying) - repaying, 0) + taken)
        exceptions = sum(it[3] for it in life)
        elapsed = r.finished_at - r.first_token_at
        # the exceptions count twice at most: a debt past the floor is forgiven
        assert elapsed <= allowed + 2 * exceptions + 1e-6
        if exceptions == 0 and all(r.request_id in it[2] for it in carrying):
            assert elapsed <= target * (r.num_generated - 1) * (1 + 1e-9) + 1e-9


def test_saved_slack_lets_a_prompt_go_whole_and_is_paid_back():
    """Decode iterations under the target save what they leave; a prompt that the target alone
    would cut goes whole once enough is saved, and its iteration's time over the target comes
    out of the saving. Without slack the same prompt is cut."""
    def prompt_chunk(slack: int) -> tuple[int, float, float, float]:
        pred = RooflinePredictor()
        cfg = SchedulerConfig(token_budget=1024, chunk_size=512, tpot_target_s=3.0,
                              min_chunk_tokens=32, tpot_slack_iterations=slack, tpot_credit=0)
        policy = make_policy("ibs", cfg, pred)
        policy.add(Request("g", RequestKind.GENERATION, 0.0, 8, max_output_tokens=50))
        now = 0.0
        for _ in range(4):  # the prompt, then decodes alone: ~2.5 s each against 3 s
            batch = policy.schedule(now)
            now += pred.items_time(batch.items)
            policy.complete(batch, now)
        policy.add(Request("p", RequestKind.GENERATION, now, 300, max_output_tokens=1), now)
        before = policy.target.slack.limit_s() - 3.0 if slack else 0.0
        batch = policy.schedule(now)
        t = pred.items_time(batch.items)
        policy.complete(batch, now + t)
        chunk = next(it.num_tokens for it in batch.items if it.request.request_id == "p")
        assert t - 3.0 <= before + 1e-9
        return chunk, before, policy.target.slack.limit_s() - 3.0 if slack else 0.0, t

    chunk, before, after, t = prompt_chunk(8)
    assert chunk == 300 and t > 3.0  # whole, over the target, within what was saved
    assert after == pytest.approx(before - (t - 3.0))
    chunk, before, after, _ = prompt_chunk(0)
    assert before == after == 0.0 and chunk == 192  # cut to what the target alone leaves


def test_a_long_decode_that_repaid_its_credit_leaves_prompts_room():
    """A decode whose credit is capped repays it for as many iterations as it took to earn,
    then counts the full target: decodes alone between the paced target and the target do not
    drive its slack down for the rest of a long output, so a prompt arriving late still goes
    at once (as with the cap on every iteration)."""
    pred = RooflinePredictor(per_kv=0.0)  # one decode alone: 2.505 s, beside 100 tokens 2.51
    cfg = SchedulerConfig(token_budget=1024, chunk_size=512, tpot_target_s=2.52,
                          min_chunk_tokens=32, tpot_slack_iterations=8, tpot_credit=0.01)
    policy = make_policy("ibs", cfg, pred)
    policy.add(Request("g", RequestKind.GENERATION, 0.0, 8, max_output_tokens=6000))
    now = 0.0
    for _ in range(4500):
        batch = policy.schedule(now)
        now += pred.items_time(batch.items)
        policy.complete(batch, now)
    policy.add(Request("p", RequestKind.GENERATION, now, 100, max_output_tokens=5), now)
    batch = policy.schedule(now)
    assert [(it.request.request_id, it.num_tokens) for it in batch.items
            if it.kind is ItemKind.PREFILL_CHUNK] == [("p", 100)]


def test_steps_slower_than_predicted_put_the_decodes_in_debt_until_repaid():
    """Steps that take longer than the predictor says leave the running decodes in debt: the
    limit drops under the target, and a prompt the target alone would let in part waits until
    the steps have repaid it."""
    pred = RooflinePredictor(per_kv=0.0)  # one decode alone: 2.505 s
    cfg = SchedulerConfig(token_budget=1024, chunk_size=512, tpot_target_s=3.0,
                          min_chunk_tokens=32, tpot_slack_iterations=8, tpot_credit=0.01)
    policy = make_policy("ibs", cfg, pred)
    policy.add(Request("g", RequestKind.GENERATION, 0.0, 8, max_output_tokens=30))
    now = 0.0
    for i in range(8):  # the prompt, then decodes that each take a second longer than predicted
        batch = policy.schedule(now)
        now += pred.items_time(batch.items) + (1.0 if i else 0.0)
        policy.complete(batch, now)
    assert policy.target.slack.limit_s() < pred.items_time(batch.items)  # in debt
    policy.add(Request("p", RequestKind.GENERATION, now, 300, max_output_tokens=5), now)
    waited = 0
    while True:
        batch = policy.schedule(now)
        chunk = [it.num_tokens for it in batch.items if it.request.request_id == "p"]
        if chunk:
            break
        waited += 1
        now += pred.items_time(batch.items)  # steps as predicted now: they repay
        policy.complete(batch, now)
    assert waited > 0 and chunk[0] > 0
    assert waited < 40


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8", None])
def test_a_bad_slack_names_the_field(bad):
    with pytest.raises(ValueError, match="scheduler.tpot_slack_iterations"):
        SchedulerConfig(tpot_target_s=0.02, tpot_slack_iterations=bad)


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), float("inf"), True, "0.01", None])
def test_a_bad_credit_names_the_field(bad):
    with pytest.raises(ValueError, match="scheduler.tpot_credit"):
        SchedulerConfig(tpot_target_s=0.02, tpot_credit=bad)


def test_embeddings_progress_beside_decodes_that_alone_miss_the_target():
    """Decodes that alone exceed the target still let one small embedding chunk through per
    iteration, so an embedding finishes while they run."""
    pred = RooflinePredictor()
    cfg = SchedulerConfig(token_budget=256, chunk_size=128, tpot_target_s=1.0, min_chunk_tokens=16)
    policy = make_policy("ibs", cfg, pred)
    gens = [Request(f"g{i}", RequestKind.GENERATION, 0.0, 4, max_output_tokens=400) for i in range(3)]
    for g in gens:
        policy.add(g)
    policy.complete(policy.schedule(0.0), 1.0)
    emb = Request("e", RequestKind.EMBEDDING, 1.0, 100)
    policy.add(emb, 1.0)
    now = 1.0
    for _ in range(10):
        batch = policy.schedule(now)
        now += 1
        policy.complete(batch, now)
    assert emb.state.value == "finished"
    assert all(g.state.value == "running" for g in gens)


def test_the_pytorch_engine_keeps_decode_iterations_within_its_calibrated_target(tiny_models):
    """``serve --tpot-target --calibration``: the engine's policy predicts with the cost model
    fitted to the engine; every decode iteration is predicted within the target (or carries
    decodes that alone miss it), and greedy outputs are those of an engine without a target."""
    pytest.importorskip("torch")
    from orthrus_real.engine.sampling import SamplingParams
    from orthrus_real.engine.torch_engine import Engine
    from orthrus_sim.costmodel import calibrated_predictor
    from tests.test_real_engine import prompt_ids

    path = tiny_models["llama"]
    cal = "calibration/cpu-2core-small.json"
    probe = calibrated_predictor(cal, str(path), 4)
    gen = Request("p", RequestKind.GENERATION, 0.0, 40, max_output_tokens=8)
    gen.num_computed = 40
    decodes_only = BatchUnit(256)
    decodes_only.add_decodes([BatchItem(gen, ItemKind.DECODE, 40, 1)] * 3)
    target = 1.3 * probe.predict(decodes_only)

    def run(scheduler):
        eng = Engine(path, adapter_dir=path / "adapter", scheduler=scheduler, device="cpu",
                     dtype="float32", calibration=cal)
        seen = []
        schedule = eng.policy.schedule

        def watched(now):
            batch = schedule(now)
            seen.append(list(batch.items))
            return batch

        eng.policy.schedule = watched
        for i in range(3):
            eng.add_generation(f"g{i}", token_ids=prompt_ids(20 + 5 * i, seed=i),
                               params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        for i in range(3):
            eng.add_embedding(f"e{i}", token_ids=prompt_ids(200 + 9 * i, seed=10 + i))
        return eng.run_until_idle(), seen, eng

    base, _, _ = run(SchedulerConfig(token_budget=256, chunk_size=128))
    out, seen, eng = run(SchedulerConfig(token_budget=256, chunk_size=128, tpot_target_s=target,
                                         min_chunk_tokens=16, tpot_slack_iterations=0))
    assert "predicted by" in eng.describe()["tpot_target"]
    check = calibrated_predictor(cal, str(path), 4)
    cut = 0
    for items in seen:
        decodes = [it for it in items if it.kind is ItemKind.DECODE]
        if not decodes:
            continue
        batch, alone = BatchUnit(256), BatchUnit(256)
        for it in items:
            batch.items.append(it)
        alone.items.extend(decodes)
        assert check.predict(batch) <= target * (1 + 1e-9) or check.predict(alone) > target
        cut += any(it.kind is ItemKind.EMBED_CHUNK and it.num_tokens < 128 for it in items)
    assert cut, "the target never cut a chunk: the test does not test it"
    for i in range(3):
        assert out[f"g{i}"].token_ids == base[f"g{i}"].token_ids
        np.testing.assert_allclose(out[f"e{i}"].embedding, base[f"e{i}"].embedding, atol=1e-5)
    # with the default slack the engine reports to the target what it needs: each generation
    # that began decoding, every iteration's time on its clock; outputs stay the same
    out, _, eng = run(SchedulerConfig(token_budget=256, chunk_size=128, tpot_target_s=target,
                                      min_chunk_tokens=16))
    assert "TPOT" in eng.describe()["tpot_target"]
    account = eng.policy.target.slack
    assert account is not None and account._tickets >= 3 and account.ledger_s != 0
    for i in range(3):
        assert out[f"g{i}"].token_ids == base[f"g{i}"].token_ids
        np.testing.assert_allclose(out[f"e{i}"].embedding, base[f"e{i}"].embedding, atol=1e-5)


def test_a_target_on_the_engine_needs_a_calibration(tiny_models):
    pytest.importorskip("torch")
    from orthrus_real.engine.torch_engine import Engine

    with pytest.raises(ValueError, match="--calibration"):
        Engine(tiny_models["llama"], scheduler=SchedulerConfig(tpot_target_s=0.01), device="cpu",
               dtype="float32")


@pytest.mark.parametrize("router", ["round-robin", "adaptive"])
@pytest.mark.parametrize("slack", [0, 8])
def test_simulated_target_runs_equal_stepping(router, slack):
    """With a target, the simulator's decode runs give what stepping every iteration gives
    (a decode run is not taken while embeddings wait: a progress chunk may let one in)."""
    import math

    from orthrus_sim.experiment.scenario import parse_scenario
    from orthrus_sim.sim.run import simulate
    from tests.test_simulator import mixed_raw

    raw = mixed_raw(duration_s=15, scheduler={"tpot_target_s": 0.03, "min_chunk_tokens": 32,
                                              "tpot_slack_iterations": slack},
                    cluster={"gpus": 2, "router": router})
    scenario = parse_scenario(raw)
    fast = simulate(scenario, "orthrus", fast_forward=True)
    slow = simulate(scenario, "orthrus", fast_forward=False)
    assert fast.metrics["completed"] == slow.metrics["completed"]
    for f, s in zip(fast.requests, slow.requests, strict=True):
        assert f["request_id"] == s["request_id"] and f["state"] == s["state"]
        for key in ("finished_s", "first_token_s"):
            assert (f[key] is None and s[key] is None) or math.isclose(
                f[key], s[key], rel_tol=1e-9, abs_tol=1e-9)
    assert fast.metrics["latency_s"]["tpot"]["p99"] <= 0.03 * 1.05


def test_no_progress_chunk_while_embeddings_progress():
    """The starvation ride (PROGRESS_AFTER) is for embeddings that get nothing: while a cut
    chunk goes every iteration, no iteration goes over the target (review finding)."""
    pred = RooflinePredictor(fixed=0.0, per_token=0.05, weights=10.0, per_kv=0.0, per_seq=0.1)
    cfg = SchedulerConfig(token_budget=512, chunk_size=256, tpot_target_s=20.0, min_chunk_tokens=32,
                          tpot_slack_iterations=0)
    policy = make_policy("ibs", cfg, pred)
    for i in range(4):
        policy.add(Request(f"g{i}", RequestKind.GENERATION, 0.0, 4, max_output_tokens=300))
    policy.complete(policy.schedule(0.0), 1.0)
    for i in range(40):
        policy.add(Request(f"e{i}", RequestKind.EMBEDDING, 1.0, 600), 1.0)
    now, went = 1.0, 0
    for _ in range(60):
        batch = policy.schedule(now)
        assert decodes_of(batch)
        assert pred.items_time(batch.items) <= 20.0, "a progress chunk rode although embeddings progress"
        went += sum(it.kind is ItemKind.EMBED_CHUNK for it in batch.items)
        now += 1
        policy.complete(batch, now)
    assert went >= 60


def test_adaptive_router_without_a_target_is_refused_up_front():
    from orthrus_sim.experiment.scenario import load_scenario

    with pytest.raises(ValueError, match="tpot_target_s"):
        load_scenario("scenarios/mix_sweep.yaml", ["cluster.router=adaptive"])
    # split placements alone route by kind: no target needed
    load_scenario("scenarios/mix_sweep.yaml", ["cluster.router=adaptive",
                                               "configurations=[dedicated-1:3]"])


@settings(max_examples=60, deadline=None)
@given(st.lists(request_spec, min_size=1, max_size=30),
       st.sampled_from(["ibs", "unified-hetero", "unified-homo"]),
       st.sampled_from([1.6, 2.2, 3.0]), st.sampled_from([8, 16]),
       st.sampled_from([30, 60, 400]), st.sampled_from([4, 16]))
def test_cut_embedding_chunks_store_what_later_chunks_read(spec, policy_name, target, min_chunk,
                                                           num_blocks, block_size):
    """The target cuts embedding chunks, so an embedding's last chunk comes later than its
    admission planned: every chunk but the last still finds blocks for the keys and values it
    stores, the last stores none, a one-chunk embedding holds none, the blocks in use never
    exceed the cache, and everything finishes and gives its blocks back. (An embedding of one
    planned chunk that the target cuts stores its earlier pieces.)"""
    pred = RooflinePredictor()
    cfg = SchedulerConfig(token_budget=128, chunk_size=64, num_blocks=num_blocks,
                          block_size=block_size, tpot_target_s=target, min_chunk_tokens=min_chunk)
    policy = make_policy(policy_name, cfg, pred)
    requests = make_requests(spec)

    def check(policy, batch, now):
        blocks = policy.blocks
        assert sum(len(t) for t in blocks.tables.values()) == blocks.num_used <= num_blocks
        for it in batch.items:
            rid = it.request.request_id
            stores = it.end if policy.writes_kv(it) else it.start
            assert blocks.held(rid) * block_size >= stores
            if it.kind is ItemKind.EMBED_CHUNK:
                assert policy.writes_kv(it) == (it.end < it.request.input_len)
                if it.start == 0 and not policy.writes_kv(it):  # it goes in one chunk
                    assert blocks.held(rid) == 0
                # never more than its tokens before the last one
                assert blocks.held(rid) <= blocks.blocks_for(it.request.input_len - 1)

    drive(policy, requests, check)
    assert all(r.state.value in ("finished", "rejected") for r in requests)
    assert policy.blocks.num_used == 0


class ChunkTokensPredictor:
    """An iteration takes as long as its chunk tokens (decodes cost nothing): a target of N
    cuts any chunk beside decodes to N tokens."""

    def predict(self, batch: BatchUnit, extra: BatchItem | None = None) -> float:
        items = batch.items + ([extra] if extra is not None else [])
        return float(sum(it.num_tokens for it in items if it.kind is not ItemKind.DECODE))


def test_a_cut_chunk_past_its_blocks_ends_where_they_end_then_the_rest_goes_last():
    """An embedding of 100 tokens in chunks of 64 is admitted with the blocks of its first 64;
    the target cuts its chunks to 24 beside a decode that takes the cache's last free block,
    so its third chunk ends where its blocks end (48..64) and the remaining 36 go whole, as the
    last chunk (which stores nothing): it completes holding the 4 blocks it was admitted with."""
    cfg = SchedulerConfig(token_budget=128, chunk_size=64, block_size=16, num_blocks=6,
                          tpot_target_s=24.0, min_chunk_tokens=8, tpot_slack_iterations=0)
    policy = make_policy("ibs", cfg, ChunkTokensPredictor())
    gen, emb = make_requests([("generation", 0, 15, 50), ("embedding", 0, 100, 0)])
    policy.add(gen)
    policy.complete(policy.schedule(0.0), 1.0)  # the prompt alone: no target without decodes
    policy.add(emb, 1.0)
    chunks, held, writes = [], [], []
    now = 1.0
    while emb.state is not RequestState.FINISHED:
        batch = policy.schedule(now)
        for it in batch.items:
            if it.request is emb:
                chunks.append((it.start, it.num_tokens))
                held.append(policy.blocks.held(emb.request_id))
                writes.append(policy.writes_kv(it))
        now += 1.0
        policy.complete(batch, now)
    assert chunks == [(0, 24), (24, 24), (48, 16), (64, 36)]
    assert held == [4, 4, 4, 4] and writes == [True, True, True, False]
    assert sum(policy.preemptions.values()) == 0


def test_a_waiting_embedding_cut_short_waits_for_the_blocks_of_its_first_piece():
    """A one-chunk embedding (40 tokens) needs no blocks, but cut to 24 by the target beside a
    decode it must store them: with no block free it waits (holding none) rather than store
    keys and values nowhere, and goes once the decode has finished and freed its blocks."""
    cfg = SchedulerConfig(token_budget=128, chunk_size=64, block_size=16, num_blocks=2,
                          tpot_target_s=24.0, min_chunk_tokens=8, tpot_slack_iterations=0)
    policy = make_policy("ibs", cfg, ChunkTokensPredictor())
    gen, emb = make_requests([("generation", 0, 16, 8), ("embedding", 0, 40, 0)])
    policy.add(gen)
    policy.complete(policy.schedule(0.0), 1.0)
    policy.add(emb, 1.0)
    now, first, waited = 1.0, None, 0
    while emb.state is not RequestState.FINISHED:
        batch = policy.schedule(now)
        mine = [it for it in batch.items if it.request is emb]
        if mine and first is None:
            first = (mine[0].num_tokens, gen.state)
        if not mine:
            waited += 1
            assert policy.blocks.held(emb.request_id) == 0
        now += 1.0
        policy.complete(batch, now)
    assert waited > 0 and first == (40, RequestState.FINISHED)  # no decode left: it goes whole
    assert policy.blocks.num_used == 0


def test_with_a_target_a_waiting_generation_weighs_its_output_by_default():
    """``waiting_work`` defaults to ``prompt`` (the brief's IBS) and to ``prompt+output`` where a
    target is set (the room beside decodes is small: weighed by prompts alone, generations'
    prompts get too little of it); an explicit choice stays. The scenario path resolves it the
    same way, per replica: a split's replicas run without the target, so by prompts."""
    import dataclasses

    from orthrus_sim.experiment.plan import plan_configuration
    from orthrus_sim.experiment.scenario import parse_scenario

    assert SchedulerConfig().counted_work == "prompt"
    assert SchedulerConfig(tpot_target_s=2.0).counted_work == "prompt+output"
    assert SchedulerConfig(tpot_target_s=2.0, waiting_work="prompt").counted_work == "prompt"
    # a copy given a target follows it (the default is not frozen into the copy), even when
    # the original had computed (and cached) its own
    base = SchedulerConfig()
    assert not base.count_waiting_output
    assert dataclasses.replace(base, tpot_target_s=2.0).count_waiting_output
    assert not base.count_waiting_output and base == SchedulerConfig()
    gen = ("generation", 0.0, 40, 30)  # 40 prompt tokens, 30 to generate
    plain = make_policy("ibs", SchedulerConfig(token_budget=256, chunk_size=128))
    targeted = make_policy("ibs", SchedulerConfig(token_budget=256, chunk_size=128,
                                                  tpot_target_s=5.0), RooflinePredictor())
    for policy, with_output in ((plain, False), (targeted, True)):
        req = make_requests([gen])[0]
        policy.add(req)
        assert policy.waiting_work() == (0, req.waiting_work(with_output))
    assert targeted.waiting_work()[1] > plain.waiting_work()[1] == 40
    sc = parse_scenario({"name": "t", "num_requests": 1, "cluster": {"gpus": 2},
                         "scheduler": {"tpot_target_s": 0.03},
                         "configurations": ["orthrus", "dedicated-1:1"]})
    assert sc.scheduler.waiting_work is None  # not chosen: the core resolves it
    assert {p.config.counted_work for p in plan_configuration(sc, "orthrus")} == {"prompt+output"}
    assert [p.config.counted_work for p in plan_configuration(sc, "dedicated-1:1")] == \
        ["prompt", "prompt"]
