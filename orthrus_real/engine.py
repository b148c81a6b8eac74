"""The PyTorch reference engine: the shared core's policy, one packed forward pass per
iteration, and the emit stage (sampler on generation rows, incremental pooler on embedding rows).

    engine = Engine("models/tiny", adapter_dir="models/tiny/adapter", policy="ibs")
    engine.add_embedding("e1", text="a query")
    engine.add_generation("g1", text="a prompt", params=SamplingParams(max_tokens=8))
    results = engine.run_until_idle()    # {request_id: RequestOutput}

The emit stage (``emit``) depends only on hidden states and the batch unit, so other executors
(the vLLM plug-in) reuse it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from orthrus_real.attention import build_metadata
from orthrus_real.model import Decoder
from orthrus_real.model_files import DTYPES, read_adapter, read_config, read_weights
from orthrus_real.sampling import SamplingParams, sample
from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.engine import (
    BatchUnit,
    IncrementalPooler,
    ItemKind,
    Policy,
    Request,
    RequestKind,
    RequestState,
    SchedulerConfig,
    make_policy,
)


class RequestRejected(ValueError):
    """The engine will never serve this request (the reason names the problem)."""


@dataclass
class RequestOutput:
    request_id: str
    kind: str
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_text: str = ""
    embedding: list[float] | None = None
    finish_reason: str | None = None  # stop | length | abort
    prompt_tokens: int = 0


@dataclass
class IterationStats:
    iteration: int
    start_s: float
    seconds: float
    embed_tokens: int
    prefill_tokens: int
    decodes: int
    total_tokens: int
    token_budget: int
    kv_usage: float
    lora_rows: int
    shape: BatchShape  # what the cost model needs of this batch (for calibration)
    admitted: list[tuple[str, float]] = field(default_factory=list)  # (kind, admission wait s)


@dataclass
class _State:
    """Engine-side state of one request (kept in ``Request.payload``)."""

    tokens: list[int]
    params: SamplingParams | None = None
    pooler: IncrementalPooler | None = None
    generator: torch.Generator | None = None
    text: str = ""
    emitted_text: str = ""  # the part of ``text`` already sent in outputs
    finish_reason: str | None = None


class Engine:
    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None,
                 policy: str = "ibs", scheduler: SchedulerConfig | None = None,
                 device: str | None = None, dtype: str | None = None,
                 kv_cache_tokens: int = 32768) -> None:
        cfg = self._open(model_dir, dtype)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        adapter = read_adapter(adapter_dir, cfg.num_layers) if adapter_dir else None
        self.adapter_name = adapter.name if adapter else None
        self.adapter_rank = adapter.rank if adapter else None
        self.model = Decoder(cfg, read_weights(model_dir), self.device, adapter)
        base = scheduler or SchedulerConfig()
        block_size = base.block_size
        num_blocks = max(1, kv_cache_tokens // block_size)
        self.scheduler_config = replace(
            base, num_blocks=num_blocks,
            max_model_len=min(base.max_model_len or cfg.max_model_len, cfg.max_model_len))
        self.policy: Policy = make_policy(policy, self.scheduler_config)
        slots = num_blocks * block_size
        self.caches = [  # per layer: (slot, K or V, kv head, head dim)
            torch.zeros(slots, 2, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, device=self.device)
            for _ in range(cfg.num_layers)
        ]

    def _open(self, model_dir: str | Path, dtype: str | None):
        """Read config.json and tokenizer.json (shared with the vLLM backend)."""
        self.model_dir = Path(model_dir)
        cfg = read_config(model_dir)
        if dtype:
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
            cfg = type(cfg)(**{**cfg.__dict__, "dtype": DTYPES[dtype]})
        self.cfg = cfg
        tok_path = self.model_dir / "tokenizer.json"
        if not tok_path.exists():
            raise ValueError(f"{model_dir}: tokenizer.json is missing")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        self.stats: deque[IterationStats] = deque(maxlen=100_000)
        self.iterations = 0
        self._t0 = time.monotonic()
        self.counters = {f"{k}_{s}": 0 for k in ("embedding", "generation")
                         for s in ("completed", "rejected", "aborted")}
        return cfg

    # ----- requests --------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self._t0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def _tokens(self, token_ids, text, name: str) -> list[int]:
        if (token_ids is None) == (text is None):
            raise ValueError(f"{name}: give exactly one of text or token ids")
        ids = self.encode(text) if text is not None else list(token_ids)
        if not ids:
            raise ValueError(f"{name}: the input is empty")
        vocab = self.cfg.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}: token ids must be integers in [0, {vocab}), got {bad[0]!r}")
        return ids

    def _submit(self, req: Request, kind: str) -> Request:
        if not self.policy.add(req, self.now()):
            self.counters[f"{kind}_rejected"] += 1
            raise RequestRejected(req.reject_reason)
        return req

    def add_embedding(self, request_id: str, token_ids: list[int] | None = None,
                      text: str | None = None, pooling: str = "mean",
                      normalize: bool = True) -> Request:
        ids = self._tokens(token_ids, text, "input")
        limit = self.scheduler_config.max_model_len
        if len(ids) > limit:
            self.counters["embedding_rejected"] += 1
            raise RequestRejected(f"input has {len(ids)} tokens, more than the model's maximum "
                                  f"length {limit}")
        req = Request(request_id, RequestKind.EMBEDDING, self.now(), len(ids), token_ids=ids,
                      pooling=pooling, normalize=normalize, adapter=self.adapter_name)
        req.payload = _State(tokens=ids, pooler=IncrementalPooler(pooling, normalize))
        return self._submit(req, "embedding")

    def add_generation(self, request_id: str, token_ids: list[int] | None = None,
                       text: str | None = None, params: SamplingParams | None = None) -> Request:
        params = params or SamplingParams()
        ids = self._tokens(token_ids, text, "prompt")
        limit = self.scheduler_config.max_model_len
        if len(ids) + params.max_tokens > limit:
            self.counters["generation_rejected"] += 1
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's maximum length {limit}")
        req = Request(request_id, RequestKind.GENERATION, self.now(), len(ids),
                      max_output_tokens=params.max_tokens, token_ids=ids)
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        req.payload = _State(tokens=list(ids), params=params, generator=gen)
        return self._submit(req, "generation")

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._drop(request_id)
        if req is None:
            return None
        self.counters[f"{req.kind.value}_aborted"] += 1
        return RequestOutput(request_id, req.kind.value, True, finish_reason="abort",
                             token_ids=req.payload.tokens[req.input_len:], text=req.payload.text,
                             prompt_tokens=req.input_len)

    def _drop(self, request_id: str) -> Request | None:
        return self.policy.abort(request_id, self.now())

    @property
    def has_work(self) -> bool:
        return self.policy.has_work

    # ----- one iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = self.now()
        batch = self.policy.schedule(start)
        if not batch:
            return []
        hidden = self.forward(batch)
        sampled, stopped = self.emit(batch, hidden)
        self.policy.complete(batch, self.now(), stopped)
        outputs = self._outputs(batch, sampled)
        self._record(batch, start)
        return outputs

    def forward(self, batch: BatchUnit) -> torch.Tensor:
        ids = []
        for item in batch.items:
            ids.extend(item.request.payload.tokens[item.start:item.end])
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        meta = build_metadata(batch, self.policy.blocks.tables, self.scheduler_config.block_size,
                              self.device)
        lora_rows = batch.token_slice(ItemKind.EMBED_CHUNK)
        return self.model.forward(input_ids, meta, self.caches, lora_rows)

    def emit(self, batch: BatchUnit, hidden: torch.Tensor) -> tuple[dict[str, int], set[str]]:
        """Pool embedding rows, sample generation rows that reached their end; returns the
        sampled token per request and the requests that hit a stop condition."""
        rows, items = [], []
        row = 0
        for item in batch.items:
            state: _State = item.request.payload
            if item.kind is ItemKind.EMBED_CHUNK:
                if item.start == 0:
                    state.pooler.reset()  # first chunk, or recomputed after preemption
                state.pooler.update(hidden[row:row + item.num_tokens])
            elif item.samples:
                rows.append(row + item.num_tokens - 1)
                items.append(item)
            row += item.num_tokens
        sampled: dict[str, int] = {}
        stopped: set[str] = set()
        if not rows:
            return sampled, stopped
        logits = self.model.logits(hidden[rows]).cpu()
        states = [it.request.payload for it in items]
        tokens = sample(logits, [s.params for s in states], [s.generator for s in states])
        for item, state, tok in zip(items, states, tokens):
            sampled[item.request.request_id] = tok
            if self._take_token(item.request, state, tok):
                stopped.add(item.request.request_id)
        return sampled, stopped

    def _take_token(self, req: Request, state: _State, tok: int) -> bool:
        """Append a sampled token and update the text; True if it hit a stop (EOS, a stop id
        or a stop string). Sets ``finish_reason`` once the request has ended either way."""
        state.tokens.append(tok)
        p = state.params
        stop = (not p.ignore_eos and tok in self.cfg.eos_token_ids) or tok in p.stop_token_ids
        if stop:
            state.finish_reason = "stop"
        if p.stop or not stop:
            text = self.tokenizer.decode(state.tokens[req.input_len:], skip_special_tokens=True)
            for s in p.stop:
                at = text.find(s)
                if at >= 0:
                    text = text[:at]
                    state.finish_reason = "stop"
                    stop = True
                    break
            state.text = text
        if state.finish_reason is None and len(state.tokens) - req.input_len >= req.max_output_tokens:
            state.finish_reason = "length"
        return stop

    def _outputs(self, batch: BatchUnit, sampled: dict[str, int]) -> list[RequestOutput]:
        out = []
        for item in batch.items:
            req = item.request
            state: _State = req.payload
            done = req.state is RequestState.FINISHED
            if req.is_embedding:
                if done:
                    vec = state.pooler.result()
                    self.counters["embedding_completed"] += 1
                    out.append(RequestOutput(req.request_id, "embedding", True,
                                             embedding=vec.float().cpu().tolist(),
                                             prompt_tokens=req.input_len))
            elif req.request_id in sampled:
                generated = state.tokens[req.input_len:]
                prev_text, state.emitted_text = state.emitted_text, state.text
                if done:
                    self.counters["generation_completed"] += 1
                out.append(RequestOutput(
                    req.request_id, "generation", done, new_token_ids=[sampled[req.request_id]],
                    token_ids=list(generated), text=state.text,
                    new_text=state.text[len(prev_text):], prompt_tokens=req.input_len,
                    finish_reason=state.finish_reason if done else None))
        return out

    def _record(self, batch: BatchUnit, start: float) -> None:
        comp = batch.composition()
        self.iterations += 1
        admitted = [(it.request.kind.value, it.request.admitted_at - it.request.arrival_time)
                    for it in batch.items
                    if it.request.admitted_at is not None and it.request.admitted_at >= start]
        self.stats.append(IterationStats(
            self.iterations, start, self.now() - start, comp["embed_tokens"], comp["prefill_tokens"],
            comp["decodes"], batch.total_tokens, batch.token_budget, self.policy.blocks.usage,
            comp["embed_tokens"] if self.adapter_name else 0,
            BatchShape.from_batch(batch, adapter=self.adapter_name is not None), admitted))

    def close(self) -> None:
        """Release what the engine holds outside this process (nothing, for this one)."""

    def run_until_idle(self, max_steps: int = 1_000_000) -> dict[str, RequestOutput]:
        final: dict[str, RequestOutput] = {}
        for _ in range(max_steps):
            if not self.has_work:
                return final
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        raise RuntimeError("run_until_idle: still busy after max_steps")
