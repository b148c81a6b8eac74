"""What every route shares: the engine thread, the model ids it answers to, and the steps of one
request (check the model, tokenise, submit, wait). Routes get it as a FastAPI dependency."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from fastapi import Request

from orthrus_real.api.errors import ApiError
from orthrus_real.engine_base import RequestOutput, RequestRejected
from orthrus_real.engine_thread import Draining, EngineThread, QueueFull, asyncio_sink

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

    def tokens_of(self, item: dict, param: str) -> list[int]:
        ids = self.engine.encode(item["text"]) if "text" in item else item["token_ids"]
        if not ids:
            raise ApiError(400, f"{param} must not be empty", param)
        vocab = self.engine.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ApiError(400, f"{param}: token ids must be in [0, {vocab})", param)
        return ids

    def submit(self, kind: str, kwargs: dict) -> tuple[str, asyncio.Queue]:
        rid = f"{'emb' if kind == EMBED else 'cmpl'}-{uuid.uuid4().hex}"
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            self.runner.submit(kind, rid, kwargs, asyncio_sink(loop, q))
        except QueueFull as exc:
            raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full") from None
        except Draining as exc:
            raise ApiError(503, str(exc), kind="server_error", code="draining") from None
        return rid, q

    @staticmethod
    def raise_for(item, param: str) -> None:
        if isinstance(item, RequestRejected | ValueError):
            raise ApiError(400, str(item), param)
        if isinstance(item, Exception):
            raise ApiError(500, f"engine error: {item}", kind="server_error")

    async def final(self, rid: str, q: asyncio.Queue, request: Request, param: str) -> RequestOutput:
        """Wait for a request's last output; a client that went away aborts it."""
        while True:
            try:
                item = await asyncio.wait_for(q.get(), 0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    self.runner.abort(rid)
                    raise ApiError(499, "client disconnected") from None
                continue
            self.raise_for(item, param)
            if item.finished:
                return item

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
