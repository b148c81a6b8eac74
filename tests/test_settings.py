"""One definition per setting: every field of ``SchedulerConfig`` reaches every executor.

Each test walks ``dataclasses.fields(SchedulerConfig)``, so a field added to the core and not
carried somewhere (the scenario's scheduler section, the plan, the command line, the engines,
the vLLM plug-in's options) fails here by name.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from orthrus_real.engine.settings import (
    EXECUTOR_FIELDS,
    cli_config,
    executor_config,
    from_vllm_options,
    to_vllm_options,
)
from orthrus_sim.engine import SchedulerConfig
from orthrus_sim.engine import config as config_module
from orthrus_sim.experiment.plan import engine_plan, plan_configuration
from orthrus_sim.experiment.scenario import parse_scenario

DEFAULTS = SchedulerConfig()
FIELDS = [f.name for f in dataclasses.fields(SchedulerConfig)]
CARRIED = [n for n in FIELDS if n not in EXECUTOR_FIELDS]  # the executor sizes the others


def other_value(name: str):
    """A valid value of field ``name`` other than its default."""
    default = getattr(DEFAULTS, name)
    typ = typing.get_type_hints(SchedulerConfig)[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, str):  # a choice: another one of the module's tuple holding it
        choices = next(v for v in vars(config_module).values()
                       if isinstance(v, tuple) and default in v)
        return next(c for c in choices if c != default)
    if isinstance(default, int):
        return default + 1 if name != "chunk_size" else default // 2
    if isinstance(default, float):
        return default * 2 if default else 0.5
    args = typing.get_args(typ)
    if str in args:  # an optional choice (None: a default that follows another field)
        return getattr(config_module, f"{name.upper()}_MODES")[0]
    if int in args:
        return 1000 if name == "max_model_len" else 7
    if float in args:
        return 0.05
    raise AssertionError(f"test_settings: give a value for the new field {name!r} ({typ})")


def changed(name: str) -> SchedulerConfig:
    return dataclasses.replace(DEFAULTS, **{name: other_value(name)})


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_reaches_the_scenario_and_the_plan(name):
    raw = {"name": "x", "duration_s": 1, "scheduler": {name: other_value(name)}}
    sc = parse_scenario(raw)
    assert getattr(sc.scheduler, name) == other_value(name)
    cfg = plan_configuration(sc, "orthrus")[0].config
    assert getattr(cfg, name) == other_value(name)
    assert getattr(engine_plan(sc, "unified-hetero")[1], name) == other_value(name)
    # and a --set of it reaches it too
    sc = parse_scenario({"name": "x", "duration_s": 1},
                        overrides=[f"scheduler.{name}={other_value(name)}"])
    assert getattr(plan_configuration(sc, "orthrus")[0].config, name) == other_value(name)


def test_scenario_defaults_are_the_cores():
    sc = parse_scenario({"name": "x", "duration_s": 1})
    cfg = plan_configuration(sc, "orthrus")[0].config
    for name in CARRIED:
        if name != "max_model_len":
            assert getattr(cfg, name) == getattr(DEFAULTS, name), name


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_reaches_the_command_line(name):
    """``orthrus-real serve`` / ``calibrate`` without a scenario: defaults the core's, any field
    settable with --set scheduler.FIELD=VALUE."""
    from orthrus_real.cli import scheduler_settings

    assert scheduler_settings(None, None, [], "ibs")[1] == DEFAULTS
    policy, cfg = scheduler_settings(None, None, [f"scheduler.{name}={other_value(name)}"], "ibs")
    assert (policy, cfg) == ("ibs", changed(name))


def test_a_scenarios_calibration_serves_its_target(tmp_path):
    """``serve --scenario`` without --calibration: the scenario's calibration is the cost model
    its tpot target is predicted with (and --calibration, given, wins in cli.serve)."""
    import yaml

    from orthrus_real.cli import _settings

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "duration_s": 5, "calibration": "cpu-2core-small",
                                    "scheduler": {"tpot_target_s": 0.05},
                                    "configurations": ["orthrus"]}))
    policy, cfg, calibration = _settings(str(path), None, [], "ibs")
    assert cfg.tpot_target_s == 0.05 and calibration.endswith("cpu-2core-small.json")
    assert _settings(None, None, ["scheduler.tpot_target_s=0.05"], "ibs")[2] is None


def test_command_line_settings_errors_name_the_field():
    with pytest.raises(ValueError, match=r"did you mean 'scheduler\.kv_admission'"):
        cli_config(["scheduler.kv_admision=reserve"])
    with pytest.raises(ValueError, match=r"--set scheduler\.kv_admission=sometimes"):
        cli_config(["scheduler.kv_admission=sometimes"])
    with pytest.raises(ValueError, match="only scheduler.FIELD=VALUE"):
        cli_config(["cluster.gpus=2"])


@pytest.mark.parametrize("name", CARRIED)
def test_every_field_reaches_the_vllm_plug_in(name):
    """The bug of issue 25: kv_admission was not handed to vLLM (reserve ran as optimistic)."""
    cfg = changed(name)
    opts = to_vllm_options(cfg, "unified-hetero")
    policy, got = from_vllm_options(opts, block_size=32, num_blocks=99, max_model_len=2048,
                                    max_batched_tokens=8192, max_running=512)
    assert policy == "unified-hetero"
    assert getattr(got, name) == getattr(cfg, name)
    assert (got.block_size, got.num_blocks, got.max_model_len) == (32, 99, 2048)
    # vLLM stores every scheduled token's keys and values: the core's accounting follows it
    assert got.embedding_kv == "all"


def test_vllm_options_refuse_what_would_be_lost():
    with pytest.raises(ValueError, match="unknown or executor-owned option.*colour"):
        from_vllm_options({"colour": 1}, block_size=16, num_blocks=9, max_model_len=64,
                          max_batched_tokens=64, max_running=8)
    with pytest.raises(ValueError, match="token_budget .* exceeds vLLM's"):
        from_vllm_options({"token_budget": 128}, block_size=16, num_blocks=9, max_model_len=64,
                          max_batched_tokens=64, max_running=8)


@pytest.mark.parametrize("name", CARRIED)
def test_every_field_reaches_the_engines_policy(name):
    cfg = executor_config(changed(name), num_blocks=50, block_size=8, model_max_len=4096)
    assert getattr(cfg, name) == getattr(changed(name), name)
    assert (cfg.num_blocks, cfg.block_size) == (50, 8)


def test_torch_engine_runs_the_config_it_is_given(tiny_models):
    from orthrus_real.engine.torch_engine import Engine

    cfg = dataclasses.replace(DEFAULTS, **{n: other_value(n) for n in CARRIED})
    engine = Engine(tiny_models["llama"], scheduler=cfg, kv_cache_tokens=4096,
                    calibration="calibration/cpu-2core-small.json")  # the target predicts with it
    for name in CARRIED:
        assert getattr(engine.policy.config, name) == getattr(cfg, name), name
