"""``PolicySnapshot``: a read-only picture of one policy for observers (metrics, monitors,
tests), so that none of them reads the policy's queues."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from orthrus_sim.engine.kv_cache import BlockManager
from orthrus_sim.engine.request import Request


@dataclass(frozen=True)
class PolicySnapshot:
    policy: str
    embeddings_waiting: int  # not holding KV blocks yet
    embeddings_running: int  # holding blocks, chunks still to go
    generations_waiting: int  # not holding blocks (new or preempted)
    generations_running: int  # holding blocks: prefilling or decoding
    embedding_work: int  # ``we``: tokens IBS weighs the embedding queue with
    generation_work: int  # ``wg``
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_embedding: int  # of the used, those embeddings in flight hold
    credits: dict[str, float] | None  # IBS only
    preemptions: dict[str, int]  # recompute preemptions so far, by kind
    iterations: int
    budget_claim: str | None  # request whose tokens the next batch reserves

    @property
    def waiting(self) -> int:
        return self.embeddings_waiting + self.generations_waiting

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


class SnapshotSource(Protocol):
    """What a snapshot reads of a policy (``Policy`` is one): its views, never its queues."""

    name: str
    blocks: BlockManager
    preemptions: Mapping[str, int]
    iterations: int

    def waiting_work(self) -> tuple[int, int]: ...
    def embeddings(self) -> Sequence[Request]: ...
    def waiting_generations(self) -> Sequence[Request]: ...
    def running_generations(self) -> Sequence[Request]: ...
    @property
    def num_running_generations(self) -> int: ...
    def holds_kv(self, request_id: str) -> bool: ...
    def embedding_blocks(self) -> int: ...


def take_snapshot(policy: SnapshotSource, credits: dict[str, float] | None,
                  budget_claim: str | None) -> PolicySnapshot:
    we, wg = policy.waiting_work()
    embeddings = policy.embeddings()
    running_embed = sum(1 for r in embeddings if policy.holds_kv(r.request_id))
    return PolicySnapshot(
        policy=policy.name,
        embeddings_waiting=len(embeddings) - running_embed,
        embeddings_running=running_embed,
        generations_waiting=len(policy.waiting_generations()),
        generations_running=policy.num_running_generations,
        embedding_work=we, generation_work=wg,
        kv_blocks_used=policy.blocks.num_used, kv_blocks_total=policy.blocks.num_blocks,
        kv_blocks_embedding=policy.embedding_blocks(),
        credits=credits, preemptions=dict(policy.preemptions),
        iterations=policy.iterations, budget_claim=budget_claim,
    )
