"""What every executor shares: request intake (validation, tokenising, the core policy's
admission), stop handling, the outputs it returns, its counters and per-iteration records.

``Engine`` (the PyTorch reference engine) and ``VllmEngine`` (the vLLM plug-in) derive from
``EngineBase`` and add how a batch is run: so a request is checked, stopped and answered the
same way whichever runs it, and pooling and output building exist once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from orthrus_real.engine.model_files import read_config
from orthrus_real.engine.sampling import GREEDY_BELOW, SamplingParams
from orthrus_real.engine.settings import executor_config
from orthrus_sim.costmodel.predictor import calibrated_predictor
from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.engine import (
    BatchUnit,
    IncrementalPooler,
    Policy,
    Request,
    RequestKind,
    SchedulerConfig,
    make_policy,
)

log = logging.getLogger("orthrus")


class RequestRejected(ValueError):
    """The engine will never serve this request (the reason names the problem; ``param``, when
    given, the request parameter at fault)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    finish_reason: str | None = None  # stop | length | abort | error
    prompt_tokens: int = 0
    error: str | None = None  # why this request failed (finish_reason "error")


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
    prompt_len: int = 0  # the prompt's tokens; ``tokens`` after them are the output's


class EngineBase:
    """The front half of an engine; subclasses set up the model and implement ``step``."""

    policy: Policy
    scheduler_config: SchedulerConfig

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.cfg = read_config(model_dir)
        tok_path = self.model_dir / "tokenizer.json"
        if not tok_path.exists():
            raise ValueError(f"{model_dir}: tokenizer.json is missing")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        self.stats: deque[IterationStats] = deque(maxlen=100_000)
        self.iterations = 0
        self._t0 = time.monotonic()
        self.counters = {f"{k}_{s}": 0 for k in ("embedding", "generation")
                         for s in ("completed", "rejected", "aborted", "failed")}
        self.adapter_name: str | None = None
        self.adapter_merged = False  # folded into the weights (an embedding-only server)
        self.adapter_rank: int | None = None
        self.dtype_reason = "the model's"
        self.calibration: str | None = None

    def _set_dtype(self, dtype: torch.dtype, why: str):
        self.cfg = type(self.cfg)(**{**self.cfg.__dict__, "dtype": dtype})
        self.dtype_reason = why
        return self.cfg

    def _make_policy(self, policy: str, scheduler: SchedulerConfig, num_blocks: int,
                     block_size: int, calibration: str | None = None) -> None:
        """The core policy, with the engine's KV capacity and the model's length limit; an
        iteration-time target is predicted by the cost model fitted to this engine
        (``calibration``, from ``orthrus-real calibrate``)."""
        self.scheduler_config = executor_config(scheduler, num_blocks, block_size,
                                                self._model_len(scheduler.max_model_len))
        source = self._predictor_source(scheduler, calibration)
        predictor = calibrated_predictor(**source) if source else None
        self.policy = make_policy(policy, self.scheduler_config, predictor)

    def _predictor_source(self, scheduler: SchedulerConfig, calibration: str | None) -> dict | None:
        """What predicts this engine's iteration times for ``tpot_target_s`` (the arguments of
        ``calibrated_predictor``), None without a target; a target needs a calibration."""
        self.calibration = calibration
        if scheduler.tpot_target_s is None:
            return None
        if calibration is None:
            raise ValueError("--tpot-target needs --calibration FILE (the cost model "
                             "`orthrus-real calibrate` fitted to this engine) to predict "
                             "iteration times")
        return {"calibration": str(calibration), "model": str(self.model_dir),
                "lora_rank": self.adapter_rank if self.adapter_per_row else None}

    def _model_len(self, wanted: int | None) -> int:
        """The length served: ``wanted`` (a scenario's, say), at most the model's (the server
        refuses a larger --max-model-len before loading; see ``serving.check_max_model_len``)."""
        limit = self.cfg.max_model_len
        if wanted is not None and wanted > limit:
            log.warning("max_model_len %d is more than the model's %d: serving %d", wanted, limit,
                        limit)
        return min(wanted or limit, limit)

    def describe(self) -> dict:
        """What the engine loaded and how it schedules (the server logs it at start)."""
        c = self.scheduler_config
        return {"model": str(self.model_dir), "engine": type(self).__name__,
                "device": str(getattr(self, "device", "(the backend's)")),
                "dtype": f"{str(self.cfg.dtype).removeprefix('torch.')} ({self.dtype_reason})",
                "threads": torch.get_num_threads(),
                "kv_cache": f"{c.num_blocks * c.block_size} tokens in {c.num_blocks} blocks of "
                            f"{c.block_size}",
                "max_model_len": c.max_model_len, "policy": self.policy.name,
                "token_budget": c.token_budget,
                "chunk_size": c.chunk_size if c.chunk_size is not None else "none (atomic)",
                "max_num_seqs": c.max_num_seqs, "kv_admission": c.kv_admission,
                "tpot_target": (_target_words(c, self.calibration) if c.tpot_target_s else "none"),
                "embedding_adapter": (f"{self.adapter_name} (rank {self.adapter_rank}"
                                      + (", merged into the weights)" if self.adapter_merged
                                         else ")") if self.adapter_name else "none")}

    # ----- requests --------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self._t0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: tokenizers' encode holds the GIL for the whole call (a second
        # per 0.5 MB of text, during which no other thread runs), encode_batch releases it
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

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
        req.payload = _State(tokens=ids, pooler=IncrementalPooler(pooling, normalize),
                             prompt_len=len(ids))
        return self._submit(req, "embedding")

    def add_generation(self, request_id: str, token_ids: list[int] | None = None,
                       text: str | None = None, params: SamplingParams | None = None,
                       resume_ids: list[int] | None = None) -> Request:
        """A generation request; ``resume_ids``: output tokens it already has (generated by a
        replica that went down): they are prefilled with the prompt, count towards
        ``max_tokens`` and stop strings, and only what follows them is output (a seeded
        sampler's generator is advanced past their draws, so it continues as it would have)."""
        params = params or SamplingParams()
        ids = self._tokens(token_ids, text, "prompt")
        resume = self._resume_tokens(resume_ids, params)
        limit = self.scheduler_config.max_model_len
        if len(ids) + params.max_tokens > limit:
            self.counters["generation_rejected"] += 1
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's maximum length {limit}")
        full = ids + resume
        req = Request(request_id, RequestKind.GENERATION, self.now(), len(full),
                      max_output_tokens=params.max_tokens - len(resume), token_ids=full)
        gen = self._seeded_generator(params.seed) if params.seed is not None else None
        if gen is not None and resume and params.temperature >= GREEDY_BELOW:
            for _ in resume:  # one draw per token sampled: torch.multinomial's, on the vocabulary
                torch.empty(self.cfg.vocab_size, device=gen.device).exponential_(generator=gen)
        state = _State(tokens=list(full), params=params, generator=gen, prompt_len=len(ids))
        if resume:  # what the stream it continues has sent of them
            state.text = self.tokenizer.decode(resume, skip_special_tokens=True)
            state.emitted_text = _complete(state.text)
        req.payload = state
        return self._submit(req, "generation")

    def _resume_tokens(self, resume_ids: list[int] | None, params: SamplingParams) -> list[int]:
        """The checked output tokens a resumed generation starts from ([] when not resumed)."""
        if not resume_ids:
            return []
        vocab = self.cfg.vocab_size
        bad = [t for t in resume_ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < vocab]
        why = (f"resume_token_ids: token ids must be integers in [0, {vocab}), got {bad[0]!r}"
               if bad else f"resume_token_ids holds {len(resume_ids)} tokens, not fewer than "
               f"max_tokens ({params.max_tokens}): nothing is left to generate"
               if len(resume_ids) >= params.max_tokens else None)
        if why:
            self.counters["generation_rejected"] += 1
            raise RequestRejected(why, "resume_token_ids")
        return list(resume_ids)

    def _seeded_generator(self, seed: int) -> torch.Generator:
        """The generator of a seeded request (on the device its logits are sampled on)."""
        return torch.Generator().manual_seed(seed)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._drop(request_id)
        if req is None:
            return None
        self.counters[f"{req.kind.value}_aborted"] += 1
        state = req.payload
        start = state.prompt_len
        return RequestOutput(request_id, req.kind.value, True, finish_reason="abort",
                             token_ids=state.tokens[start:], text=state.text, prompt_tokens=start)

    def _drop(self, request_id: str) -> Request | None:
        return self.policy.abort(request_id, self.now())

    def _fail_request(self, req: Request, exc: BaseException) -> RequestOutput:
        """End one request whose rows made a step raise (the others in the step go on): log the
        error with its traceback, free the request and return its error output."""
        log.error("request %s failed in iteration %d: %s: %s", req.request_id, self.iterations + 1,
                  type(exc).__name__, exc, exc_info=exc)
        self._drop(req.request_id)
        self.counters[f"{req.kind.value}_failed"] += 1
        return RequestOutput(req.request_id, req.kind.value, True, finish_reason="error",
                             prompt_tokens=req.payload.prompt_len,
                             error=f"{type(exc).__name__}: {exc}")

    @property
    def has_work(self) -> bool:
        return self.policy.has_work

    # ----- one iteration ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs it produced."""
        raise NotImplementedError

    def _take_token(self, req: Request, state: _State, tok: int) -> bool:
        """Append a sampled token and update the text; True if it hit a stop (EOS, a stop id
        or a stop string). Sets ``finish_reason`` once the request has ended either way."""
        state.tokens.append(tok)
        p = state.params
        stop = (not p.ignore_eos and tok in self.cfg.eos_token_ids) or tok in p.stop_token_ids
        if stop:
            state.finish_reason = "stop"
        if p.stop or not stop:
            text = self.tokenizer.decode(state.tokens[state.prompt_len:], skip_special_tokens=True)
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

    def _embedding_output(self, req: Request, vector) -> RequestOutput:
        """The final output of an embedding request (``vector``: a tensor or a list)."""
        self.counters["embedding_completed"] += 1
        values = vector.float().cpu().tolist() if hasattr(vector, "float") else list(vector)
        return RequestOutput(req.request_id, "embedding", True, embedding=values,
                             prompt_tokens=req.input_len)

    def _generation_output(self, req: Request, new_token_ids: list[int], done: bool) -> RequestOutput:
        """An output of a generation request after its newest tokens (already taken with
        ``_take_token``): the text so far and what is new since the last output."""
        state: _State = req.payload
        # text ending in an incomplete UTF-8 sequence (a character split over byte tokens
        # decodes as U+FFFD until its last byte comes) is held back: what is sent never changes
        shown = state.text if done else _complete(state.text)
        prev_text, state.emitted_text = state.emitted_text, shown
        if done:
            self.counters["generation_completed"] += 1
        return RequestOutput(
            req.request_id, "generation", done, new_token_ids=list(new_token_ids),
            token_ids=state.tokens[state.prompt_len:], text=state.text,
            new_text=shown[len(prev_text):], prompt_tokens=state.prompt_len,
            finish_reason=state.finish_reason if done else None)

    def _record(self, batch: BatchUnit, start: float) -> None:
        comp = batch.composition()
        self.iterations += 1
        admitted = [(it.request.kind.value, it.request.admitted_at - it.request.arrival_time)
                    for it in batch.items
                    if it.request.admitted_at is not None and it.request.admitted_at >= start]
        self.stats.append(IterationStats(
            self.iterations, start, self.now() - start, comp["embed_tokens"], comp["prefill_tokens"],
            comp["decodes"], batch.total_tokens, batch.token_budget, self.policy.blocks.usage,
            comp["embed_tokens"] if self.adapter_per_row else 0,
            BatchShape.from_batch(batch, adapter=self.adapter_per_row), admitted))

    @property
    def adapter_per_row(self) -> bool:
        """Embedding rows pay the adapter's work (an adapter loaded and not merged)."""
        return self.adapter_name is not None and not self.adapter_merged

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


def _complete(text: str) -> str:
    """``text`` without a trailing incomplete character (decoded as U+FFFD)."""
    return text.rstrip("\ufffd")


def _target_words(c, calibration: str) -> str:
    """The iteration-time target as the startup log says it."""
    ms = f"{c.tpot_target_s * 1e3:g} ms"
    if not c.tpot_slack_iterations:
        return f"{ms} per decode iteration, predicted by {calibration}"
    return (f"{ms} on each decode's TPOT (one iteration up to {c.tpot_slack_iterations} targets "
            f"over it from the decodes' slack), predicted by {calibration}")
