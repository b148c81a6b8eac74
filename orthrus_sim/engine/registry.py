"""Choose a policy by name or by import path (``"package.module:ClassName"``).

The same string works in a scenario file, ``orthrus-real serve --policy`` and the vLLM plug-in.
"""

from __future__ import annotations

import importlib
import os
import sys

from orthrus_sim.engine.baselines import (
    DecodeOnlyPolicy,
    EmbeddingOnlyPolicy,
    GenerationPolicy,
    PrefillOnlyPolicy,
    UnifiedHeteroPolicy,
    UnifiedHomoPolicy,
)
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.ibs import IBSPolicy
from orthrus_sim.engine.iteration_target import IterationTimePredictor
from orthrus_sim.engine.policy import Policy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        IBSPolicy,
        UnifiedHeteroPolicy,
        UnifiedHomoPolicy,
        EmbeddingOnlyPolicy,
        GenerationPolicy,
        PrefillOnlyPolicy,
        DecodeOnlyPolicy,
    )
}


def _import_user_module(name: str):
    """Import ``name``; a user's module in the working directory is found too (a console
    script, unlike ``python -m``, does not put the working directory on ``sys.path``)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != name.split(".")[0] or cwd in sys.path:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(name)


def resolve_policy(spec: str | type[Policy]) -> type[Policy]:
    """The policy class for a built-in name or a ``module:Class`` path; ValueError otherwise."""
    if isinstance(spec, type):
        cls = spec
    elif not isinstance(spec, str) or not spec:
        raise ValueError(f"scheduler.policy must be a name or 'module:Class', got {spec!r}")
    elif spec in POLICIES:
        return POLICIES[spec]
    elif ":" not in spec:
        hint = " (the Orthrus configuration's scheduler, IBS, is 'ibs')" if spec == "orthrus" else ""
        raise ValueError(
            f"scheduler.policy: unknown policy {spec!r}{hint}; built-in policies are "
            f"{', '.join(POLICIES)}, or give an import path 'package.module:ClassName'"
        )
    else:
        module_name, _, attr = spec.partition(":")
        try:
            module = _import_user_module(module_name)
        except ImportError as exc:
            raise ValueError(
                f"scheduler.policy: cannot import module {module_name!r} ({exc})"
            ) from None
        cls = getattr(module, attr, None)
        if cls is None:
            raise ValueError(f"scheduler.policy: module {module_name!r} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(
            f"scheduler.policy: {spec!r} is not a subclass of orthrus_sim.engine.Policy"
        )
    return cls


def make_policy(spec: str | type[Policy], config: SchedulerConfig | None = None,
                predictor: IterationTimePredictor | None = None) -> Policy:
    """A policy by name or import path; ``predictor`` serves ``config.tpot_target_s``."""
    cls = resolve_policy(spec)
    if predictor is None:
        return cls(config or SchedulerConfig())
    return cls(config or SchedulerConfig(), predictor=predictor)
