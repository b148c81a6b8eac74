"""A stub replica: the HTTP surface the gateway reads from an engine (``/engine``, ``/health``,
``/v1/models``, ``/metrics``) and OpenAI-shaped answers to ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/embeddings`` at once, with no engine behind it, so that a
benchmark through the gateway measures the gateway alone.

A streamed request (``"stream": true``) gets ``max_tokens`` SSE events (default 16), each
``--stream-gap-ms`` apart (or the body's ``stub_gap_ms``), then ``data: [DONE]``: a relay that
buffers shows as gaps that close up at the client.

A raw ASGI app (no framework) under uvicorn, so the stub's own cost per request stays small
beside the gateway's. Run: ``python -m benchmarks.cluster.stub_replica --port 8101 [--cpus 1]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from benchmarks.common import parser

MODEL = "stub"
ENGINE = {"model": MODEL, "kv_cache": "65536 tokens (stub)", "threads": "1", "device": "none",
          "policy": "stub", "num_blocks": 4096, "block_size": 16,
          "serves": ["embedding", "generation"]}
CARD = {"id": MODEL, "object": "model", "created": 0, "owned_by": "orthrus", "root": MODEL,
        "parent": None, "max_model_len": 4096, "serves": ["completions", "chat", "embeddings"],
        "description": "a stub replica that answers at once"}
EMBEDDING = [round(0.001 * i, 3) for i in range(64)]
METRICS = (b"# HELP orthrus_requests_in_flight Requests in flight\n"
           b"# TYPE orthrus_requests_in_flight gauge\northrus_requests_in_flight 0.0\n")


def _json(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _usage(n_in: int, n_out: int) -> dict:
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def completion(body: dict, chat: bool) -> dict:
    n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
    n = n if isinstance(n, int) and 0 < n <= 4096 else 16
    text = " tok" * n
    choice = ({"index": 0, "finish_reason": "length", "logprobs": None,
               "message": {"role": "assistant", "content": text}} if chat else
              {"index": 0, "finish_reason": "length", "logprobs": None, "text": text})
    return {"id": "cmpl-stub", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": MODEL, "choices": [choice],
            "usage": _usage(8, n)}


def embeddings(body: dict) -> dict:
    inputs = body.get("input", "")
    count = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(
        inputs[0], int) else 1
    return {"object": "list", "model": MODEL, "usage": _usage(8, 0),
            "data": [{"object": "embedding", "index": i, "embedding": EMBEDDING}
                     for i in range(count)]}


def make_app(gap_s: float = 0.0):
    """The stub's ASGI app; ``gap_s``: the default gap between a stream's events."""
    static = {"/engine": (200, "application/json", _json(ENGINE)),
              "/health": (200, "application/json", _json({"status": "ok"})),
              "/v1/models": (200, "application/json", _json({"object": "list", "data": [CARD]})),
              "/metrics": (200, "text/plain; version=0.0.4; charset=utf-8", METRICS),
              "/version": (200, "application/json", _json({"version": "stub"}))}
    not_found = _json({"error": {"message": "no such route", "type": "invalid_request_error",
                                 "param": None, "code": "not_found"}})

    async def send_whole(send, status: int, media: str, data: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", media.encode()),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def stream(send, body: dict, chat: bool) -> None:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        n = n if isinstance(n, int) and 0 < n <= 100_000 else 16
        gap = body.get("stub_gap_ms")
        gap = gap / 1000 if isinstance(gap, int | float) and gap >= 0 else gap_s
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        created = int(time.time())
        for i in range(n):
            if i and gap:
                await asyncio.sleep(gap)
            delta = ({"index": 0, "delta": {"content": " tok"}, "finish_reason": None} if chat
                     else {"index": 0, "text": " tok", "finish_reason": None, "logprobs": None})
            doc = {"id": "cmpl-stub", "object": "chat.completion.chunk" if chat
                   else "text_completion", "created": created, "model": MODEL,
                   "choices": [delta], "stub_event": i, "stub_sent": time.time()}
            await send({"type": "http.response.body", "body": b"data: " + _json(doc) + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if scope["method"] == "GET":
            await send_whole(send, *static.get(path, (404, "application/json", not_found)))
            return
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            await send_whole(send, 400, "application/json", _json({"error": {
                "message": "the request body is not a JSON object", "type": "invalid_request_error",
                "param": None, "code": None}}))
        elif path == "/v1/embeddings":
            await send_whole(send, 200, "application/json", _json(embeddings(body)))
        elif path in ("/v1/completions", "/v1/chat/completions"):
            chat = path == "/v1/chat/completions"
            if body.get("stream") is True:
                await stream(send, body, chat)
            else:
                await send_whole(send, 200, "application/json", _json(completion(body, chat)))
        else:
            await send_whole(send, 404, "application/json", not_found)

    return app


def main() -> None:
    import uvicorn

    p = parser(__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--stream-gap-ms", type=float, default=0.0,
                   help="gap between a stream's events (a request's stub_gap_ms overrides it)")
    p.add_argument("--cpus", default=None, help="pin to these cores, e.g. 1 or 0,1")
    p.add_argument("--http", default="httptools", choices=("httptools", "h11"),
                   help="uvicorn's HTTP parser (httptools: the stub's own cost stays small)")
    a = p.parse_args()
    if a.cpus:
        os.sched_setaffinity(0, {int(c) for c in a.cpus.split(",")})
    uvicorn.run(make_app(a.stream_gap_ms / 1000), host=a.host, port=a.port, log_level="warning",
                http=a.http, access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
