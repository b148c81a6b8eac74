"""The shared core: requests, the batch unit, KV accounting, the policies and the pooler.

Pure Python (stdlib, numpy at most): the simulator, the PyTorch engine and the vLLM plug-in all
import it unchanged.
"""

from orthrus_sim.engine.baselines import (
    DecodeOnlyPolicy,
    EmbeddingOnlyPolicy,
    GenerationPolicy,
    PrefillOnlyPolicy,
    UnifiedHeteroPolicy,
    UnifiedHomoPolicy,
)
from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.ibs import Credits, IBSPolicy
from orthrus_sim.engine.iteration_target import IterationTarget, IterationTimePredictor
from orthrus_sim.engine.kv_cache import BlockManager
from orthrus_sim.engine.policy import Policy, PolicySnapshot
from orthrus_sim.engine.pooler import IncrementalPooler, l2_normalize, pool
from orthrus_sim.engine.registry import POLICIES, make_policy, resolve_policy
from orthrus_sim.engine.request import POOLING_HEADS, Request, RequestKind, RequestState

__all__ = [
    "POLICIES", "POOLING_HEADS", "BatchItem", "BatchUnit", "BlockManager", "Credits",
    "DecodeOnlyPolicy", "EmbeddingOnlyPolicy", "GenerationPolicy", "IncrementalPooler",
    "IBSPolicy", "ItemKind", "IterationTarget",
    "IterationTimePredictor", "Policy", "PolicySnapshot", "PrefillOnlyPolicy", "Request", "RequestKind",
    "RequestState", "SchedulerConfig", "UnifiedHeteroPolicy", "UnifiedHomoPolicy",
    "l2_normalize", "make_policy", "pool", "resolve_policy",
]
