"""The placement planner (orthrus_sim/experiment/placement.py) and the adaptive router over it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orthrus_sim.costmodel import CostModel, LoRASpec, get_hardware, get_model
from orthrus_sim.engine import SchedulerConfig
from orthrus_sim.experiment.placement import Assignment, Demand, PlacementPlanner
from orthrus_sim.experiment.scenario import load_scenario
from orthrus_sim.sim.run import simulate

COST = CostModel(get_hardware("a100-40gb"), get_model("mistral-7b-v0.1"), lora=LoRASpec(16))


def replica(target: float) -> SimpleNamespace:
    cfg = SchedulerConfig(token_budget=2048, chunk_size=512, tpot_target_s=target)
    return SimpleNamespace(cost=COST, policy=SimpleNamespace(config=cfg))


def decode_step(decodes: int) -> float:
    planner = PlacementPlanner(replica(1.0), 1, 1.0)
    return planner._time(decodes, decodes * 384, 0)


@settings(max_examples=60, deadline=None)
@given(replicas=st.integers(2, 8), share=st.floats(0.02, 0.98), clients=st.integers(8, 1024),
       target_x=st.floats(1.0, 4.0), closed=st.booleans(), rate=st.floats(0.5, 400.0))
def test_the_plan_is_never_below_a_static_split(replicas, share, clients, target_x, closed, rate):
    """Whatever the mix, cluster size and target: the planned assignment's predicted
    normalised throughput is at least every static split's that holds the target (the splits
    are among the assignments it weighs), and it holds the target whenever a split does."""
    target = target_x * decode_step(max(1, round(clients * share / replicas)))
    planner = PlacementPlanner(replica(target), replicas, target)
    demand = Demand(generations=clients * share, embeddings=clients * (1 - share),
                    generation_rps=rate * share, embedding_rps=rate * (1 - share),
                    prompt_len=128, output_len=512, embedding_len=128, closed_loop=closed)
    plan = planner.plan(demand)
    splits = [planner.predict(Assignment(k, False), demand) for k in range(1, replicas)]
    holding = [p for p in splits if p.feasible]
    if holding:
        assert plan.feasible
    for split in holding:
        assert plan.objective >= split.objective * (1 - 1e-9), (plan, split)


def test_hysteresis_keeps_the_current_plan_within_its_band():
    target = 2 * decode_step(64)
    planner = PlacementPlanner(replica(target), 4, target)
    demand = Demand(generations=256, embeddings=256, prompt_len=128, output_len=512)
    best = planner.plan(demand)
    others = [planner.predict(a, demand) for a in planner.candidates() if a != best.assignment]
    close = [p for p in others if p.feasible
             and p.objective >= best.objective / (1 + planner.HYSTERESIS)
             and p.tpot_s <= best.tpot_s / (1 - planner.HYSTERESIS)]
    far = [p for p in others if p.feasible and p.objective * (1 + planner.HYSTERESIS)
           < best.objective]
    assert far, "the test needs an assignment clearly worse than the best"
    for p in close:
        assert planner.plan(demand, p.assignment).assignment == p.assignment  # kept
    for p in far:
        assert planner.plan(demand, p.assignment).assignment == best.assignment  # left


def test_predicted_split_matches_the_simulated_split():
    """The planner's prediction of Dedicated-1:3 (its embedding side merged, as a dedicated
    embedding server runs) against the simulator's, on the mix sweep at share 0.5: TPOT and
    each kind's throughput within 10 %."""
    sc = load_scenario("scenarios/mix_sweep.yaml", ["duration_s=60", "warmup_s=20"])
    sim = simulate(sc, "dedicated-1:3", keep_rows=False).metrics
    target = sim["latency_s"]["tpot"]["p50"] * 1.25
    planner = PlacementPlanner(replica(target), 4, target)
    pred = planner.predict(Assignment(3, False), Demand(generations=256, embeddings=256,
                                                        prompt_len=128, output_len=512))
    assert pred.tpot_s == pytest.approx(sim["latency_s"]["tpot"]["p50"], rel=0.1)
    assert pred.generation_rps == pytest.approx(sim["throughput_rps"]["generation"], rel=0.1)
    merged = CostModel(get_hardware("a100-40gb"), get_model("mistral-7b-v0.1"))
    rate = PlacementPlanner(SimpleNamespace(cost=merged, policy=replica(target).policy), 4,
                            target)._full_rate(128) / 128
    assert rate == pytest.approx(sim["throughput_rps"]["embedding"], rel=0.1)


def test_adaptive_placement_is_not_below_the_best_split_and_logs_its_plans(tmp_path):
    """Simulated, on the mix sweep (share 0.1, a 1.5x target): the planner's normalised
    throughput is within 2 % of the best static split with a TPOT p99 no worse, or above it;
    its plans and role changes are in the results."""
    sets = ["duration_s=60", "warmup_s=20", "workload.generation_share=0.1"]
    splits = {c: simulate(load_scenario("scenarios/mix_sweep.yaml", sets), c,
                          keep_rows=False).metrics
              for c in ("dedicated-1:3", "dedicated-2:2", "dedicated-3:1")}
    ref = splits["dedicated-1:3"]
    emb_gpu = ref["throughput_rps"]["embedding"]
    gen_gpu = ref["throughput_rps"]["generation"] / 3

    def normalised(m):
        return m["throughput_rps"]["embedding"] / emb_gpu + m["throughput_rps"]["generation"] / gen_gpu

    target = 1.5 * ref["latency_s"]["tpot"]["p50"]
    sc = load_scenario("scenarios/mix_sweep.yaml", [*sets, "cluster.router=adaptive",
                                                    f"scheduler.tpot_target_s={target}"])
    m = simulate(sc, "orthrus", keep_rows=False).metrics
    tpot = m["latency_s"]["tpot"]["p99"]
    best = max(normalised(s) for s in splits.values() if s["latency_s"]["tpot"]["p99"] <= tpot)
    assert normalised(m) >= 0.98 * best
    plans = m["placement"]["plans"]
    assert plans and all({"time_s", "assignment", "objective", "demand"} <= set(p) for p in plans)
    assert m["placement"]["role_changes"]
    json.dumps(m["placement"])  # results.json carries it


def test_an_embedding_side_replica_runs_its_adapter_merged():
    """A replica told to merge prices embeddings without the adapter's rows, after one pass
    over the weights; a generation arriving unmerges it."""
    import simpy

    from orthrus_sim.engine import Request, RequestKind
    from orthrus_sim.engine.registry import make_policy
    from orthrus_sim.sim.replica import Replica

    def run(merge: bool) -> tuple[float, Replica]:
        env = simpy.Environment()
        cfg = SchedulerConfig(token_budget=2048, chunk_size=512)
        rep = Replica(env, 0, "unified", make_policy("ibs", cfg), COST, lambda r, _: None)
        if merge:
            rep.merge_adapter(True)
        for i in range(64):
            rep.submit(Request(f"e{i}", RequestKind.EMBEDDING, 0.0, 128))
        env.run()
        return rep.stats.busy_s, rep

    plain, _ = run(False)
    merged, rep = run(True)
    assert rep.merged and not rep.adapter
    assert 0 < COST.adapter_merge_s() < 0.05
    # 64 embeddings: the adapter's rows cost more than one merge; without it, ~9 % less time
    assert merged < plain and merged - COST.adapter_merge_s() < 0.93 * plain
    rep.submit(Request("g", RequestKind.GENERATION, rep.env.now, 16, max_output_tokens=4))
    assert not rep.merged and rep.adapter


def test_drift_is_a_seeded_random_walk_of_timed_phases():
    sc = load_scenario("scenarios/drift.yaml")
    shares = [p.generation_share for p in sc.workload.phases]
    assert len(shares) == 30 and sum(p.duration_s for p in sc.workload.phases) == 600
    assert all(0.1 - 1e-9 <= s <= 0.9 + 1e-9 for s in shares)
    assert all(abs(a - b) == pytest.approx(0.1) or a == b for a, b in zip(shares, shares[1:]))
    assert shares == [p.generation_share for p in load_scenario("scenarios/drift.yaml").workload.phases]
    other = load_scenario("scenarios/drift.yaml", ["seed=6"]).workload.phases
    assert [p.generation_share for p in other] != shares
    with pytest.raises(ValueError, match="drift"):
        load_scenario("scenarios/drift.yaml", ["workload.drift.low=0.6"])  # start below low
    with pytest.raises(ValueError, match="drift"):
        load_scenario("scenarios/drift.yaml", ["workload.phases=[{duration_s: 5, generation_share: 0.5}]"])
