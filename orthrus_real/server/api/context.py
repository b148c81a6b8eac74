"""What every route shares: the engine thread, the model ids it answers to, and the steps of one
request (check the model, tokenise, submit, wait). Routes get it as a FastAPI dependency.

Text is tokenised in one worker thread, never on the event loop (a long text takes a second or
more to tokenise; ``/health`` must not wait for it), and a text longer than the model's maximum
length could ever tokenise to (``max_model_len`` times the longest token's length in characters)
is refused before it is tokenised.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from fastapi import Request

from orthrus_real.engine.base import RequestOutput, RequestRejected
from orthrus_real.server.api.errors import ApiError
from orthrus_real.server.engine_thread import Draining, EngineThread, QueueFull, asyncio_sink

GENERATE, EMBED = "generation", "embedding"


@dataclass
class ServerContext:
    runner: EngineThread
    served_name: str
    metrics: object | None = None
    default_pooling: str = "mean"
    default_normalize: bool = True
    chat_template: object | None = None
    models: dict[str, dict] = field(default_factory=dict)  # id -> {"serves": [...], "about": ...}
    max_inputs: int = 256  # prompts or embedding inputs in one request

    def __post_init__(self) -> None:
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="orthrus-tokenize")
        vocab = self.engine.tokenizer.get_vocab(with_added_tokens=True)
        # a token covers at most this many characters of text (byte-level vocabularies spell a
        # byte as one character, and a text character is at least one byte)
        self.longest_token = max((len(t) for t in vocab), default=1)

    @property
    def engine(self):
        return self.runner.engine

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler_config.max_model_len

    def check_model(self, name: str | None, serves: str) -> None:
        """``name`` (None: the served model) must exist and serve ``serves``."""
        if name is None:
            return
        entry = self.models.get(name)
        if entry is None:
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                                f"{', '.join(sorted(self.models))}", "model", code="model_not_found")
        if serves not in entry["serves"]:
            raise ApiError(400, f"model {name!r} serves {' and '.join(entry['serves'])} only, not "
                                f"{serves}; use {self.served_name!r}", "model",
                           code="wrong_model_kind")

    @property
    def serves_kinds(self) -> tuple[str, ...]:
        """The request kinds this engine's policy serves (one for a dedicated replica)."""
        serves = getattr(getattr(self.engine, "policy", None), "serves", None)
        return tuple(k.value for k in serves) if serves else (EMBED, GENERATE)

    def check_kind(self, kind: str) -> None:
        """A dedicated replica refuses the other kind at once, saying what it serves."""
        if kind not in self.serves_kinds:
            other = " and ".join(self.serves_kinds)
            raise ApiError(400, f"this replica serves {other} requests only (policy "
                                f"{self.engine.policy.name}: one side of a dedicated split), not "
                                f"{kind}; send {kind} requests to the cluster's endpoint",
                           code="wrong_replica_kind")

    def check_count(self, n: int, param: str) -> None:
        """At most ``--max-inputs-per-request`` items, and no more than the engine thread holds
        at once (``--max-queued``): a request over that could never be queued, and would be told
        429, retry, forever."""
        limit, option = self.max_inputs, "--max-inputs-per-request"
        queued = getattr(self.runner, "max_queued", None)
        if isinstance(queued, int) and queued < limit:
            limit, option = queued, "--max-queued, the requests this server holds at once"
        if n > limit:
            raise ApiError(400, f"{param} holds {n} items, more than this server's limit of "
                                f"{limit} per request ({option})", param, code="too_many_inputs")

    async def encode(self, text: str, param: str, add_special_tokens: bool = True,
                     truncating: bool = False) -> list[int]:
        """Tokenise off the event loop; without truncation, refuse a text that cannot fit."""
        limit = self.max_model_len * self.longest_token
        if not truncating and len(text) > limit:
            raise ApiError(400, f"{param} has {len(text)} characters, more than the model's maximum "
                                f"length of {self.max_model_len} tokens can hold ({limit} characters "
                                f"at {self.longest_token} a token)", param,
                           code="context_length_exceeded")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizing, partial(self.engine.encode, text, add_special_tokens))

    async def tokens_of(self, item: dict, param: str, body=None) -> list[int]:
        """The token ids of one prompt or input (``body``: its truncation and special-token
        options, vLLM's)."""
        truncating = body is not None and body.truncate_prompt_tokens is not None
        special = body is None or body.add_special_tokens is not False
        if "text" in item:
            ids = await self.encode(item["text"], param, special, truncating)
        else:
            ids = item["token_ids"]
        if truncating:
            ids = body.truncate(ids, self.max_model_len)
        if not ids:
            raise ApiError(400, f"{param} must not be empty", param)
        vocab = self.engine.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ApiError(400, f"{param}: token ids must be in [0, {vocab})", param)
        return ids

    def submit(self, kind: str, kwargs: dict, streamed: bool = False) -> tuple[str, asyncio.Queue]:
        rid = f"{'emb' if kind == EMBED else 'cmpl'}-{uuid.uuid4().hex}"
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            self.runner.submit(kind, rid, kwargs, asyncio_sink(loop, q), streamed)
        except QueueFull as exc:
            raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full") from None
        except Draining as exc:
            raise ApiError(503, str(exc), kind="server_error", code="draining") from None
        return rid, q

    @staticmethod
    def raise_for(item, param: str) -> None:
        if isinstance(item, RequestRejected | ValueError):
            raise ApiError(400, str(item), getattr(item, "param", None) or param)
        if isinstance(item, Exception):
            raise ApiError(500, f"engine error: {item}", kind="server_error", code="engine_error")

    async def finals(self, pending: list[tuple[str, asyncio.Queue]], request: Request,
                     param: str) -> list[RequestOutput]:
        """Wait for the last output of each request; the moment the client goes away (its
        connection's ``http.disconnect``), abort them all (the caller aborts on ApiError)."""
        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        outs = []
        try:
            for _, q in pending:
                while True:
                    getter = asyncio.ensure_future(q.get())
                    await asyncio.wait((getter, watcher), return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        raise ApiError(499, "client disconnected")
                    item = getter.result()
                    self.raise_for(item, param)
                    if item.finished:
                        outs.append(item)
                        break
        finally:
            watcher.cancel()
        return outs

    def abort_all(self, rids) -> None:
        for rid in rids:
            self.runner.abort(rid)


def context(request: Request) -> ServerContext:
    """The FastAPI dependency routes take the shared context from."""
    return request.app.state.context


def chat_template(engine):
    """The tokenizer's Jinja chat template, sandboxed; None when the model has none."""
    path = engine.model_dir / "tokenizer_config.json"
    if not path.exists():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    if not template:
        return None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(template)
