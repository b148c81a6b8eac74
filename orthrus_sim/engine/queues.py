"""A replica's requests: the FCFS queues, the running set and the waiting-work bookkeeping.

The base of every policy (``Policy`` builds on it through ``KVAdmission``). The lists are the
policy's own; ``fill`` and observers read them through the views below (tuples, FCFS order).
"""

from __future__ import annotations

import bisect

from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.request import Request, RequestKind

EMBEDDING, GENERATION = RequestKind.EMBEDDING, RequestKind.GENERATION


def insert_in_order(queue: list[Request], request: Request) -> None:
    """Insert by FCFS key (arrival, then add order); appending is the common case."""
    if not queue or queue[-1].order <= request.order:
        queue.append(request)
    else:
        queue.insert(bisect.bisect_right(queue, request.order, key=lambda r: r.order), request)


class Queues:
    """Unfinished embeddings, waiting and running generations, every live request by id, and
    ``waiting_work`` (``we``, ``wg``) kept as requests come and go."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._embeddings: list[Request] = []  # unfinished embeddings, FCFS order
        self._waiting_gen: list[Request] = []  # generation requests holding no blocks, FCFS
        self._running: list[Request] = []  # generation requests holding blocks, admission order
        self._prefilling: list[Request] = []  # those of them with prompt work left
        self._holding: dict[str, Request] = {}  # every request holding blocks, admission order
        self._embeds_holding: dict[str, Request] = {}  # the embeddings among them
        self._requests: dict[str, Request] = {}  # every live request by id
        self._running_order: dict[str, int] = {}  # a running request's admission count
        self._admissions = 0
        # ``waiting_work`` of the requests holding no blocks, kept as they come and go so that
        # an iteration's cost does not grow with the queues (it is fixed while one waits)
        self._queued_work: dict[str, int] = {}
        self._queued_sum = {EMBEDDING: 0, GENERATION: 0}

    # ----- views ---------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self._embeddings or self._waiting_gen or self._running)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def get(self, request_id: str) -> Request | None:
        """The live request with this id (None once it finished, was aborted or left)."""
        self._sync_cohort()
        return self._requests.get(request_id)

    def holds_kv(self, request_id: str) -> bool:
        return request_id in self._holding

    def live(self) -> tuple[Request, ...]:
        """Every request queued or running here, in the order it was added."""
        self._sync_cohort()
        return tuple(self._requests.values())

    def embeddings(self) -> tuple[Request, ...]:
        """Unfinished embedding requests (waiting or in flight), FCFS."""
        return tuple(self._embeddings)

    def waiting_generations(self) -> tuple[Request, ...]:
        """Generation requests waiting for (re-)admission, FCFS."""
        return tuple(self._waiting_gen)

    def running_generations(self) -> tuple[Request, ...]:
        """Generation requests holding KV blocks (prefilling or decoding), admission order."""
        self._sync_cohort()
        return tuple(self._running)

    @property
    def num_running_generations(self) -> int:
        return len(self._running)

    def waiting_work(self) -> tuple[int, int]:
        """``we`` and ``wg`` of the brief: the remaining prompt work of the embedding queue
        and of the generation requests that still have prompt work (waiting or prefilling),
        each weighed by ``Request.waiting_work``."""
        count_output = self.config.count_waiting_output
        we = self._queued_sum[EMBEDDING]
        for r in self._embeds_holding.values():
            we += r.num_uncomputed
        wg = self._queued_sum[GENERATION]
        for r in self._prefilling:
            wg += r.waiting_work(count_output)
        return we, wg

    def _sync_cohort(self) -> None:
        """Bring the decode cohort's members' fields up to date before a view shows them
        (``SchedulingSteps`` has the cohort)."""

    # ----- bookkeeping -----------------------------------------------------------------------
    def _queue_work(self, request: Request) -> None:
        weight = request.waiting_work(self.config.count_waiting_output)
        self._queued_work[request.request_id] = weight
        self._queued_sum[request.kind] += weight

    def _unqueue_work(self, request: Request) -> None:
        weight = self._queued_work.pop(request.request_id, None)
        if weight is not None:
            self._queued_sum[request.kind] -= weight
