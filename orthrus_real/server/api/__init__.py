"""The OpenAI-compatible HTTP server: embeddings and completions from one engine and one model.

The engine steps in its own thread (``EngineThread``); each HTTP request becomes an engine
request whose outputs come back through an asyncio queue. A client that disconnects (or cancels
a stream) aborts its request, which frees its KV blocks. Routes live in one module per endpoint
group and share a ``ServerContext`` (FastAPI dependency).
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from orthrus_real.server.api import admin, completions, embeddings
from orthrus_real.server.api.context import ServerContext, chat_template
from orthrus_real.server.api.errors import ApiError, BearerAuth, BodyLimit, error_response, install_handlers
from orthrus_real.server.engine_thread import EngineThread

__all__ = ["ApiError", "ServerContext", "create_app", "error_response"]


def model_ids(served_name: str, adapter: str | None) -> dict[str, dict]:
    """The ids clients may name, and what each serves."""
    models = {served_name: {
        "serves": ["completions", "chat", "embeddings"],
        "about": "the base model: completions and chat; embeddings "
                 + (f"through the embedding adapter {adapter!r}" if adapter else "of the base model")}}
    if adapter and adapter != served_name:
        models[adapter] = {"serves": ["embeddings"],
                           "about": f"the embedding adapter (LoRA on {served_name!r}): embeddings only"}
    return models


def create_app(runner: EngineThread, model_name: str, metrics=None,
               max_body_bytes: int = 1 << 20, default_pooling: str = "mean",
               default_normalize: bool = True, api_key: str | None = None,
               max_inputs_per_request: int = 256, body_timeout: float = 30.0) -> FastAPI:
    """The app over a started engine thread; it stops the thread when the server shuts down
    (after uvicorn has drained the requests in flight)."""
    from orthrus_sim import __version__

    engine = runner.engine

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        runner.stop()

    app = FastAPI(title="Orthrus", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)
    install_handlers(app)
    app.state.context = ServerContext(
        runner, model_name, metrics, default_pooling, default_normalize, chat_template(engine),
        model_ids(model_name, engine.adapter_name), max_inputs_per_request)
    app.state.metrics = metrics
    for module in (admin, embeddings, completions):
        app.include_router(module.router)
    return app
