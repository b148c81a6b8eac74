"""Assemble engine, engine thread, metrics and HTTP app; run them under uvicorn."""

from __future__ import annotations

import socket
import time

import uvicorn

from orthrus_real import backends
from orthrus_real.engine_thread import EngineThread
from orthrus_real.metrics import EngineMetrics
from orthrus_real.server import create_app


def build(model: str, adapter: str | None = None, policy: str = "ibs", scheduler=None,
          kv_cache_tokens: int = 32768, max_queued: int = 1024, max_body_bytes: int = 1 << 20,
          served_model_name: str | None = None, device: str | None = None, dtype: str | None = None,
          pooling: str = "mean", threads: int = 0, backend: str = "torch"):
    """Engine thread, metrics and app; the engine is ready when this returns."""
    def make_engine():
        return backends.make_engine(backend, model, adapter, policy, scheduler, kv_cache_tokens,
                                    device, dtype, threads)

    runner = EngineThread(make_engine, max_queued=max_queued)
    metrics = EngineMetrics.attach(runner)
    runner.start()  # the engine is built (and steps) in its own thread
    name = served_model_name or runner.engine.model_dir.name
    app = create_app(runner, name, metrics, max_body_bytes, default_pooling=pooling)
    app.state.metrics = metrics
    return app, runner


def wait_healthy(url: str, timeout: float = 60.0, process=None) -> None:
    """Poll ``url``/health until it answers 200; raise if ``process`` exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server process exited with code {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f} s")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: refuse new requests (503), let in-flight ones finish, then exit."""

    def __init__(self, config: uvicorn.Config, runner: EngineThread) -> None:
        super().__init__(config)
        self.runner = runner

    def handle_exit(self, sig, frame) -> None:
        self.runner.draining = True
        super().handle_exit(sig, frame)


def serve(app, runner: EngineThread, host: str = "127.0.0.1", port: int = 8000,
          sock: socket.socket | None = None, log_level: str = "info",
          graceful_timeout: float = 300.0) -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout)
    server = DrainingServer(config, runner)
    server.run(sockets=[sock] if sock is not None else None)
