"""A user policy plugged in by import path (the README's worked example)."""

from orthrus_sim.engine import Policy


class ShortestEmbeddingFirst(Policy):
    """Decodes first, then embeddings shortest-first, then generation prompts FCFS."""

    name = "shortest-embedding-first"

    def _fill(self, batch, now):
        self._schedule_running(batch)
        for req in sorted(self.embed_queue, key=lambda r: r.num_uncomputed):
            self._embed_cursor = list(self.embed_queue).index(req)
            if self._schedule_embedding(batch, now) == 0:
                break
        while self._schedule_generation(batch, now):
            pass
