"""What co-serving can gain on a scenario's steady demand, predicted in a second without
simulating: every assignment the placement planner weighs (``k`` replicas decoding, the rest
embedding, with or without riders), the plan it takes, the best static split and the bound on
*any* placement of the replicas (``routing.bound``). ``orthrus-sim headroom`` prints
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
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

from orthrus_sim.experiment.plan import plan_configuration, replica_cost
from orthrus_sim.experiment.scenario import Arrival, Scenario
from orthrus_sim.routing.bound import Bound, bound
from orthrus_sim.routing.placement import Demand, PlacementPlanner, Prediction
from orthrus_sim.routing.rules import RouterRule, closed_loop

DEMAND_ROUNDS = 100  # a closed loop with think time or one mixed pool: in flight <-> latencies
SETTLED = 1e-6  # relative change in the generations in flight that ends those rounds


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
                "demand": asdict(self.demand),
                "assignments": [p.as_dict(self.replicas) for p in self.assignments],
                "plan": self.plan.as_dict(self.replicas), "bound": self.bound.as_dict()}


def scenario_planner(sc: Scenario) -> PlacementPlanner:
    """The planner the scenario's adaptive router runs (``RouterRule.of``: its target, packing
    and objective): one unified replica's cost model and scheduler config, ``cluster.gpus`` of
    them."""
    if sc.scheduler.tpot_target_s is None:
        raise ValueError("scheduler.tpot_target_s: headroom needs the iteration-time target the "
                         "placement must hold (seconds; e.g. --set scheduler.tpot_target_s=0.03)")
    rule = RouterRule.of(sc, sc.scheduler.tpot_target_s)
    plan = plan_configuration(sc, "orthrus")[0]
    replica = SimpleNamespace(cost=replica_cost(sc)(plan), policy=SimpleNamespace(config=plan.config))
    # the simulator's replicas take a cap on their running generations (capped plans too) and
    # merge their adapter on the embedding side
    return PlacementPlanner(replica, sc.cluster.gpus, rule.pack * rule.target_s, rule.slo,
                            can_cap=rule.caps, merges=True)


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
    clients = {p.kind: p.clients for p in w.default_pools()}  # per kind, or one mixed pool
    think = arrival.think_time_s
    if "mixed" in clients:
        gens, embs = clients["mixed"] * share, clients["mixed"] * (1 - share)
    else:
        gens, embs = clients.get("generation", 0), clients.get("embedding", 0)
    d = Demand(generations=gens, embeddings=embs, **lengths)
    if not think and "mixed" not in clients:  # every client always has its request in flight
        return d
    for _ in range(DEMAND_ROUNDS):
        gen_s, emb_s = _latencies(planner, d)
        if "mixed" in clients:  # a mixed pool's clients spend their cycle in each kind
            cycle = share * (gen_s + think) + (1 - share) * (emb_s + think)
            n = clients["mixed"]
            new = replace(d, generations=n * share * gen_s / cycle,
                          embeddings=n * (1 - share) * emb_s / cycle)
        else:  # each client in flight for its latency out of latency + think
            new = replace(d, generations=clients.get("generation", 0) * gen_s / (gen_s + think),
                          embeddings=clients.get("embedding", 0) * emb_s / (emb_s + think))
        settled = abs(new.generations - d.generations) <= SETTLED * max(d.generations, 1.0)
        d = new
        if settled:
            return d
    raise ValueError("workload.arrival: the requests in flight of each kind did not settle "
                     f"within {DEMAND_ROUNDS} rounds of the plan's latencies; give the load as "
                     "per-kind pools (workload.arrival.pools=per-kind) or an open-loop rate")


def _latencies(planner: PlacementPlanner, d: Demand) -> tuple[float, float]:
    """(a generation's, an embedding's) mean latency under the best plan that serves every
    kind asked for: a plan that leaves one kind no throughput would hold its clients forever."""
    serving = [p for p in (planner.predict(a, d) for a in planner.candidates())
               if p.feasible and (p.generation_rps > 0 or not d.asks_generation)
               and (p.embedding_rps > 0 or not d.asks_embedding)]
    gen_s = emb_s = math.inf
    if serving:
        p = max(serving, key=lambda q: q.objective)
        lat = planner.latencies(p.assignment, d, p.embedding_rps, p.generation_rps, p.tpot_s)
        gen_s, emb_s = lat.get("e2e_s", 0.0), lat["latency_s"]
    if not (math.isfinite(gen_s) and math.isfinite(emb_s)):
        raise ValueError("scheduler.tpot_target_s: no assignment of the replicas serves both "
                         "kinds of this closed loop within the target")
    return gen_s, emb_s


def headroom(sc: Scenario) -> Headroom:
    """The planner's view of the scenario's steady demand (module doc)."""
    planner = scenario_planner(sc)
    d = scenario_demand(sc, planner)
    return Headroom(sc.name, planner.replicas, planner.target_s, d,
                    [planner.predict(a, d) for a in planner.candidates()], planner.plan(d),
                    bound(planner, d))
