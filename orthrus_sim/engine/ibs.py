"""Orthrus's Intra-Batch Scheduler (brief §2.3).

Smooth weighted round-robin between the embedding queue and the waiting-generation queue, the
weights being each queue's remaining token work and the credits persisting across iterations.
Running decodes (and in-flight prefills) are reserved first.
"""

from __future__ import annotations

from dataclasses import dataclass

from orthrus_sim.engine.batch import BatchUnit
from orthrus_sim.engine.policy import Policy


@dataclass
class Credits:
    """The two IBS credits. ``pick`` is one scheduling opportunity of smooth weighted RR."""

    embed: float = 0.0
    gen: float = 0.0

    def pick(self, we: float, wg: float, embed_ok: bool, gen_ok: bool) -> str:
        """Add the weights, choose a side, charge it the total weight; returns 'e' or 'g'."""
        self.embed += we
        self.gen += wg
        if not gen_ok or (embed_ok and self.embed >= self.gen):
            self.embed -= we + wg
            return "e"
        self.gen -= we + wg
        return "g"

    def undo(self, side: str, we: float, wg: float) -> None:
        """Take back an opportunity the chosen queue could not use (nothing was scheduled)."""
        if side == "e":
            self.embed += we + wg
        else:
            self.gen += we + wg
        self.embed -= we
        self.gen -= wg


class OrthrusPolicy(Policy):
    """IBS: capacity in proportion to remaining work, FCFS inside each type, no HoL blocking."""

    name = "orthrus"

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.credits = Credits()

    def _fill(self, batch: BatchUnit, now: float) -> None:
        self._schedule_running(batch)
        we, wg = self.waiting_work()
        if not self.embed_queue:
            self.credits.embed = 0.0
        if not self.gen_queue:
            self.credits.gen = 0.0
        embed_ok = bool(self.embed_queue)
        gen_ok = bool(self.gen_queue)
        while batch.budget_left > 0 and (embed_ok or gen_ok):
            side = self.credits.pick(we, wg, embed_ok, gen_ok)
            if side == "e":
                used = self._schedule_embedding(batch, now)
            else:
                used = self._schedule_generation(batch, now)
            if used == 0:
                # That queue cannot progress this iteration (budget, memory, sequence cap):
                # stop offering it, and do not let the failed turn move the credits.
                self.credits.undo(side, we, wg)
                if side == "e":
                    embed_ok = False
                else:
                    gen_ok = False
