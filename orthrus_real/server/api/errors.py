"""Errors in OpenAI's shape, the handlers that produce them, the body-size guard and the API-key
check."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orthrus_real.server.api.bodies import ParameterError

log = logging.getLogger("orthrus")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed back (a field's name, say) cannot
    break the response (Starlette's UTF-8 encoding of it raises)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return AsciiJSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


FIELD_HINTS = {
    "input": "input must be a string, a list of strings, a token array or a list of token arrays",
    "prompt": "prompt must be a string, a list of strings, a token array or a list of token arrays",
    "stop": "stop must be a string or a list of strings",
}


def install_handlers(app: FastAPI) -> None:
    """Every error leaves as ``{"error": {message, type, param, code}}`` naming what was wrong."""

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.kind, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        err = exc.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ParameterError):  # the request surface's verdict (surface.py)
            return error_response(400, str(cause), cause.param, code=cause.code)
        loc = [str(p) for p in err.get("loc", []) if p != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {err.get('msg')}")
        param = loc[0] if loc else None
        if err.get("type") == "extra_forbidden":
            return error_response(400, f"unknown parameter {'.'.join(loc)!r}", param,
                                  code="unknown_parameter")
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if param in FIELD_HINTS and len(loc) > 1 and err.get("type") != "value_error":
            return error_response(400, FIELD_HINTS[param], param)  # a union: say what is accepted
        return error_response(400, f"{'.'.join(loc) or 'body'}: {msg}", param)

    @app.exception_handler(ParameterError)
    async def _parameter(_, exc: ParameterError):
        return error_response(400, str(exc), exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail),
                              code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(RecursionError)
    async def _too_deep(_, exc: RecursionError):
        if "JSON" not in str(exc):
            raise exc  # a bug: the 500 below
        return error_response(400, f"the request body nests too deeply to parse ({exc})",
                              code="invalid_json")

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):  # a bug: still JSON, and logged in full
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc,
                  exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              kind="server_error", code="internal_error")


class BodyLimit:
    """ASGI middleware: refuse bodies over ``max_bytes`` with 413 before the app parses them,
    and a body not received within ``timeout`` seconds (a slow or stalled client) with 408."""

    def __init__(self, app, max_bytes: int, timeout: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more and not too_big:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                resp = error_response(408, f"the request body did not arrive within "
                                           f"{self.timeout:g} s", code="request_timeout")
                return await resp(scope, receive, send)
            if message["type"] != "http.request":
                chunks.append(message)
                break
            body = message.get("body", b"")
            size += len(body)
            too_big = size > self.max_bytes
            chunks.append(message)
            more = message.get("more_body", False)
        if too_big:
            resp = error_response(413, f"request body is larger than {self.max_bytes} bytes "
                                       "(--max-body-bytes)", code="body_too_large")
            return await resp(scope, receive, send)
        replay = iter(chunks)

        async def replayed():
            try:
                return next(replay)
            except StopIteration:
                return await receive()

        return await self.app(scope, replayed, send)


class BearerAuth:
    """ASGI middleware: with an API key set, every route but ``/health``, ``/metrics`` and
    ``/version`` needs ``Authorization: Bearer <key>`` (401 otherwise), as vLLM's server does.
    The key is compared as SHA-256 digests with ``hmac.compare_digest`` (constant time); a
    request with more than one ``Authorization`` header is refused (proxies disagree on which
    one counts)."""

    OPEN = ("/health", "/metrics", "/version")

    def __init__(self, app, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key is empty")
        self.app = app
        self.digest = hashlib.sha256(f"Bearer {api_key}".encode()).digest()

    def _authorized(self, headers) -> bool:
        values = [v for k, v in headers if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        return hmac.compare_digest(hashlib.sha256(values[0]).digest(), self.digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        if not self._authorized(scope.get("headers", [])):
            resp = error_response(401, "missing or wrong API key: send 'Authorization: Bearer "
                                       "<key>'", kind="authentication_error", code="invalid_api_key")
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)
