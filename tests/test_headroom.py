"""The bound on any placement (``PlacementPlanner.bound``) and ``orthrus-sim headroom``: what
co-serving could gain over the best static split at most, under the planner's prediction."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from orthrus_sim.cli import app as sim_app
from orthrus_sim.costmodel import CostModel, LoRASpec, get_hardware, get_model
from orthrus_sim.engine import SchedulerConfig
from orthrus_sim.experiment.scenario import load_scenario
from orthrus_sim.questions.headroom import (
    _latencies,
    headroom,
    scenario_demand,
    scenario_planner,
)
from orthrus_sim.routing.placement import Assignment, Demand, PlacementPlanner, chunk_rate

COST = CostModel(get_hardware("a100-40gb"), get_model("mistral-7b-v0.1"), lora=LoRASpec(16))
runner = CliRunner()


def planner(target: float, replicas: int, blocks: int | None = None) -> PlacementPlanner:
    cfg = SchedulerConfig(token_budget=2048, chunk_size=512, tpot_target_s=target,
                          **({"num_blocks": blocks} if blocks else {}))
    return PlacementPlanner(SimpleNamespace(cost=COST, policy=SimpleNamespace(config=cfg)),
                            replicas, target)


@settings(max_examples=40, deadline=None)
@given(replicas=st.integers(2, 6), share=st.floats(0.05, 0.95), clients=st.integers(8, 600),
       target_ms=st.floats(15.0, 60.0), closed=st.booleans(), rate=st.floats(1.0, 400.0))
@example(replicas=2, share=0.95, clients=316, target_ms=30.0, closed=True, rate=1.0)  # > slots
def test_the_bound_is_at_least_every_assignment_the_planner_weighs(replicas, share, clients,
                                                                  target_ms, closed, rate):
    """Whatever the mix, cluster and target: no assignment the planner weighs (the static
    splits among them) is predicted above the bound on any placement, priced alike (the
    embedding side unmerged, as the planner prices it): the bound searches a superset. The 1 %
    allow for the planner's own steady state (a fractional count of decodes per replica, the
    riders' share of the room) against the bound's whole decodes and rider chunks."""
    p = planner(target_ms / 1e3, replicas)
    d = Demand(generations=round(clients * share), embeddings=clients - round(clients * share),
               generation_rps=rate * share, embedding_rps=rate * (1 - share), prompt_len=128,
               output_len=512, embedding_len=128, closed_loop=closed)
    b = p.bound(d, merged=False)
    held = [p.predict(a, d) for a in p.candidates()]
    held = [q for q in held if q.feasible]
    if not held:
        return
    assert math.isfinite(b.objective)
    for q in held:
        assert b.objective >= q.throughput * 0.99, (q, b)
    if math.isfinite(b.best_split):
        assert b.objective >= b.best_split * (1 - 1e-9)


def test_the_bound_holds_at_the_edges():
    """Fractional generations in flight (a mixed pool's, or with think time) count whole: the
    bound stays above the planner's plan; an all-decoding or all-embedding cluster is a split
    too (a one-kind load has no headroom over it); a split serving nothing gives no headroom
    (nan, not a division by zero)."""
    p = planner(0.03, 2)
    d = Demand(generations=0.4, embeddings=100, prompt_len=128, output_len=512, embedding_len=128)
    assert p.bound(d, merged=False).objective >= p.plan(d).throughput * 0.99
    only_gen = Demand(generations=64, embeddings=0, prompt_len=128, output_len=512)
    assert p.bound(only_gen).headroom == pytest.approx(1.0, abs=0.01)
    only_emb = Demand(generations=0, embeddings=64, embedding_len=128)
    assert p.bound(only_emb).headroom == pytest.approx(1.0)
    idle = p.bound(Demand(generations=0.2, embeddings=0, prompt_len=128, output_len=512))
    assert math.isnan(idle.headroom) or idle.headroom >= 1.0
    json.dumps(idle.as_dict())


def test_the_bound_is_the_best_of_every_placement_on_a_small_cluster():
    """Closed loop, embeddings asked for without end: the dynamic programme's bound equals the
    best of every placement enumerated (each replica embedding, or holding any number of the
    generations in flight and any rider chunks that fit), on 2 and 3 replicas."""
    for replicas, gens in ((2, 21), (3, 14)):
        p = planner(0.016, replicas)
        d = Demand(generations=gens, embeddings=10_000, prompt_len=128, output_len=512,
                   embedding_len=128)
        b = p.bound(d)
        options = p._replica_options(d)
        options[None] = [(0.0, chunk_rate(p.replica, 0, 0, None, 128, adapter=False) / 128, 0)]
        gen_ref = p._generation_reference(d)
        emb_ref = p._full_rate(128) / 128
        best = -math.inf
        for combo in itertools.product(options, repeat=replicas):
            if sum(n or 0 for n in combo) != gens:
                continue
            for fits in itertools.product(*(options[n] for n in combo)):
                best = max(best, sum(g / gen_ref + e / emb_ref for g, e, _ in fits))
        assert b.objective == pytest.approx(best, rel=1e-9)
        assert sum(n or 0 for n, _ in b.placement) == gens


MIX_SWEEP_STEP_MS = {0.1: 16.02, 0.5: 22.64, 0.9: 30.77}  # Dedicated-1:3's TPOT p50, simulated


def test_no_placement_serves_the_mix_sweep_5_percent_more_than_the_best_split():
    """The frontier's twelve points (shares 0.1 / 0.5 / 0.9, targets 1.25-3x the decode-only
    step): under the simulator's cost model no placement of the four replicas, however its
    decodes and riders are spread, serves 5 % more than the best static split (issue 33 asked
    a 1.05x median); at share 0.1 the split is the best there is."""
    heads = {}
    for share, step in MIX_SWEEP_STEP_MS.items():
        for x in (1.25, 1.5, 2.0, 3.0):
            sc = load_scenario("mix_sweep", [f"workload.generation_share={share}",
                                             f"scheduler.tpot_target_s={x * step / 1e3}"])
            heads[share, x] = headroom(sc).bound.headroom
    assert max(heads.values()) < 1.05
    assert statistics.median(heads.values()) < 1.01
    assert all(heads[0.1, x] == pytest.approx(1.0) for x in (1.25, 1.5, 2.0, 3.0))


def test_an_open_load_past_every_placement_is_said_so():
    """The generation-heavy capacity mix's 7 + 63 requests/s at a 45 ms target: five replicas'
    decode slots cannot hold it however they are placed, six can. The planner's own steady
    state agrees once its fixed point converges (six rounds predicted five decoding replicas
    holding 63 generations/s; they hold 58.5)."""
    got = {}
    for gpus in (5, 6):
        sc = load_scenario("capacity_mix", ["workload.generation_share=0.9",
                                            "workload.arrival.rate=70", f"cluster.gpus={gpus}",
                                            "scheduler.tpot_target_s=0.045",
                                            "configurations=[orthrus]"])
        got[gpus] = headroom(sc)
    assert got[5].bound.serves_demand is False and got[6].bound.serves_demand is True
    all_decoding = got[5].assignments[-2]
    assert all_decoding.assignment == Assignment(5, False)
    assert not all_decoding.feasible and all_decoding.generation_rps < 60


def test_a_mixed_closed_pools_demand_follows_the_latencies():
    """One mixed pool of closed-loop clients: each kind is in flight for its share of the
    clients' time, so generations (seconds each) hold most clients, not their share of the
    requests; per-kind pools hold their own clients."""
    sets = ["workload.generation_share=0.5", "scheduler.tpot_target_s=0.03"]
    mixed = load_scenario("mix_sweep", [*sets, "workload.arrival.pools=mixed"])
    p = scenario_planner(mixed)
    d = scenario_demand(mixed, p)
    assert d.generations + d.embeddings == pytest.approx(512, rel=1e-6)
    assert d.generations > 0.9 * 512
    # a fixed point: the latencies of the best plan serving both kinds give these counts back
    gen_s, emb_s = _latencies(p, d)
    assert 512 * 0.5 * gen_s / (0.5 * gen_s + 0.5 * emb_s) == pytest.approx(d.generations,
                                                                            rel=1e-4)
    split = load_scenario("mix_sweep", sets)
    assert scenario_demand(split, scenario_planner(split)).generations == 256


def test_headroom_command_prints_json_and_names_what_it_cannot_weigh():
    res = runner.invoke(sim_app, ["headroom", "mix_sweep", "--set",
                                  "workload.generation_share=0.5", "--set",
                                  "scheduler.tpot_target_s=0.0253", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert "derived, not fitted" in res.stderr  # the A100-40GB's calibration, said on stderr
    doc = json.loads(res.stdout)
    assert {"demand", "assignments", "plan", "bound"} <= set(doc)
    assert {"objective", "best_split", "headroom", "placement"} <= set(doc["bound"])
    assert doc["bound"]["headroom"] >= 1.0 and len(doc["assignments"]) == 9
    res = runner.invoke(sim_app, ["headroom", "mix_sweep", "--set",
                                  "scheduler.tpot_target_s=0.0253"])
    assert res.exit_code == 0 and "headroom" in res.output and "plan" in res.output
    res = runner.invoke(sim_app, ["headroom", "phased", "--set", "scheduler.tpot_target_s=0.03"])
    assert res.exit_code != 0 and "workload.phases" in res.output
    assert "Traceback" not in res.output
    res = runner.invoke(sim_app, ["headroom", "mix_sweep"])
    assert res.exit_code != 0 and "scheduler.tpot_target_s" in res.output
    res = runner.invoke(sim_app, ["headroom", "mix_sweep", "--set", "cluster.gpus=2", "--set",
                                  "configurations=[orthrus]", "--set", "workload.arrival.clients=1",
                                  "--set", "workload.arrival.pools=mixed", "--set",
                                  "workload.arrival.think_time_s=100", "--set",
                                  "workload.generation_share=1", "--set",
                                  "scheduler.tpot_target_s=0.03"])
    assert "Traceback" not in res.output and res.exception is None or isinstance(
        res.exception, SystemExit), res.output
