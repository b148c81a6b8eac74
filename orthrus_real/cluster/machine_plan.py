"""The scenario's plan on this machine: the scenario as the simulator must see it (this model,
these devices, each engine's KV capacity) and the replicas that plan asks for, not yet started.
``orthrus-real serve --replicas``, its Ray Serve variant and ``orthrus-real validate`` all start
from here, so that what runs and what is simulated are the same plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orthrus_real.cluster.devices import parse_devices
from orthrus_real.cluster.replicas import Replica, check_configuration, plan_replicas
from orthrus_sim.experiment.plan import is_unified
from orthrus_sim.experiment.scenario import Scenario, parse_scenario, scenario_dump


@dataclass
class ClusterArgs:
    """What ``serve`` was given that shapes the cluster."""

    replicas: int | None
    configuration: str | None
    devices: str | None
    router: str | None
    threads: int
    adapter: str | None
    auto_restart: bool = False
    start_timeout: float = 300.0


def refuse_simulated_stop(scenario: Scenario) -> None:
    """A measured run is never stopped early: a scenario that stops its simulated run
    (``stop_below_attainment``) would compare a partial simulation with a whole measurement."""
    if scenario.stop_below_attainment is not None:
        raise ValueError("stop_below_attainment stops a simulated run once it fails; a measured "
                         "run is not stopped, so the two would not compare: drop it (--set "
                         "stop_below_attainment=null)")


def real_scenario(scenario: Scenario, model_dir: str, adapter_rank: int | None,
                  calibration: str | None, kv_cache_tokens: int, gpus: int = 1,
                  configurations: list[str] | None = None, router: str | None = None) -> Scenario:
    """The scenario as the simulator must see this machine: ``gpus`` devices (one engine
    each: a cluster of replicas when more than one) with the calibration's hardware entry,
    this model and adapter rank, each engine's KV capacity."""
    from orthrus_sim.costmodel import load_calibration

    refuse_simulated_stop(scenario)
    raw = scenario_dump(scenario)
    if configurations:
        raw["configurations"] = configurations
    bad = [c for c in raw["configurations"] if not is_unified(c)]
    if bad and gpus == 1:
        raise ValueError(f"configurations {bad} need several devices: one engine each (set "
                         "cluster.gpus, or use orthrus, unified-hetero, unified-homo or "
                         "unified:<policy>)")
    for c in bad:
        check_configuration(c)
    raw.update(model=model_dir)
    if calibration:
        raw.update(hardware=load_calibration(calibration).hardware,
                   calibration=str(Path(calibration).resolve()))
    raw["cluster"]["gpus"] = gpus
    if router:
        raw["cluster"]["router"] = router
    raw["embedding"]["lora_rank"] = adapter_rank
    raw["scheduler"]["num_blocks"] = kv_cache_tokens // raw["scheduler"]["block_size"]
    return parse_scenario(raw, "scenario (as validated on this machine)")


def make_replicas(scenario: Scenario, configuration: str, args: ClusterArgs,
                  replica_type=Replica, **extra) -> list[Replica]:
    """The replicas of the plan (not started), each with the cost model the simulator gives
    it (what the rules that predict read)."""
    import torch

    from orthrus_sim.costmodel import get_hardware
    from orthrus_sim.costmodel.factors import apply_factors
    from orthrus_sim.experiment.plan import coefficients, cost_factors

    devices = parse_devices(args.devices, scenario.cluster.gpus,
                            torch.cuda.device_count() if torch.cuda.is_available() else 0)
    specs = plan_replicas(scenario, configuration, devices, args.threads, args.adapter)
    hardware = get_hardware(scenario.hardware)
    coeffs, factors = coefficients(scenario), cost_factors(scenario)
    return [replica_type(s, cost=apply_factors(s.plan.cost_model(hardware, coeffs), factors),
                         **extra) for s in specs]
