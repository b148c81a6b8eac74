"""The cluster: replicas placed by the plan, the router, and KV transfer for Disagg-PD."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import simpy

from orthrus_sim.costmodel import CostModelPredictor, get_hardware, get_model
from orthrus_sim.engine.registry import make_policy
from orthrus_sim.engine.request import Request, RequestState
from orthrus_sim.experiment.plan import cost_factors, dedicated_plans, plan_configuration, replica_cost
from orthrus_sim.experiment.scenario import Scenario, is_replan, split_gpus
from orthrus_sim.routing.replan import ReplanningSplit, initial_split, split_planner
from orthrus_sim.routing.rules import RouterRule, closed_loop
from orthrus_sim.sim.front_end import FrontEnd
from orthrus_sim.sim.replica import Replica


def placement_log(router) -> dict | None:
    """The adaptive router's plans and role changes over the run (None for other rules)."""
    if not hasattr(router, "decisions"):
        return None
    return {"plans": router.decisions, "role_changes": router.role_changes,
            "demand": router.demand_log}


class Cluster:
    """Replicas plus the router. ``on_done(request)`` (set before the run starts) fires when a
    request finished or was rejected; Disagg-PD hand-offs travel to a decode replica first."""

    def __init__(self, env: simpy.Environment, scenario: Scenario, name: str,
                 on_done: Callable[[Request], None] | None, cost_factory=None,
                 fast_forward: bool = True) -> None:
        self.env = env
        self.name = name
        self.on_done = on_done
        self.hardware = get_hardware(scenario.hardware)
        factors = cost_factors(scenario)
        priced = replica_cost(scenario)
        # a shared front end: every request pays its overhead there, one at a time for the
        # cluster, before it is routed; the replicas then have none of their own
        shared = factors is not None and scenario.cluster.front_end == "shared"
        stock = name.startswith("dedicated")  # its embeddings go to a stock embedding server
        self._front = FrontEnd(env, lambda kind: factors.overhead_s(kind, stock), self._route) \
            if shared else None

        def cost(plan):
            if cost_factory is not None:  # tests replace the roofline
                return cost_factory(plan.model, plan.lora)
            return priced(plan)

        def policy(plan, model):
            # an iteration-time target is predicted by the very cost model the replica runs on
            predictor = CostModelPredictor(model) if plan.config.tpot_target_s is not None else None
            return make_policy(plan.policy, plan.config, predictor)

        def replica(i, plan):
            model = cost(plan)
            return Replica(env, i, plan.role, policy(plan, model), model, self._on_leave,
                           fast_forward, factors, not shared)

        if is_replan(name):
            self._replanning(scenario, cost, policy, replica)
        else:
            self.plans = plan_configuration(scenario, name)
            self.replicas = [replica(i, plan) for i, plan in enumerate(self.plans)]
            unified = self.plans[0].config if self.plans else None
            self.router = RouterRule.of(scenario, unified.tpot_target_s if unified else None
                                        ).make(self.replicas)
        model = get_model(scenario.model)
        self._kv_bytes_per_token = model.kv_bytes_per_token
        self._link_bw = self.hardware.interconnect_bw
        self.kv_transfers = 0
        self.kv_transfer_s = 0.0

    def _replanning(self, scenario: Scenario, cost, policy, replica) -> None:
        """``dedicated-replan``: from the split the planner picks for the nominal demand (or
        the one named, ``dedicated-replan-E:G``), routed by the re-planning split, each role
        change priced by ``cluster.role_change_s``."""
        gpus = scenario.cluster.gpus
        roles = dict(zip(("embedding", "generation"), dedicated_plans(scenario)))
        gen = roles["generation"]
        model = cost(gen)
        reference = SimpleNamespace(index=0, cost=model, policy=policy(gen, model))
        planner = split_planner(reference, gpus, scenario)
        given = split_gpus(self.name, gpus)
        k = given[1] if given else initial_split(planner, scenario)
        self.plans = [roles["embedding"]] * (gpus - k) + [gen] * k
        self.replicas = [replica(i, plan) for i, plan in enumerate(self.plans)]
        pause = scenario.cluster.role_change_s

        def switch(rep: Replica, role: str) -> None:
            plan = roles[role]
            model = cost(plan)
            rep.change_role(role, policy(plan, model), model, pause,
                            lambda r: self.router.ready(r, self.env.now))

        self.router = ReplanningSplit(self.replicas, planner, switch, closed_loop(scenario),
                                      pause)

    def submit(self, request: Request) -> None:
        if self._front is not None:
            self._front.submit(request)
            return
        self._route(request)

    def _route(self, request: Request) -> None:
        replica = self.router.route(request)
        if replica is None:
            request.reject(f"configuration {self.name} has no replica serving "
                           f"{request.kind.value} requests")
            request.finished_at = self.env.now
            self.on_done(request)
            return
        replica.submit(request)

    def _on_leave(self, request: Request, replica: Replica) -> None:
        self.router.release(request)
        if request.state is RequestState.WAITING:  # prefill done on a prefill replica
            self.env.process(self._transfer(request))
        else:
            self.on_done(request)

    def _transfer(self, request: Request):
        seconds = request.num_computed * self._kv_bytes_per_token / self._link_bw
        self.kv_transfers += 1
        self.kv_transfer_s += seconds
        yield self.env.timeout(seconds)
        self.router.hand_off(request).submit(request)

