"""Pool the embedding rows of a mixed batch inside vLLM's model runner.

A stock vLLM engine runs either a pooling runner or a generation runner. ``PoolingRowsMixin``
keeps the generation runner (one forward pass over the whole packed batch, logits and sampling
for the generation rows) and adds the embedding half: after the forward pass it feeds each
embedding request's rows to the core's ``IncrementalPooler`` (running state across chunks, so
mean and CLS pooling work with chunked prefill, which vLLM's own poolers refuse), and in
``sample_tokens`` it returns the pooled vector of every embedding request whose last chunk ran,
with no sampled token, which is what vLLM's scheduler needs to finish a pooling request.

``worker.install`` mixes it into whichever runner class the worker built (CPU or GPU).
"""

from __future__ import annotations

import numpy as np

from orthrus_real.vllm_backend.scheduler import pooling_options
from orthrus_sim.engine import IncrementalPooler


class PoolingRowsMixin:
    """Mixed into vLLM's ``GPUModelRunner`` family (the CPU runner is a subclass)."""

    def _orthrus_init(self) -> None:
        self.orthrus_poolers: dict[str, IncrementalPooler] = {}
        self.orthrus_pooled: dict[str, object] = {}  # request id -> vector, this step
        self.orthrus_embedding_rows: list[str] = []  # embedding requests in this step

    def _update_states(self, scheduler_output):
        """Embedding requests enter the input batch as greedy one-token requests, so the
        sampler's per-row parameters stay consistent (a batch of pooling rows alone would
        otherwise be neither all-greedy nor all-random); their tokens are dropped."""
        for new in scheduler_output.scheduled_new_reqs:
            if new.pooling_params is not None and new.sampling_params is None:
                new.sampling_params = _greedy_placeholder()
        return super()._update_states(scheduler_output)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        out = super().execute_model(scheduler_output, intermediate_tensors)
        self.orthrus_pooled = {}
        self.orthrus_embedding_rows = []
        for rid in scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set()):
            self.orthrus_poolers.pop(rid, None)
        state = self.execute_model_state
        if state is None:
            return out
        start_of = _computed_before(scheduler_output)
        bounds = self.query_start_loc.np
        hidden = state.hidden_states
        for i, rid in enumerate(self.input_batch.req_ids):
            req = self.requests[rid]
            if req.pooling_params is None:
                continue
            n = scheduler_output.num_scheduled_tokens[rid]
            start = start_of[rid]
            pooler = self.orthrus_poolers.get(rid)
            if pooler is None or start == 0:  # first chunk, or recomputed after preemption
                pooler = IncrementalPooler(*pooling_options(req.pooling_params))
                self.orthrus_poolers[rid] = pooler
            pooler.update(hidden[int(bounds[i]):int(bounds[i + 1])])
            self.orthrus_embedding_rows.append(rid)
            if start + n >= len(req.prompt_token_ids):
                self.orthrus_pooled[rid] = pooler.result().float().cpu()
                del self.orthrus_poolers[rid]
        return out

    def sample_tokens(self, grammar_output):
        parked = self._park_discarded_generators()
        try:
            out = super().sample_tokens(grammar_output)
        finally:
            for i, (gen, state) in parked.items():
                gen.set_state(state)
                self.input_batch.generators[i] = gen
        if not self.orthrus_embedding_rows or not hasattr(out, "req_id_to_index"):
            return out
        pooled = list(out.pooler_output or [None] * len(out.req_ids))
        sampled = list(out.sampled_token_ids)
        for rid in self.orthrus_embedding_rows:
            idx = out.req_id_to_index[rid]
            if idx < len(sampled):
                sampled[idx] = []  # an embedding row never yields a token
            pooled[idx] = self.orthrus_pooled.get(rid)
        out.sampled_token_ids = sampled
        out.pooler_output = pooled
        self.orthrus_embedding_rows = []
        return out

    def _park_discarded_generators(self) -> dict:
        """A seeded request's row sampled in a partial prefill is discarded, and vLLM rewinds
        its generator with ``set_offset``, which CPU generators lack ("CPU Generator does not
        use offset"). On CPU, take those generators out of the batch for this step and restore
        their state afterwards: the same rewind."""
        if self.device.type != "cpu":
            return {}
        gens = self.input_batch.generators
        parked = {}
        for i in np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]:
            gen = gens.pop(int(i), None)
            if gen is not None:
                parked[int(i)] = (gen, gen.get_state())
        return parked


def _greedy_placeholder():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1)


def _computed_before(scheduler_output) -> dict[str, int]:
    """Tokens each scheduled request had in the KV cache before this step."""
    start = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    start.update(zip(cached.req_ids, cached.num_computed_tokens))
    return start
