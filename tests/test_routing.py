"""The one router (orthrus_sim/routing/rules.py): round-robin, least-work, adaptive."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orthrus_sim.costmodel import CostModel, LoRASpec, get_hardware, get_model
from orthrus_sim.engine import Request, RequestKind, SchedulerConfig
from orthrus_sim.experiment.scenario import load_scenario
from orthrus_sim.routing.placement import Assignment
from orthrus_sim.routing.rules import AdaptivePlacement, Router, make_router
from orthrus_sim.sim.run import simulate

COST = CostModel(get_hardware("a100-40gb"), get_model("mistral-7b-v0.1"), lora=LoRASpec(16))
TARGET = 0.025


@dataclass
class FakePolicy:
    config: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(
        token_budget=2048, chunk_size=512, tpot_target_s=TARGET))


@dataclass
class FakeReplica:
    index: int
    role: str = "unified"
    outstanding_work: int = 0
    cost: CostModel = COST
    policy: FakePolicy = field(default_factory=FakePolicy)


def gen(i: int, at: float = 0.0) -> Request:
    return Request(f"g{i}", RequestKind.GENERATION, at, 128, max_output_tokens=512)


def emb(i: int, at: float = 0.0) -> Request:
    return Request(f"e{i}", RequestKind.EMBEDDING, at, 128)


def test_round_robin_alternates_per_kind_and_split_placements_route_by_kind():
    reps = [FakeReplica(0, "embedding"), FakeReplica(1, "generation"), FakeReplica(2, "generation")]
    router = Router(reps)
    assert [router.route(gen(i)).index for i in range(4)] == [1, 2, 1, 2]
    assert {router.route(emb(i)).index for i in range(3)} == {0}
    assert Router([FakeReplica(0, "embedding")]).route(gen(0)) is None
    with pytest.raises(ValueError, match="cluster.router"):
        Router(reps, "random")


def test_least_work_sends_work_to_the_idle_replica():
    reps = [FakeReplica(0, outstanding_work=500), FakeReplica(1, outstanding_work=0)]
    assert Router(reps, "least-work").route(emb(0)).index == 1


def test_adaptive_plans_a_split_for_the_demand_and_follows_it():
    """Embeddings queued everywhere and a light generation load: the plan gives generations
    one replica and embeddings the rest; a heavy generation load grows the decoding side once
    the larger side has been the better plan for ``DWELL_S``; when the generations leave, the
    side drains back to embedding."""
    reps = [FakeReplica(i) for i in range(4)]
    router = make_router("adaptive", reps, TARGET, closed_loop=True)
    for i in range(400):
        router.route(emb(i))
    placed = [router.route(gen(i, 1.0)).index for i in range(8)]
    assert router.plan.assignment.decoding == 1 and len(set(placed)) == 1
    decoding = placed[0]
    counts = [0] * 4
    for i in range(400, 460):  # new embeddings go to the embedding side
        counts[router.route(emb(i, 1.5)).index] += 1
    assert counts[decoding] == 0 and all(counts[i] for i in range(4) if i != decoding)
    more = [router.route(gen(100 + i, 2.0 + i / 50)).index for i in range(400)]
    assert router.plan.assignment.decoding > 1
    assert len(set(more)) == len(router.decoding()) >= router.plan.assignment.decoding
    for i in range(8):
        router.release(gen(i))
    for i in range(400):
        router.release(gen(100 + i))
    router.route(emb(998, 20.0))  # no generation in flight: a better plan, kept DWELL_S
    router.route(emb(999, 20.0 + router.DWELL_S))
    # at most one replica stays on the decoding side (generations arrived in the window),
    # with embeddings riding where its decodes would be
    assert router.decoding() == []
    assert router.plan.assignment.decoding == 0 or router.plan.assignment.riders
    assert [d["assignment"] for d in router.decisions][:2] == ["4:0", "3:1"]
    assert {c["role"] for c in router.role_changes} >= {"decoding"}


def test_adaptive_spreads_generations_when_no_embedding_waits():
    """With no embedding work, every replica decodes: each decode step is shorter."""
    reps = [FakeReplica(i) for i in range(4)]
    router = make_router("adaptive", reps, TARGET)
    assert {router.route(gen(i, i / 4)).index for i in range(40)} == {0, 1, 2, 3}


def test_adaptive_takes_the_embedding_side_in_turn_while_their_queues_tie():
    """Embedding replicas whose queues all go with their next iteration tie (counted in whole
    token budgets): embeddings go round them in turn, as a split's round-robin sends them,
    not all to the lowest index; one whose queue is a budget longer gets none until the
    others catch up. Turns are counted on the embedding side only."""
    reps = [FakeReplica(i) for i in range(3)]
    router = make_router("adaptive", reps, TARGET, closed_loop=True)
    for i in range(400):
        router.route(emb(i))
    router.route(gen(0, 1.0))  # one replica decodes; two embed
    side = [r.index for r in reps if r not in router.decoding()]
    assert len(side) == 2
    for i in range(400):
        router.release(emb(i))
    for i in range(5):  # less than a budget ahead on the first: all still go next iteration
        router._book(emb(500 + i, 1.1), reps[side[0]])
    turns = [router.route(emb(1000 + i, 1.1)).index for i in range(6)]
    assert turns == [side[0], side[1]] * 3 or turns == [side[1], side[0]] * 3
    for i in range(6):
        router.release(emb(1000 + i))
    for i in range(5):
        router.release(emb(500 + i))
    # a budget (2,048 tokens: 16 of 128) more on the first: the next ones go to the second
    for i in range(16):
        router._book(emb(2000 + i, 1.2), reps[side[0]])
    assert {router.route(emb(3000 + i, 1.2)).index for i in range(15)} == {side[1]}


def test_adaptive_needs_a_target():
    with pytest.raises(ValueError, match="tpot_target_s"):
        AdaptivePlacement([FakeReplica(0)], None)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["e", "g", "release"]), st.integers(0, 60)),
                min_size=1, max_size=200))
def test_adaptive_always_places_and_a_kind_with_work_has_a_replica(ops):
    """Whatever comes and goes, every request is placed on a replica, and while generations
    are placed some replica decodes them (no kind is left without a replica)."""
    reps = [FakeReplica(i) for i in range(3)]
    router = make_router("adaptive", reps, TARGET)
    live: dict[str, Request] = {}
    for op, i in ops:
        if op == "release":
            if live:
                router.release(live.pop(sorted(live)[i % len(live)]))
            continue
        req = gen(i) if op == "g" else emb(i)
        if req.request_id in live:
            continue
        assert router.route(req) in reps
        live[req.request_id] = req
        n_gens = sum(1 for r in live.values() if not r.is_embedding)
        assert bool(router.decoding()) == bool(n_gens)
        assert sum(router.load[r.index].generations for r in reps) == n_gens


def test_simulated_adaptive_placement_meets_the_target():
    sc = load_scenario("scenarios/mix_sweep.yaml", [
        "duration_s=30", "warmup_s=10", "workload.arrival.clients=96", "workload.arrival.ramp_s=5",
        "workload.generation_share=0.2", "workload.generation_output.value=64",
        f"scheduler.tpot_target_s={TARGET}", "scheduler.waiting_work=prompt+output",
        "cluster.router=adaptive"])
    m = simulate(sc, "orthrus", keep_rows=False).metrics
    assert m["latency_s"]["tpot"]["p99"] <= TARGET
    assert m["throughput_rps"]["embedding"] > 0 and m["throughput_rps"]["generation"] > 0
    rr = simulate(load_scenario("scenarios/mix_sweep.yaml", [
        "duration_s=30", "warmup_s=10", "workload.arrival.clients=96", "workload.arrival.ramp_s=5",
        "workload.generation_share=0.2", "workload.generation_output.value=64"]), "orthrus",
        keep_rows=False).metrics
    # the brief's IBS lets embedding chunks slow every decode: the target keeps them fast
    assert rr["latency_s"]["tpot"]["p99"] > TARGET


def test_adaptive_counts_arrival_rates_over_the_time_it_has_seen():
    """A second into a run, 200 embeddings are 200 per second, not 20 (the 10 s window is not
    full yet): planning on a tenth of the rate gave the decodes the embeddings' replicas."""
    router = make_router("adaptive", [FakeReplica(i) for i in range(4)], TARGET)
    for i in range(200):
        router.route(emb(i, i / 200))
    d = router.demand(1.0)
    assert d.embedding_rps == pytest.approx(200.0)
    later = make_router("adaptive", [FakeReplica(i) for i in range(4)], TARGET)
    for i in range(200):
        later.route(emb(i, 20.0 + i / 20))  # 200 over the last 10 s of a run 30 s old
    assert later.demand(30.0).embedding_rps == pytest.approx(20.0)


def test_a_burst_past_the_decoding_side_waits_instead_of_taking_an_embedding_replica():
    """No decoding replica has room for one more generation (its KV is booked to the final
    lengths), but the plan still holds, the replica would be within the burst slack past its
    KV, and a bigger decoding side would cost the embeddings more than the burst gains: the
    generation waits there, and the plan is not moved. Further past it, or with no embedding
    demand, the side grows as before."""
    from orthrus_sim.routing.rules import BURST_SLACK

    small = SchedulerConfig(token_budget=2048, chunk_size=512, tpot_target_s=TARGET,
                            num_blocks=808)  # 12,928 KV tokens: twenty 640-token generations
    reps = [FakeReplica(i, policy=FakePolicy(small)) for i in range(4)]
    router = make_router("adaptive", reps, TARGET)
    for i in range(2000):  # a heavy embedding load, over 10 s
        router.route(emb(i, i / 200))
    placed = [router.route(gen(i, 10.0 + i / 1000)) for i in range(20)]
    assert router.plan.assignment.decoding == 1 and len({r.index for r in placed}) == 1
    side = list(router.active)
    # a side of twenty: three Poisson sds of its count are 67 %, past the cap
    assert router._burst_slack(side, router.demand(10.03)) == BURST_SLACK == 0.10
    for i in (20, 21):  # the 21st is 4 %, the 22nd 9 % past the replica's KV: they wait
        assert router.route(gen(i, 10.03 + i / 1e4)) in side and list(router.active) == side
    assert not any(d.get("why") for d in router.decisions)
    router.route(gen(22, 10.04))  # the 23rd would be 14 % past: the side grows
    assert len(router.active) == 2
    assert router.decisions[-1]["why"] == "no decoding replica had room"
    # the same burst with no embeddings in flight: the side grows at once
    alone = make_router("adaptive", [FakeReplica(i, policy=FakePolicy(small)) for i in range(4)],
                        TARGET)
    for i in range(21):
        alone.route(gen(i, i / 1000))
    assert len(alone.decoding()) >= 2


def test_the_burst_slack_is_the_stray_of_the_sides_count_in_flight():
    """``NOISE_SD`` (3) Poisson sds of the side's capacity in generations, at most
    ``BURST_SLACK``: a side of four 256-slot replicas lets 9.4 % wait, one of two the cap's
    10 % (13 % uncapped), where a fixed 5 % grew a copied split for the noise of a steady
    stream's count in flight."""
    from orthrus_sim.routing.rules import BURST_SLACK

    roomy = SchedulerConfig(token_budget=2048, chunk_size=512, tpot_target_s=TARGET,
                            num_blocks=20_000)  # 256 slots each, KV for 500 generations
    reps = [FakeReplica(i, policy=FakePolicy(roomy)) for i in range(4)]
    router = make_router("adaptive", reps, TARGET)
    for i in range(50):
        router.route(gen(i, i / 100))
    d = router.demand(0.5)
    assert router.NOISE_SD == 3.0
    assert router._burst_slack(reps, d) == pytest.approx(3 / 1024 ** 0.5)
    assert router._burst_slack(reps[:2], d) == BURST_SLACK < 3 / 512 ** 0.5


def test_a_plan_failing_only_at_the_windows_count_is_kept():
    """An open load whose 10 s count of generations puts the current plan just past its
    slots (the count 2 % above where the plan stops holding, within three Poisson sds of it)
    keeps the plan: dropping it drains a replica for a generation's lifetime on noise. A count
    far above it (1.5x) moves the plan at once."""
    def stream(rate: float) -> AdaptivePlacement:
        reps = [FakeReplica(i) for i in range(4)]
        router = make_router("adaptive", reps, TARGET)
        n = round(rate * 10)
        arrivals = [emb(i, i / 200) for i in range(2000)] + [gen(i, i * 10 / n) for i in range(n)]
        for req in sorted(arrivals, key=lambda r: r.arrival_time):  # ~two replicas' embeddings
            router.route(req)
        return router

    probe = stream(1.0)
    a = probe.plan.assignment
    assert 1 <= a.decoding < 4
    d = probe.demand(10.0)

    def holds(rate: float) -> bool:
        return probe.planner.predict(a, replace(d, generation_rps=rate)).feasible

    lo, hi = 1.0, 1000.0  # the rate at which the plan stops holding
    assert holds(lo) and not holds(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    edge = lo
    probe._span = 10.0
    assert not holds(edge * 1.02) and probe._holds(a, replace(d, generation_rps=edge * 1.02))
    assert not probe._holds(a, replace(d, generation_rps=edge * 1.5))
    # the router's replan at such counts: 1.02x keeps the plan, 1.5x moves it at once
    for factor, stays in ((1.02, True), (1.5, False)):
        router = stream(1.0)
        router.plan = router.planner.predict(a, d)
        router.demand = lambda now, arriving=None, f=factor: replace(d, generation_rps=edge * f)
        router._span = 10.0
        router._replan(10.5)
        assert (router.plan.assignment == a) == stays, (factor, router.plan.assignment)


def test_a_copied_split_at_its_capacity_edge_serves_what_the_split_serves():
    """The embedding-heavy capacity mix at the highest rate Dedicated-2:2 serves within its SLOs
    (each embedding replica ~98 % busy): the planner copies the split and keeps it through the
    generations' Poisson strays (a 10 s count 1-2 sds high, a burst just past the decode
    slots), so the embeddings meet their SLO as the split's do. Dropping the copy for such a
    stray drained an embedding replica for 15 s and left 37 % of embeddings within 0.5 s.
    Seed 1, the scenario's: at this edge some other seeds' first plans still fail
    (docs/capacity.md), so another seed tests the start-up, not these rules."""
    over = ["seed=1", "workload.generation_share=0.1", "workload.arrival.rate=227.36",
            "scheduler.tpot_target_s=0.045", "cluster.router=adaptive"]
    m = simulate(load_scenario("scenarios/capacity_mix.yaml", over), "orthrus",
                 keep_rows=False).metrics
    split = simulate(load_scenario("scenarios/capacity_mix.yaml", over), "dedicated-2:2",
                     keep_rows=False).metrics
    assert {p["assignment"].split(" ")[0] for p in m["placement"]["plans"][1:]} == {"2:2"}
    assert not any(p.get("why") for p in m["placement"]["plans"])
    for kind in ("embedding", "generation"):
        assert m["slo"][kind]["attainment"] >= min(0.99, split["slo"][kind]["attainment"])


def test_a_side_grown_over_the_last_embedding_replica_lets_embeddings_ride():
    """Two replicas, one decoding and full past its burst slack: the side grows over the
    embedding replica, and the grown plan lets embeddings ride (the better of the two riders
    settings), so the embeddings in flight keep a replica to go to."""
    small = SchedulerConfig(token_budget=2048, chunk_size=512, tpot_target_s=TARGET,
                            num_blocks=808)  # twenty 640-token generations each
    reps = [FakeReplica(i, policy=FakePolicy(small)) for i in range(2)]
    router = make_router("adaptive", reps, TARGET)
    for i in range(20):  # a light embedding load: the embedding replica alone serves it
        router.route(emb(i, i / 2))
    router.route(gen(0, 10.0))
    router.plan = router.planner.predict(Assignment(1, False), router.demand(10.0))  # 1:1
    for i in range(1, 24):  # 20 fit; the 23rd is 14 % past
        router.route(gen(i, 10.0 + i / 1000))
    assert router.decisions[-1]["why"] == "no decoding replica had room"
    assert router.plan.assignment == Assignment(2, True)
    assert router.route(emb(5000, 10.05)) in router.active


def test_a_closed_loops_burst_keeps_the_fixed_slack():
    """The open-load noise rules leave a closed loop alone (its clients bound the count in
    flight; its demand is that count, not a rate): there a burst waits only within
    ``CLOSED_LOOP_BURST_SLACK`` (5 %) past a replica's KV, so the 21st generation (4 % past)
    waits and the 22nd (9 %) grows the side, where an open load lets it wait."""
    from orthrus_sim.routing.rules import CLOSED_LOOP_BURST_SLACK

    assert CLOSED_LOOP_BURST_SLACK == 0.05
    small = SchedulerConfig(token_budget=2048, chunk_size=512, tpot_target_s=TARGET,
                            num_blocks=808)  # twenty 640-token generations each
    grown = {}
    for closed in (True, False):
        reps = [FakeReplica(i, policy=FakePolicy(small)) for i in range(4)]
        router = make_router("adaptive", reps, TARGET, closed_loop=closed)
        for i in range(2000):
            router.route(emb(i, i / 200))
        for i in range(20):
            router.route(gen(i, 10.0 + i / 1000))
        side = list(router.active)
        assert len(side) == 1
        assert router.route(gen(20, 10.03)) in side and router.active == side  # 4 % past
        router.route(gen(21, 10.031))  # 9 % past
        grown[closed] = len(router.active) > 1
    assert grown == {True: True, False: False}


def test_capped_plans_are_weighed_only_where_clients_send_one_kind():
    """A cap leaves generations waiting for a slot: with clients split by kind (or an open
    load) that trades generations for embeddings the other clients send; in one mixed pool the
    waiting generations hold their clients, who send no embeddings meanwhile, so the planner
    does not weigh caps there (they churned and served less of both)."""
    from orthrus_sim.routing.rules import RouterRule

    per_kind = load_scenario("scenarios/mix_sweep.yaml", ["scheduler.tpot_target_s=0.03"])
    mixed = load_scenario("scenarios/mix_sweep.yaml", ["scheduler.tpot_target_s=0.03",
                                                       "workload.arrival.pools=mixed"])
    open_load = load_scenario("scenarios/capacity_mix.yaml", ["scheduler.tpot_target_s=0.045"])
    assert RouterRule.of(per_kind, 0.03).caps and RouterRule.of(open_load, 0.045).caps
    assert not RouterRule.of(mixed, 0.03).caps
    class Cappable(FakePolicy):
        def cap_running(self, cap):
            self.cap = cap

    reps = [FakeReplica(i, policy=Cappable()) for i in range(2)]
    assert make_router("adaptive", reps, 0.03).planner.can_cap
    assert not make_router("adaptive", reps, 0.03, caps=False).planner.can_cap
    assert not make_router("adaptive", [FakeReplica(i) for i in range(2)], 0.03).planner.can_cap
