"""OpenAI-compatible HTTP server: embeddings and completions from one engine and one model.

The engine steps in its own thread (``EngineThread``); each HTTP request becomes an engine
request whose outputs come back through an asyncio queue. A client that disconnects (or cancels
a stream) aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from orthrus_real.engine import RequestOutput, RequestRejected
from orthrus_real.engine_thread import Draining, EngineThread, QueueFull, asyncio_sink
from orthrus_real.metrics import EngineMetrics
from orthrus_real.openai_api import ChatBody, CompletionBody, EmbeddingBody
from orthrus_real.sampling import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


class BodyLimit:
    """ASGI middleware: refuse bodies over ``max_bytes`` with 413 before the app parses them."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks, size, more = [], 0, True
        while more and not too_big:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            body = message.get("body", b"")
            size += len(body)
            too_big = size > self.max_bytes
            chunks.append(message)
            more = message.get("more_body", False)
        if too_big:
            resp = error_response(413, f"request body is larger than {self.max_bytes} bytes",
                                  code="body_too_large")
            return await resp(scope, receive, send)
        replay = iter(chunks)

        async def replayed():
            try:
                return next(replay)
            except StopIteration:
                return await receive()

        return await self.app(scope, replayed, send)


def _encode(vec: list[float], fmt: str):
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec


FIELD_HINTS = {
    "input": "input must be a string, a list of strings, a token array or a list of token arrays",
    "prompt": "prompt must be a string or a token array",
    "stop": "stop must be a string or a list of strings",
}


def create_app(runner: EngineThread, model_name: str, metrics: EngineMetrics | None = None,
               max_body_bytes: int = 1 << 20, default_pooling: str = "mean",
               default_normalize: bool = True) -> FastAPI:
    engine = runner.engine

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        runner.stop()  # after uvicorn has drained the in-flight requests

    app = FastAPI(title="Orthrus", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    aliases = {model_name} | ({engine.adapter_name} if engine.adapter_name else set())
    chat_template = _chat_template(engine)

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.kind, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", []) if p != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {err.get('msg')}")
        param = loc[0] if loc else None
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if param in FIELD_HINTS and len(loc) > 1 and err.get("type") != "value_error":
            return error_response(400, FIELD_HINTS[param], param)  # a union: say what is accepted
        return error_response(400, f"{'.'.join(loc) or 'body'}: {msg}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail),
                              code="not_found" if exc.status_code == 404 else None)

    def check_model(name: str | None) -> None:
        if name is not None and name not in aliases:
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                                f"{', '.join(sorted(aliases))}", "model", code="model_not_found")

    def tokens_of(item: dict, param: str) -> list[int]:
        ids = engine.encode(item["text"]) if "text" in item else item["token_ids"]
        if not ids:
            raise ApiError(400, f"{param} must not be empty", param)
        vocab = engine.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ApiError(400, f"{param}: token ids must be in [0, {vocab})", param)
        return ids

    def submit(kind: str, kwargs: dict, param: str) -> tuple[str, asyncio.Queue]:
        rid = f"{'emb' if kind == 'embedding' else 'cmpl'}-{uuid.uuid4().hex}"
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            runner.submit(kind, rid, kwargs, asyncio_sink(loop, q))
        except QueueFull as exc:
            raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full") from None
        except Draining as exc:
            raise ApiError(503, str(exc), kind="server_error", code="draining") from None
        return rid, q

    def raise_for(item, param: str) -> None:
        if isinstance(item, RequestRejected | ValueError):
            raise ApiError(400, str(item), param)
        if isinstance(item, Exception):
            raise ApiError(500, f"engine error: {item}", kind="server_error")

    async def final(rid: str, q: asyncio.Queue, request: Request, param: str) -> RequestOutput:
        while True:
            try:
                item = await asyncio.wait_for(q.get(), 0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    runner.abort(rid)
                    raise ApiError(499, "client disconnected") from None
                continue
            raise_for(item, param)
            if item.finished:
                return item

    @app.get("/health")
    async def health():
        if runner.failed:
            return error_response(503, f"engine failed: {runner.failed}", kind="server_error",
                                  code="engine_failed")
        if runner.draining:
            return error_response(503, "draining", kind="server_error", code="draining")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                            "owned_by": "orthrus"} for m in sorted(aliases)]}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are disabled")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingBody, request: Request):
        check_model(body.model)
        pooling = body.pooling or default_pooling
        normalize = default_normalize if body.normalize is None else body.normalize
        inputs = [tokens_of(item, "input") for item in body.items()]
        limit = engine.scheduler_config.max_model_len
        for ids in inputs:
            if len(ids) > limit:
                raise ApiError(400, f"input has {len(ids)} tokens, more than the model's maximum "
                                    f"length {limit}", "input", code="context_length_exceeded")
        pending = []
        try:
            for ids in inputs:
                pending.append(submit("embedding", dict(token_ids=ids, pooling=pooling,
                                                        normalize=normalize), "input"))
            outs = [await final(rid, q, request, "input") for rid, q in pending]
        except ApiError:
            for rid, _ in pending:
                runner.abort(rid)
            raise
        tokens = sum(len(x) for x in inputs)
        return {"object": "list", "model": body.model or model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": _encode(o.embedding, body.encoding_format)}
                         for i, o in enumerate(outs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def generation_kwargs(body, prompt_ids: list[int], param: str) -> dict:
        limit = engine.scheduler_config.max_model_len
        if len(prompt_ids) + body.max_tokens > limit:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({body.max_tokens}) "
                                f"exceeds the model's maximum length {limit}", param,
                           code="context_length_exceeded")
        try:
            params = SamplingParams(**body.sampling_kwargs())
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return dict(token_ids=prompt_ids, params=params)

    async def generate(body, prompt_ids: list[int], request: Request, chat: bool):
        param = "messages" if chat else "prompt"
        rid, q = submit("generation", generation_kwargs(body, prompt_ids, param), param)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.stream:
            out = await final(rid, q, request, param)
            choice = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            n_out = len(out.token_ids)
            return {"id": rid, "object": obj, "created": created, "model": body.model or model_name,
                    "choices": [choice], "usage": {"prompt_tokens": len(prompt_ids),
                                                   "completion_tokens": n_out,
                                                   "total_tokens": len(prompt_ids) + n_out}}
        first = await q.get()  # a rejection still gets a proper status before the stream starts
        raise_for(first, param)

        async def events():
            finished = False
            item = first
            try:
                if chat:
                    yield _sse(rid, obj + ".chunk", created, body.model or model_name,
                               {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None})
                while True:
                    if isinstance(item, Exception):
                        yield f"data: {json.dumps({'error': {'message': str(item)}})}\n\n"
                        break
                    if chat:
                        choice = {"index": 0, "delta": {"content": item.new_text},
                                  "finish_reason": item.finish_reason}
                    else:
                        choice = {"index": 0, "text": item.new_text, "logprobs": None,
                                  "finish_reason": item.finish_reason}
                    yield _sse(rid, obj + ".chunk" if chat else obj, created,
                               body.model or model_name, choice)
                    if item.finished:
                        finished = True
                        break
                    item = await q.get()
                yield "data: [DONE]\n\n"
            finally:
                if not finished:
                    runner.abort(rid)  # the client went away mid-stream

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        check_model(body.model)
        item = {"text": body.prompt} if isinstance(body.prompt, str) else {"token_ids": body.prompt}
        return await generate(body, tokens_of(item, "prompt"), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        check_model(body.model)
        if chat_template is None:
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           "messages")
        text = chat_template.render(messages=[m.model_dump() for m in body.messages],
                                    add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
        return await generate(body, tokens_of({"text": text}, "messages"), request, chat=True)

    return app


def _sse(rid: str, obj: str, created: int, model: str, choice: dict) -> str:
    return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                  "choices": [choice]}) + "\n\n"


def _chat_template(engine):
    path = engine.model_dir / "tokenizer_config.json"
    if not path.exists():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    if not template:
        return None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(template)
