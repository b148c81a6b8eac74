"""The scheduler settings a real executor runs, from one definition (``SchedulerConfig``).

Every field of ``SchedulerConfig`` reaches every executor: the command line builds the config
through the scenario's scheduler section (``--set scheduler.FIELD=VALUE`` for any field, the
defaults the core's), the engines take it whole, and the vLLM plug-in receives it whole in
``additional_config["orthrus"]``. An executor sizes only ``EXECUTOR_FIELDS`` to itself.
"""

from __future__ import annotations

from dataclasses import fields, replace

from orthrus_sim.engine import SchedulerConfig

# what an executor decides (its KV cache, its block size, its model's length limit, which
# keys and values its attention stores: the PyTorch engine runs the config's embedding_kv, the
# vLLM plug-in "all", since vLLM's attention writes the KV of every token it schedules)
EXECUTOR_FIELDS = ("num_blocks", "block_size", "max_model_len", "embedding_kv")
FIELD_NAMES = tuple(f.name for f in fields(SchedulerConfig))


def executor_config(config: SchedulerConfig, num_blocks: int, block_size: int,
                    model_max_len: int) -> SchedulerConfig:
    """``config`` with the executor's KV capacity and block size; the length limit is the
    config's, capped by the model's."""
    return replace(config, num_blocks=num_blocks, block_size=block_size,
                   max_model_len=min(config.max_model_len or model_max_len, model_max_len))


def cli_config(overrides: list[str] = ()) -> SchedulerConfig:
    """The config of ``--set scheduler.FIELD=VALUE`` overrides (a command line's knobs come as
    such too), every other field the core's default; an error names the override."""
    from orthrus_sim.experiment.scenario import SchedulerSection, apply_overrides

    for item in overrides:
        if not item.partition("=")[0].strip().startswith("scheduler."):
            raise ValueError(f"--set {item!r}: without --scenario only scheduler.FIELD=VALUE "
                             f"applies (fields: {', '.join(FIELD_NAMES)})")
    raw = apply_overrides({"scheduler": {}}, list(overrides))
    return SchedulerSection.validated(raw["scheduler"], "scheduler settings",
                                      [("--set", o) for o in overrides]).config()


def to_vllm_options(config: SchedulerConfig, policy: str) -> dict:
    """``additional_config["orthrus"]``: the policy and every field but the executor's."""
    return {"policy": policy, **{name: getattr(config, name) for name in FIELD_NAMES
                                 if name not in EXECUTOR_FIELDS}}


def from_vllm_options(opts: dict, *, block_size: int, num_blocks: int, max_model_len: int,
                      max_batched_tokens: int, max_running: int) -> tuple[str, SchedulerConfig]:
    """The policy and config the plug-in runs: the options handed over, vLLM's own figures for
    what the executor decides; an unknown option is an error (it would be lost)."""
    unknown = sorted(set(opts) - {"policy", *FIELD_NAMES} | set(opts) & set(EXECUTOR_FIELDS))
    if unknown:
        raise ValueError(f"additional_config.orthrus: unknown or executor-owned option(s) "
                         f"{', '.join(unknown)}; it takes policy and "
                         f"{', '.join(n for n in FIELD_NAMES if n not in EXECUTOR_FIELDS)}")
    values = {k: v for k, v in opts.items() if k != "policy"}
    budget = values.setdefault("token_budget", max_batched_tokens)
    if budget > max_batched_tokens:
        raise ValueError(f"additional_config.orthrus.token_budget ({budget}) exceeds vLLM's "
                         f"max_num_batched_tokens ({max_batched_tokens})")
    values.setdefault("max_num_seqs", max_running)
    chunk = values.get("chunk_size", SchedulerConfig().chunk_size)
    values["chunk_size"] = None if chunk is None else min(chunk, budget)
    values["embedding_kv"] = "all"  # vLLM allocates and writes every scheduled token's KV
    config = executor_config(SchedulerConfig(**values, num_blocks=num_blocks), num_blocks,
                             block_size, max_model_len)
    return opts.get("policy", "ibs"), config
