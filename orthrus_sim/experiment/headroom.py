"""What co-serving can gain on a scenario's steady demand, predicted in a second without
simulating: every assignment the placement planner weighs (``k`` replicas decoding, the rest
embedding, with or without riders), the plan it takes, the best static split and the bound on
*any* placement of the replicas (``PlacementPlanner.bound``). ``orthrus-sim headroom`` prints
it. It answers "should I co-serve here, and what could I gain at most?" under the planner's
steady-state prediction; simulate the plan (``cluster.router: adaptive``) to measure it.

The demand is the scenario's default load at its mix: an open load's arrival rate per kind; a
closed loop's requests in flight per kind, from its clients (per-kind pools: the generation
share of them decode; a mixed pool: each kind in proportion to its share and its predicted
latency, by Little's law at the plan's latencies, iterated to a fixed point; think time
counted the same way). Phases, drift, pools, bursts and traces have no one steady mix and are
refused with the field to change."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from orthrus_sim.costmodel import get_hardware
from orthrus_sim.costmodel.factors import apply_factors
from orthrus_sim.experiment.placement import Bound, Demand, PlacementPlanner, Prediction
from orthrus_sim.experiment.plan import coefficients, cost_factors, plan_configuration
from orthrus_sim.experiment.routing import closed_loop, slo_bounds
from orthrus_sim.experiment.scenario import Arrival, Scenario

FIXED_POINT_ROUNDS = 30  # a mixed closed pool: in-flight counts <-> the plan's latencies


@dataclass(frozen=True)
class Headroom:
    scenario: str
    replicas: int
    target_s: float
    demand: Demand
    assignments: list[Prediction]  # every one the planner weighs
    plan: Prediction
    bound: Bound

    def as_dict(self) -> dict:
        return {"scenario": self.scenario, "replicas": self.replicas, "target_s": self.target_s,
                "demand": {k: v for k, v in vars(self.demand).items()},
                "assignments": [p.as_dict(self.replicas) for p in self.assignments],
                "plan": self.plan.as_dict(self.replicas), "bound": self.bound.as_dict()}


def scenario_planner(sc: Scenario) -> PlacementPlanner:
    """The planner the scenario's adaptive router would run: one unified replica's cost model
    (the calibration's factors applied) and scheduler config, ``cluster.gpus`` of them."""
    target = sc.scheduler.tpot_target_s
    if target is None:
        raise ValueError("scheduler.tpot_target_s: headroom needs the iteration-time target the "
                         "placement must hold (seconds; e.g. --set scheduler.tpot_target_s=0.03)")
    plan = plan_configuration(sc, "orthrus")[0]
    cost = apply_factors(plan.cost_model(get_hardware(sc.hardware), coefficients(sc)),
                         cost_factors(sc))
    replica = _Replica(cost, plan.config)
    return PlacementPlanner(replica, sc.cluster.gpus, sc.cluster.adaptive_pack * target,
                            slo_bounds(sc))


@dataclass(frozen=True)
class _PolicyConfig:
    config: Any


class _Replica:
    """What the planner reads of a replica: its cost model and its policy's config."""

    def __init__(self, cost: Any, config: Any) -> None:
        self.cost = cost
        self.policy = _PolicyConfig(config)


def _steady_arrival(sc: Scenario) -> Arrival:
    w = sc.workload
    for field, given in (("workload.phases", w.phases), ("workload.drift", w.drift),
                         ("workload.pools", w.pools), ("workload.burst", w.burst),
                         ("workload.trace", w.trace)):
        if given:
            raise ValueError(f"{field}: headroom weighs one steady mix; this load has none "
                             f"(drop {field} and give workload.generation_share)")
    if w.kind != "synthetic":
        raise ValueError(f"workload.kind: headroom weighs a synthetic load, not {w.kind!r}")
    arrival = w.arrival or Arrival()
    if arrival.process == "burst":
        raise ValueError("workload.arrival.process: headroom weighs a steady load, not 'burst'")
    return arrival


def scenario_demand(sc: Scenario, planner: PlacementPlanner) -> Demand:
    """The scenario's steady demand, as the adaptive router would observe it (module doc)."""
    arrival = _steady_arrival(sc)
    w = sc.workload
    share = w.generation_share
    lengths = dict(prompt_len=w.generation_prompt.mean, output_len=w.generation_output.mean,
                   embedding_len=w.embedding_input.mean)
    if not closed_loop(sc):
        return Demand(generation_rps=arrival.rate * share, embedding_rps=arrival.rate * (1 - share),
                      closed_loop=False, **lengths)
    clients = arrival.clients
    per_kind = arrival.pools == "per-kind"
    gen_clients = round(clients * share) if per_kind else clients * share
    emb_clients = clients - gen_clients
    d = Demand(generations=gen_clients, embeddings=emb_clients, **lengths)
    think = arrival.think_time_s
    if not think and per_kind:  # every client always has its request in flight
        return d
    for _ in range(FIXED_POINT_ROUNDS):
        p = planner.plan(d)
        lat = planner.latencies(p.assignment, d, p.embedding_rps, p.generation_rps, p.tpot_s)
        gen_s, emb_s = lat.get("e2e_s", 0.0), lat["latency_s"]
        if not (math.isfinite(gen_s) and math.isfinite(emb_s)):
            break
        if per_kind:  # each client in flight for its latency out of latency + think
            gens = gen_clients * gen_s / (gen_s + think) if gen_s + think > 0 else 0.0
            embs = emb_clients * emb_s / (emb_s + think) if emb_s + think > 0 else 0.0
        else:  # a mixed pool's clients spend their cycle in each kind by share x latency
            cycle = share * (gen_s + think) + (1 - share) * (emb_s + think)
            gens = clients * share * gen_s / cycle if cycle > 0 else gen_clients
            embs = clients * (1 - share) * emb_s / cycle if cycle > 0 else emb_clients
        d = replace(d, generations=gens, embeddings=embs)
    return d


def headroom(sc: Scenario) -> Headroom:
    """The planner's view of the scenario's steady demand (module doc)."""
    planner = scenario_planner(sc)
    d = scenario_demand(sc, planner)
    return Headroom(sc.name, planner.replicas, planner.target_s, d,
                    [planner.predict(a, d) for a in planner.candidates()], planner.plan(d),
                    planner.bound(d))
