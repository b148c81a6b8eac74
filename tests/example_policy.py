"""A user policy plugged in by import path (the README's worked example)."""

from orthrus_sim.engine import Policy


class ShortestEmbeddingFirst(Policy):
    """Running work first, then embeddings shortest-first, then generation prompts FCFS."""

    name = "shortest-embedding-first"

    def fill(self, batch, now):
        self.schedule_running(batch)
        for req in sorted(self.embeddings(), key=lambda r: r.num_uncomputed):
            if self.schedule_embedding(batch, req, now) == 0:
                break
        for req in self.waiting_generations():
            if self.schedule_generation(batch, req, now) == 0:
                break
