"""Placement of the five configurations onto GPUs, the router, and KV transfer for Disagg-PD."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from orthrus_sim.costmodel import (
    Coefficients,
    CostModel,
    LoRASpec,
    get_hardware,
    get_model,
    kv_cache_blocks,
    load_calibration,
)
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.registry import make_policy
from orthrus_sim.engine.request import Request, RequestKind, RequestState
from orthrus_sim.scenario import Scenario, split_gpus
from orthrus_sim.sim.replica import Replica


@dataclass
class ReplicaPlan:
    role: str  # unified | embedding | generation | prefill | decode
    policy: str
    cost: object
    config: SchedulerConfig


def _coefficients(scenario: Scenario) -> Coefficients:
    if scenario.calibration:
        return load_calibration(scenario.calibration).to_coefficients()
    return Coefficients()


def unified_policy(configuration: str, user_policy: str | None = None) -> str:
    """The policy every GPU of a unified configuration runs: ``orthrus`` is IBS (or the
    scenario's ``scheduler.policy``), ``unified-hetero``/``unified-homo`` their baselines,
    ``unified:<policy>`` that policy."""
    if configuration.startswith("unified:"):
        return configuration.split(":", 1)[1]
    if configuration == "orthrus":
        return user_policy or "ibs"
    return configuration


def plan_configuration(scenario: Scenario, name: str, cost_factory=None) -> list[ReplicaPlan]:
    """Which replica runs on each GPU for configuration ``name``.

    Dedicated and disaggregated replicas run stock-server behaviour: atomic embeddings (no
    chunking, as vLLM's pooling runner with mean pooling) and homogeneous FCFS batches.
    ``cost_factory(model_spec, lora) -> cost`` replaces the roofline (tests use it).
    """
    hw = get_hardware(scenario.hardware)
    base = get_model(scenario.model)
    emb_model = get_model(scenario.embedding.model) if scenario.embedding.model else base
    lora = (LoRASpec(scenario.embedding.lora_rank, tuple(scenario.embedding.lora_targets))
            if scenario.embedding.lora_rank else None)
    coeffs = _coefficients(scenario)
    sch = scenario.scheduler
    gpus = scenario.cluster.gpus

    def cost(model, adapter):
        if cost_factory is not None:
            return cost_factory(model, adapter)
        return CostModel(hw, model, coeffs, adapter)

    def config(model, adapter, budget, chunk) -> SchedulerConfig:
        blocks = sch.num_blocks or kv_cache_blocks(hw, model, sch.block_size, budget,
                                                   sch.max_num_seqs,
                                                   scenario.cluster.memory_utilization, adapter)
        return SchedulerConfig(token_budget=budget, chunk_size=chunk, max_num_seqs=sch.max_num_seqs,
                               block_size=sch.block_size, num_blocks=blocks,
                               waiting_work=sch.waiting_work,
                               max_model_len=base.max_position_embeddings)

    if name in ("orthrus", "unified-hetero", "unified-homo") or name.startswith("unified:"):
        policy = unified_policy(name, sch.policy)
        chunk = sch.chunk_size
        return [ReplicaPlan("unified", policy, cost(base, lora),
                            config(base, lora, sch.token_budget, chunk)) for _ in range(gpus)]
    gen_budget = sch.generation_token_budget or sch.token_budget
    first, second = split_gpus(name, gpus)
    if name.startswith("dedicated"):
        n_emb, n_gen = first, second
        plans = [ReplicaPlan("embedding", "embedding-only", cost(emb_model, None),
                             config(emb_model, None, sch.token_budget, None)) for _ in range(n_emb)]
        plans += [ReplicaPlan("generation", "generation", cost(base, None),
                              config(base, None, gen_budget, None)) for _ in range(n_gen)]
        return plans
    n_pre, n_dec = first, second
    plans = [ReplicaPlan("prefill", "prefill-only", cost(base, lora),
                         config(base, lora, sch.token_budget, None)) for _ in range(n_pre)]
    plans += [ReplicaPlan("decode", "decode-only", cost(base, None),
                          config(base, None, gen_budget, None)) for _ in range(n_dec)]
    return plans


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
        self.plans = plan_configuration(scenario, name, cost_factory)
        self.replicas = [
            Replica(env, i, plan.role, make_policy(plan.policy, plan.config), plan.cost,
                    self._on_leave, fast_forward)
            for i, plan in enumerate(self.plans)
        ]
        self._eligible = {
            kind: [r for r in self.replicas if r.role in roles] for kind, roles in ROLES_FOR.items()
        }
        self._decoders = [r for r in self.replicas if r.role == "decode"]
        self._rr = {key: itertools.count() for key in ("embedding", "generation", "decode")}
        model = get_model(scenario.model)
        self._kv_bytes_per_token = model.kv_bytes_per_token
        self._link_bw = get_hardware(scenario.hardware).interconnect_bw
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

