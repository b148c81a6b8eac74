"""The cluster: replicas placed by the plan, the router, and KV transfer for Disagg-PD."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import simpy

from orthrus_sim.costmodel import get_hardware, get_model
from orthrus_sim.costmodel.factors import apply_factors
from orthrus_sim.engine.registry import make_policy
from orthrus_sim.engine.request import Request, RequestKind, RequestState
from orthrus_sim.experiment.plan import coefficients, cost_factors, plan_configuration
from orthrus_sim.experiment.scenario import Scenario
from orthrus_sim.sim.replica import Replica

ROLES_FOR = {
    RequestKind.EMBEDDING: ("unified", "embedding", "prefill"),
    RequestKind.GENERATION: ("unified", "generation", "prefill"),
}


class Cluster:
    """Replicas plus the router. ``on_done(request)`` fires when a request finished or was
    rejected; Disagg-PD hand-offs travel to a decode replica first."""

    def __init__(self, env: simpy.Environment, scenario: Scenario, name: str,
                 on_done: Callable[[Request], None], cost_factory=None,
                 fast_forward: bool = True) -> None:
        self.env = env
        self.name = name
        self.on_done = on_done
        self.router = scenario.cluster.router
        self.plans = plan_configuration(scenario, name)
        self.hardware = get_hardware(scenario.hardware)
        coeffs = coefficients(scenario)
        factors = cost_factors(scenario)

        def cost(plan):
            if cost_factory is not None:  # tests replace the roofline
                return cost_factory(plan.model, plan.lora)
            return apply_factors(plan.cost_model(self.hardware, coeffs), factors)

        self.replicas = [
            Replica(env, i, plan.role, make_policy(plan.policy, plan.config), cost(plan),
                    self._on_leave, fast_forward, factors)
            for i, plan in enumerate(self.plans)
        ]
        self._eligible = {
            kind: [r for r in self.replicas if r.role in roles] for kind, roles in ROLES_FOR.items()
        }
        self._decoders = [r for r in self.replicas if r.role == "decode"]
        self._rr = {key: itertools.count() for key in ("embedding", "generation", "decode")}
        model = get_model(scenario.model)
        self._kv_bytes_per_token = model.kv_bytes_per_token
        self._link_bw = self.hardware.interconnect_bw
        self.kv_transfers = 0
        self.kv_transfer_s = 0.0

    def _pick(self, candidates: list[Replica], key: str) -> Replica:
        if self.router == "least-work":
            return min(candidates, key=lambda r: (r.outstanding_work, r.index))
        return candidates[next(self._rr[key]) % len(candidates)]

    def submit(self, request: Request) -> None:
        candidates = self._eligible[request.kind]
        if not candidates:
            request.reject(f"configuration {self.name} has no replica serving "
                           f"{request.kind.value} requests")
            request.finished_at = self.env.now
            self.on_done(request)
            return
        self._pick(candidates, request.kind.value).submit(request)

    def _on_leave(self, request: Request, replica: Replica) -> None:
        if request.state is RequestState.WAITING:  # prefill done on a prefill replica
            self.env.process(self._transfer(request))
        else:
            self.on_done(request)

    def _transfer(self, request: Request):
        seconds = request.num_computed * self._kv_bytes_per_token / self._link_bw
        self.kv_transfers += 1
        self.kv_transfer_s += seconds
        yield self.env.timeout(seconds)
        self._pick(self._decoders, "decode").submit(request)

