"""The paper's baseline policies and the single-type policies of dedicated/disaggregated replicas."""

from __future__ import annotations

from operator import attrgetter

from orthrus_sim.engine.batch import BatchUnit
from orthrus_sim.engine.policy import Policy
from orthrus_sim.engine.request import Request, RequestKind

_BOTH = (RequestKind.EMBEDDING, RequestKind.GENERATION)
_EMBEDDINGS, _GENERATIONS = (RequestKind.EMBEDDING,), (RequestKind.GENERATION,)
_READY = attrgetter("ready_since", "order")  # a request's place in Unified-Homo's FCFS


class UnifiedHeteroPolicy(Policy):
    """Mixed batches, one global FCFS order by arrival, no credits: decodes first, then new work
    strictly by arrival, stopping at the first request that cannot go (head-of-line blocking)."""

    name = "unified-hetero"

    def fill(self, batch: BatchUnit, now: float) -> None:
        self.schedule_running(batch)
        self.fill_fcfs(batch, now, _BOTH)


class UnifiedHomoPolicy(Policy):
    """Every iteration is all-embedding or all-generation.

    The side whose oldest ready request has waited longest goes first (a running decode is
    ready from the end of its last iteration), so the two sides alternate by FCFS; requests
    ready at the same time go by arrival order (neither kind is preferred). If the chosen side
    cannot schedule anything (memory full), the other side runs instead.

    The choice depends on the clock (every decode step makes the decodes ready later), so it is
    not ``clock_free``: the simulator's decode runs apply only while nothing waits.
    """

    name = "unified-homo"
    clock_free = False

    def fill(self, batch: BatchUnit, now: float) -> None:
        e_key = min(map(_READY, self._embeddings), default=None)
        g_key = self._generation_key()
        if e_key is None and g_key is None:
            return
        embed_first = g_key is None or (e_key is not None and e_key < g_key)
        for embed_side in ((True, False) if embed_first else (False, True)):
            if embed_side:
                self.fill_fcfs(batch, now, _EMBEDDINGS)
            else:
                self.schedule_running(batch)
                self.fill_fcfs(batch, now, _GENERATIONS)
            if batch:
                return

    def _generation_key(self) -> tuple | None:
        """The generation side's oldest ready request: the least ``(ready_since, order)`` of
        the running requests and the waiting head. The decode cohort gives its members' least
        key without writing their fields, when every running request is a member or prefills."""
        cohort, running, prefilling = self._cohort, self._running, self._prefilling
        if cohort is not None and len(cohort) + len(prefilling) == len(running):
            keys = list(map(_READY, prefilling))
            key = cohort.ready_key()
            if key is not None:
                keys.append(key)
        else:
            self._sync_cohort()  # the running decodes' ready times, as they stand
            keys = list(map(_READY, running))
        if self._waiting_gen:
            keys.append(_READY(self._waiting_gen[0]))
        return min(keys, default=None)


class EmbeddingOnlyPolicy(Policy):
    """A dedicated embedding server: FCFS over embedding requests (atomic if chunk_size is null)."""

    name = "embedding-only"
    serves = (RequestKind.EMBEDDING,)

    def fill(self, batch: BatchUnit, now: float) -> None:
        self.fill_fcfs(batch, now, _EMBEDDINGS)


class GenerationPolicy(Policy):
    """A dedicated generation server as vLLM runs it: decodes first, then chunked prefills FCFS."""

    name = "generation"
    serves = (RequestKind.GENERATION,)

    def fill(self, batch: BatchUnit, now: float) -> None:
        self.schedule_running(batch)
        self.fill_fcfs(batch, now, _GENERATIONS)


class PrefillOnlyPolicy(UnifiedHeteroPolicy):
    """Disaggregated prefill replica: prefills and whole embeddings, FCFS; a generation request
    leaves (state WAITING, KV to transfer) as soon as its first token is sampled."""

    name = "prefill-only"

    def _hands_off(self, request: Request) -> bool:
        return True


class DecodeOnlyPolicy(GenerationPolicy):
    """Disaggregated decode replica: takes requests whose prompt KV arrived from a prefill
    replica (``num_computed`` already set), reserves their blocks and decodes them."""

    name = "decode-only"
