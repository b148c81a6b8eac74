"""The PyTorch reference engine: the shared core's policy, one packed forward pass per
iteration, and the emit stage (sampler on generation rows, incremental pooler on embedding rows).

    engine = Engine("models/tiny", adapter_dir="models/tiny/adapter", policy="ibs")
    engine.add_embedding("e1", text="a query")
    engine.add_generation("g1", text="a prompt", params=SamplingParams(max_tokens=8))
    results = engine.run_until_idle()    # {request_id: RequestOutput}

Request intake, stop handling and outputs are ``EngineBase``'s (shared with the vLLM backend).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from orthrus_real.engine import paged_attention
from orthrus_real.engine.attention import KeptContexts, build_metadata
from orthrus_real.engine.base import EngineBase, RequestOutput, RequestRejected, _State, log
from orthrus_real.engine.cpu_gemm import PLAIN, choose_cpu_gemm, resolve_setting
from orthrus_real.engine.device import choose_device, choose_dtype, keep_large_cpu_buffers
from orthrus_real.engine.model import Decoder
from orthrus_real.engine.model_files import read_adapter, read_weights
from orthrus_real.engine.sampling import sample
from orthrus_real.engine.static_decode import StaticStep, default_buckets
from orthrus_sim.engine import BatchItem, BatchUnit, ItemKind, RequestState, SchedulerConfig

__all__ = ["Engine", "RequestOutput", "RequestRejected"]

ATTENTION = ("gather", "paged")


class Engine(EngineBase):
    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None,
                 policy: str = "ibs", scheduler: SchedulerConfig | None = None,
                 device: str | None = None, dtype: str | None = None,
                 kv_cache_tokens: int = 32768, calibration: str | None = None,
                 attention: str = "gather", cuda_graphs: bool | None = None,
                 static_step: bool | None = None,
                 static_buckets: tuple[int, ...] | None = None,
                 keep_decode_contexts: bool | None = None, cpu_gemm: str | None = None) -> None:
        """``attention``: gather (contexts copied out of the cache; the CPU default) or paged
        (the cache read in place, ``paged_attention.py``). ``static_step``: run decode-only
        and decode-heavy steps as fixed-shape functions (``static_decode.py``; needs paged
        attention), captured as CUDA graphs where ``cuda_graphs`` (default: on a CUDA device
        with paged attention). ``keep_decode_contexts``: keep the decodes' gathered contexts
        from step to step (``attention.KeptContexts``; default: on a CPU with the gathering
        path, unless ``ORTHRUS_KEEP_DECODE_CONTEXTS=0``). ``cpu_gemm``: the library of the fp32
        projections on a CPU (auto, mkl, onednn; ``cpu_gemm.py``)."""
        super().__init__(model_dir)
        if attention not in ATTENTION:
            raise ValueError(f"--attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
        self.device = choose_device(device)
        self.cpu_heap = keep_large_cpu_buffers() if self.device.type == "cpu" else None
        cfg = self._set_dtype(*choose_dtype(self.device, dtype, self.cfg.dtype))
        adapter = read_adapter(adapter_dir, cfg.num_layers) if adapter_dir else None
        if adapter is not None:
            self.adapter_name, self.adapter_rank = adapter.name, adapter.rank
        setting = resolve_setting(cpu_gemm)  # named even where it does not apply (bf16, CUDA)
        self.gemm = None  # bf16 or CUDA: PyTorch's own F.linear
        if self.device.type == "cpu" and cfg.dtype == torch.float32:
            self.gemm = choose_cpu_gemm(setting, cfg.hidden_size, 2 * cfg.intermediate_size)
        elif cpu_gemm not in (None, "auto"):
            log.info("--cpu-gemm %s: not used (it chooses fp32 projections on a CPU; this engine "
                     "runs %s on %s)", cpu_gemm, str(cfg.dtype).removeprefix("torch."), self.device)
        self.model = Decoder(cfg, read_weights(model_dir), self.device, adapter,
                             self.gemm or PLAIN)
        if adapter is not None and policy == "embedding-only":
            # every row is an embedding: serve the merged embedding model, as the plan of a
            # Dedicated split prices it (no adapter work per row)
            self.model.merge_adapter()
            self.adapter_merged = True
        base = scheduler or SchedulerConfig()
        if attention == "paged" and base.embedding_kv != "all":
            # the paged path reads every row's keys and values back from the cache, its own
            # included: an embedding's last chunk must be stored (and its blocks accounted)
            base = replace(base, embedding_kv="all")
        num_blocks = max(1, kv_cache_tokens // base.block_size)
        self._make_policy(policy, base, num_blocks, base.block_size, calibration)
        self.attention = attention
        # paged attention: one scratch block past the core's, where padding rows write
        self.cache_blocks = num_blocks + (attention == "paged")
        slots = self.cache_blocks * base.block_size
        self.caches = [  # per layer: (slot, K or V, kv head, head dim)
            torch.zeros(slots, 2, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, device=self.device)
            for _ in range(cfg.num_layers)
        ]
        self.static = self._static_step(cuda_graphs, static_step, static_buckets)
        if keep_decode_contexts is None:
            keep_decode_contexts = (self.device.type == "cpu" and attention == "gather"
                                    and os.environ.get("ORTHRUS_KEEP_DECODE_CONTEXTS", "1") != "0")
        if keep_decode_contexts and attention != "gather":
            raise ValueError("keep_decode_contexts keeps the gathering path's contexts: it needs "
                             "--attention gather")
        # at most as many kept tokens as the cache holds
        self.kept = KeptContexts(cfg.num_layers, slots) if keep_decode_contexts else None

    def _static_step(self, cuda_graphs: bool | None, static_step: bool | None,
                     buckets: tuple[int, ...] | None) -> StaticStep | None:
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"--cuda-graphs needs a CUDA device (this engine runs on "
                             f"{self.device})")
        if cuda_graphs is None:
            cuda_graphs = on_cuda and self.attention == "paged"
        if static_step is None:
            static_step = cuda_graphs
        if cuda_graphs and not static_step:
            raise ValueError("CUDA graphs capture the static step: static_step cannot be off "
                             "with --cuda-graphs")
        if not static_step:
            return None
        if self.attention != "paged":
            raise ValueError("the static step (and --cuda-graphs) needs --attention paged: the "
                             "gathering path's shapes change with every context length")
        c = self.scheduler_config
        return StaticStep(self.model, self.caches, self.cache_blocks, c.block_size,
                          buckets or default_buckets(c.token_budget), self.device, cuda_graphs)

    def describe(self) -> dict:
        info = super().describe()
        info["attention"] = self.attention
        if self.attention == "gather":
            info["decode_contexts"] = ("kept between steps" if self.kept is not None
                                       else "gathered every step")
        if self.cpu_heap:
            info["cpu_heap"] = self.cpu_heap
        if self.gemm is not None:
            info["cpu_gemm"] = self.gemm.describe()
        info["static_step"] = self.static.describe() if self.static else "off"
        return info

    def _seeded_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    # ----- one iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = self.now()
        batch = self.policy.schedule(start)
        if not batch:
            return []
        parts, culprits = self._run_isolated(batch.items)
        failed = [self._fail_request(item.request, exc) for item, exc in culprits]
        sampled: dict[str, int] = {}
        stopped: set[str] = set()
        for part, hidden, tokens in parts:
            self._commit(part, hidden, tokens, sampled, stopped)
        self.policy.complete(batch, self.now(), stopped)  # a failed request is skipped: aborted
        outputs = self._outputs(batch, sampled) + failed
        self._record(batch, start)
        if self.kept is not None and not self.has_work:
            self.kept.reset()  # idle: the kept contexts (a cache's worth at most) go back
        return outputs

    def _run_isolated(self, items: list[BatchItem]):
        """Forward and sample ``items``; if that raises, split them in halves and retry each
        (a bisection), so the items whose request makes the pass fail are found and everyone
        else's rows are computed. Rewriting an item's KV slots gives the same values, and no
        state is changed before a part succeeds. Returns ([(part, hidden, tokens)],
        [(culprit item, exception)])."""
        part = BatchUnit(self.scheduler_config.token_budget, items=list(items),
                         total_tokens=sum(it.num_tokens for it in items))
        try:
            return [(part, *self._compute(part))], []
        except Exception as exc:  # noqa: BLE001 - attributed below, logged by the caller
            if len(items) == 1:
                return [], [(items[0], exc)]
        half = len(items) // 2
        ok_a, bad_a = self._run_isolated(items[:half])
        ok_b, bad_b = self._run_isolated(items[half:])
        return ok_a + ok_b, bad_a + bad_b

    def forward(self, batch: BatchUnit) -> torch.Tensor:
        ids = []
        for item in batch.items:
            ids.extend(item.request.payload.tokens[item.start:item.end])
        tables, block_size = self.policy.blocks.tables, self.scheduler_config.block_size
        lora_rows = batch.token_slice(ItemKind.EMBED_CHUNK) if self.model.adapter else slice(0, 0)
        if self.static is not None and self.static.takes(batch, lora_rows):
            return self.static.run(batch, ids, tables)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.attention == "paged":
            meta = paged_attention.build(batch, tables, block_size, self.cache_blocks, self.device)
        else:
            meta = build_metadata(batch, tables, block_size, self.device, self.policy.writes_kv,
                                  self.kept)
        if self.kept is None or meta.kept is None:
            return self.model.forward(input_ids, meta, self.caches, lora_rows)
        try:
            hidden = self.model.forward(input_ids, meta, self.caches, lora_rows)
        except BaseException:
            self.kept.reset()  # some layers may have appended: gather afresh next step
            raise
        self.kept.commit()
        return hidden

    def _compute(self, batch: BatchUnit) -> tuple[torch.Tensor, list[int]]:
        """The forward pass and the sampled tokens of ``batch``'s sampling items, changing no
        request state (a seeded generator is put back if sampling raises)."""
        hidden = self.forward(batch)
        rows, states = [], []
        row = 0
        for item in batch.items:
            if item.samples:
                rows.append(row + item.num_tokens - 1)
                states.append(item.request.payload)
            row += item.num_tokens
        if not rows:
            return hidden, []
        saved = [(s.generator, s.generator.get_state()) for s in states if s.generator is not None]
        try:
            logits = self.model.logits(hidden[rows])  # sampled on the device: one transfer
            return hidden, sample(logits, [s.params for s in states], [s.generator for s in states])
        except Exception:
            for gen, state in saved:
                gen.set_state(state)
            raise

    def _commit(self, batch: BatchUnit, hidden: torch.Tensor, tokens: list[int],
                sampled: dict[str, int], stopped: set[str]) -> None:
        """Fold embedding rows into their poolers and take each sampling item's token (in
        item order), filling ``sampled`` and ``stopped``."""
        row = 0
        next_token = iter(tokens)
        for item in batch.items:
            state: _State = item.request.payload
            if item.kind is ItemKind.EMBED_CHUNK:
                if item.start == 0:
                    state.pooler.reset()  # first chunk, or recomputed after preemption
                state.pooler.update(hidden[row:row + item.num_tokens])
            elif item.samples:
                tok = next(next_token)
                sampled[item.request.request_id] = tok
                if self._take_token(item.request, state, tok):
                    stopped.add(item.request.request_id)
            row += item.num_tokens

    def _outputs(self, batch: BatchUnit, sampled: dict[str, int]) -> list[RequestOutput]:
        out = []
        for item in batch.items:
            req = item.request
            if req.state is RequestState.ABORTED:
                continue  # failed in this step (its output is the error)
            done = req.state is RequestState.FINISHED
            if req.is_embedding:
                if done:
                    out.append(self._embedding_output(req, req.payload.pooler.result()))
            elif req.request_id in sampled:
                out.append(self._generation_output(req, [sampled[req.request_id]], done))
        return out
