"""The plan: how a scenario's configuration is placed on GPUs, which policy each replica runs,
with which ``SchedulerConfig``. The only such mapping: the simulator, ``orthrus-real validate``,
``bench`` and ``serve --scenario`` all use it.

Dedicated and disaggregated replicas run stock-server behaviour: atomic embeddings (no chunking,
as vLLM's pooling runner with mean pooling) and homogeneous FCFS batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orthrus_sim.costmodel import (
    Coefficients,
    CostModel,
    Hardware,
    LoRASpec,
    ModelSpec,
    get_hardware,
    get_model,
    kv_cache_blocks,
    load_calibration,
)
from orthrus_sim.costmodel.factors import apply_factors
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.registry import resolve_policy
from orthrus_sim.experiment.scenario import UNIFIED, Scenario, is_replan, is_unified, split_gpus


@dataclass(frozen=True)
class ReplicaPlan:
    """One GPU of a configuration."""

    role: str  # unified | embedding | generation | prefill | decode
    policy: str
    config: SchedulerConfig
    model: ModelSpec
    lora: LoRASpec | None  # the embedding adapter this replica applies to embedding rows

    @property
    def stock(self) -> bool:
        """A stock embedding server (a split's embedding GPU): the cost factors' stock terms
        are its alone."""
        return self.role == "embedding"

    def cost_model(self, hardware: Hardware, coefficients: Coefficients) -> CostModel:
        return CostModel(hardware, self.model, coefficients, self.lora)


def unified_policy(configuration: str, user_policy: str | None = None) -> str:
    """The policy every GPU of a unified configuration runs: ``orthrus`` is IBS (or the
    scenario's ``scheduler.policy``), ``unified-hetero``/``unified-homo`` their baselines,
    ``unified:<policy>`` that policy."""
    if configuration.startswith("unified:"):
        return configuration.split(":", 1)[1]
    if configuration == "orthrus":
        return user_policy or "ibs"
    if configuration in UNIFIED:
        return configuration
    raise ValueError(f"configuration {configuration!r} is not a unified one "
                     f"({', '.join(UNIFIED)}, unified:<policy>)")


def coefficients(scenario: Scenario) -> Coefficients:
    if scenario.calibration_file:
        return load_calibration(scenario.calibration_file).to_coefficients()
    return Coefficients()


def cost_factors(scenario: Scenario):
    """The calibration's fitted ``CostFactors`` (None: none, the cost model as calibrated)."""
    path = scenario.calibration_file
    return load_calibration(path).cost_factors() if path else None


def replica_cost(scenario: Scenario) -> Callable[[ReplicaPlan], CostModel]:
    """The cost model each replica of the scenario runs on: its plan's, with the calibration's
    coefficients and fitted factors (read once)."""
    hw, coeffs, factors = get_hardware(scenario.hardware), coefficients(scenario), \
        cost_factors(scenario)
    return lambda plan: apply_factors(plan.cost_model(hw, coeffs), factors, plan.stock)


def embedding_lora(scenario: Scenario) -> LoRASpec | None:
    e = scenario.embedding
    return LoRASpec(e.lora_rank, tuple(e.lora_targets)) if e.lora_rank else None


def plan_configuration(scenario: Scenario, name: str) -> list[ReplicaPlan]:
    """Which replica runs on each GPU for configuration ``name``."""
    hw = get_hardware(scenario.hardware)
    base = get_model(scenario.model)
    emb_model = get_model(scenario.embedding.model) if scenario.embedding.model else base
    lora = embedding_lora(scenario)
    sch = scenario.scheduler
    gpus = scenario.cluster.gpus
    factors = cost_factors(scenario)
    kv_scale = factors.kv_scale if factors is not None else 1.0

    def config(model: ModelSpec, adapter: LoRASpec | None, budget: int,
               chunk: int | None, target: float | None = None) -> SchedulerConfig:
        """The section's every field, with this replica's budget, chunking, KV blocks (the
        memory model's, times the calibration's ``kv_scale``, unless the scenario gives them)
        and the model's length limit; the
        iteration-time target only where given (unified replicas: a split's replicas run as
        the stock servers they stand for)."""
        blocks = sch.num_blocks or max(1, round(kv_scale * kv_cache_blocks(
            hw, model, sch.block_size, budget, sch.max_num_seqs,
            scenario.cluster.memory_utilization, adapter)))
        limit = base.max_position_embeddings
        return sch.config(token_budget=budget, chunk_size=chunk, num_blocks=blocks,
                          max_model_len=min(sch.max_model_len or limit, limit), tpot_target_s=target)

    if is_unified(name):
        policy = unified_policy(name, sch.policy)
        resolve_policy(policy)
        cfg = config(base, lora, sch.token_budget, sch.chunk_size, sch.tpot_target_s)
        return [ReplicaPlan("unified", policy, cfg, base, lora) for _ in range(gpus)]
    gen_budget = sch.generation_token_budget or sch.token_budget
    if is_replan(name):
        raise ValueError(f"configuration {name}: its split is changed by the simulator's "
                         "planner as it runs (sim/cluster.py); plan a split as dedicated-N:M")
    first, second = split_gpus(name, gpus)
    if name.startswith("dedicated"):
        emb_budget = sch.embedding_token_budget or sch.token_budget
        emb = ReplicaPlan("embedding", "embedding-only",
                          config(emb_model, None, emb_budget, None), emb_model, None)
        gen = ReplicaPlan("generation", "generation", config(base, None, gen_budget, None),
                          base, None)
        return [emb] * first + [gen] * second
    plans = [ReplicaPlan("prefill", "prefill-only", config(base, lora, sch.token_budget, None),
                         base, lora) for _ in range(first)]
    return plans + [ReplicaPlan("decode", "decode-only", config(base, None, gen_budget, None),
                                base, None) for _ in range(second)]


def dedicated_plans(scenario: Scenario) -> tuple[ReplicaPlan, ReplicaPlan]:
    """A dedicated split's embedding replica and generation replica (what a ``dedicated-replan``
    GPU runs in either role)."""
    gpus = scenario.cluster.gpus
    return (plan_configuration(scenario, f"dedicated-{gpus}:0")[0],
            plan_configuration(scenario, f"dedicated-0:{gpus}")[0])


def engine_plan(scenario: Scenario, configuration: str) -> tuple[str, SchedulerConfig]:
    """The policy and ``SchedulerConfig`` one real engine runs for a unified configuration
    (the engine then sizes ``num_blocks``, ``block_size`` and ``max_model_len`` to itself:
    ``EngineBase.executor_config``)."""
    if not is_unified(configuration):
        raise ValueError(f"configuration {configuration!r} needs several devices; one engine runs "
                         f"{', '.join(UNIFIED)} or unified:<policy>")
    plan = plan_configuration(scenario, configuration)[0]
    return plan.policy, plan.config
