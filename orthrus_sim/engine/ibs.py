"""IBS, the Intra-Batch Scheduler of Orthrus (brief §2.3): the ``ibs`` policy.

Smooth weighted round-robin between the embedding queue and the generation requests with prompt
work, the weights being each side's remaining token work (``we``, ``wg``) and the credits
persisting across iterations. Running decodes go first; admitted prompts (first prefills and
recomputes after a preemption) continue through the generation side's turns, not ahead of them.

Credits are charged in *tokens*: the side that schedules ``n`` tokens pays ``n``, and every side
that could have gone is paid ``n`` times its share of the weight. So the scheduled
embedding:generation token ratio follows ``we:wg`` to within one item, whatever the item sizes
(docs/scheduler.md has the argument), and a side that cannot progress is neither charged nor paid.
"""

from __future__ import annotations

from dataclasses import dataclass

from orthrus_sim.engine.batch import BatchUnit
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.iteration_target import IterationTimePredictor
from orthrus_sim.engine.policy import Policy
from orthrus_sim.engine.request import WAITING


@dataclass
class Credits:
    """The two IBS credits, in tokens, clamped to ``[-limit, limit]``."""

    embed: float = 0.0
    gen: float = 0.0
    limit: float = float("inf")

    def pick(self, embed_first_on_tie: bool) -> str:
        """The side to offer next: the larger credit; a tie goes by arrival ('e' or 'g')."""
        if self.embed != self.gen:
            return "e" if self.embed > self.gen else "g"
        return "e" if embed_first_on_tie else "g"

    def charge(self, side: str, tokens: int, we: float, wg: float,
               embed_able: bool, gen_able: bool) -> None:
        """``side`` scheduled ``tokens``: it pays them, and the sides able to go this turn are
        paid in proportion to their weights (so the credits' sum does not drift)."""
        embed, gen = self.embed, self.gen
        if side == "e":
            embed -= tokens
        else:
            gen -= tokens
        total = (we if embed_able else 0.0) + (wg if gen_able else 0.0)
        if total > 0:
            if embed_able:
                embed += tokens * we / total
            if gen_able:
                gen += tokens * wg / total
        lim = self.limit  # clamped to [-lim, lim], without min/max calls (this runs per item)
        self.embed = lim if embed > lim else -lim if embed < -lim else embed
        self.gen = lim if gen > lim else -lim if gen < -lim else gen


class IBSPolicy(Policy):
    """IBS: capacity in proportion to remaining work, FCFS inside each type, no HoL blocking."""

    name = "ibs"

    def __init__(self, config: SchedulerConfig | None = None,
                 predictor: IterationTimePredictor | None = None) -> None:
        super().__init__(config, predictor)
        self.credits = Credits(limit=float(self.config.token_budget))

    def _credits_view(self) -> dict[str, float]:
        return {"embedding": self.credits.embed, "generation": self.credits.gen}

    def fill(self, batch: BatchUnit, now: float) -> None:
        self.schedule_decodes(batch)
        we, wg = self.waiting_work()
        self._set_aside_for_embedding_head(we, wg)
        credits = self.credits
        if not we:
            credits.embed = 0.0  # a queue that empties starts afresh (brief §2.3)
        if not wg:
            credits.gen = 0.0
        embed_on = gen_on = True
        while True:
            emb = self.next_embedding() if embed_on else None
            gen = self.next_generation() if gen_on else None
            if emb is None and gen is None:
                return
            if gen is None:  # scheduling embeddings adds no generation: none comes later
                side, gen_on = "e", False
            elif emb is None:  # nor the other way round
                side, embed_on = "g", False
            else:
                side = credits.pick(embed_first_on_tie=emb.order < gen.order)
            if side == "e":
                used = self.schedule_embedding(batch, emb, now)
                embed_on = used > 0
            else:
                used = self.schedule_generation(batch, gen, now)
                gen_on = used > 0
            if used:
                credits.charge(side, used, we, wg, emb is not None, gen is not None)

    def _set_aside_for_embedding_head(self, we: int, wg: int) -> None:
        """KV by work share: while embeddings hold at most ``we/(we+wg)`` of the cache (and
        always for one head), the waiting embedding head's blocks are set aside before any
        generation admission of this iteration, so blocks that running requests free are not
        taken by new generations while it waits. Beyond that share it claims them on its turn
        only (``schedule_embedding`` holds them back when it is offered and refused). Decodes
        grow first and are never restricted: evicting a generation for an embedding's blocks
        cost ~7 % throughput in ``scenarios/kv_pressure.yaml`` (docs/scheduler.md)."""
        head = self.next_embedding()
        if head is None or head.state is not WAITING or self._embed_slots_full():
            return
        need = self.blocks.blocks_for(self.embed_kv_tokens(head))
        share = self.blocks.num_blocks * we / (we + wg)
        if self.embedding_blocks() + need <= max(share, need):
            self._hold_back(head.request_id, need)
