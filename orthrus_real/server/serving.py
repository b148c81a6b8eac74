"""Assemble engine, engine thread, metrics and HTTP app; run them under uvicorn.

At start the server logs what it loaded (model, dtype and why, device, threads, KV capacity,
policy, budget, chunk size, adapter), then ``orthrus ready: http://HOST:PORT`` once it accepts
requests (wait for that line, or poll ``/health``). On SIGTERM/SIGINT it drains: new requests get
503 (``/health`` too) while the listener stays open, requests in flight finish, then it exits; a
second signal exits at once (status 128 + the signal's number; requests in flight are dropped).

Slow clients: uvicorn closes an idle keep-alive connection after ``timeout_keep_alive`` (5 s) and
caps a request head at h11's 16 KiB (``h11_max_incomplete_event_size``); it has no timeout on
reading a request head, so a server on an untrusted network belongs behind a proxy that has one.
The body is read under ``body_timeout`` (the ``BodyLimit`` middleware; 408 when it runs out).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from orthrus_real.server import backends
from orthrus_real.server.api import create_app
from orthrus_real.server.engine_thread import EngineThread
from orthrus_real.server.metrics import EngineMetrics

log = logging.getLogger("orthrus")
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
MAX_HEAD = 16 * 1024  # bytes of request line and headers (h11's default)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def setup_logging(level: str = "info") -> None:
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    logging.basicConfig(format="%(levelname)s: %(message)s", level=level.upper())
    log.setLevel(level.upper())


def limit_heap_fragmentation() -> None:
    """Serve large allocations (a tokenizer's temporaries for a long text) from mmap so they go
    back to the system when freed; otherwise glibc's heap fragments and RSS only grows (what
    ``MALLOC_MMAP_THRESHOLD_=131072`` does, unless the environment already sets it)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` now (before the model loads), as uvicorn would; a clear error if the
    port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says
    # TCP; with proto 0 every response split in two writes waited ~40 ms for a delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server "
                         "running there? choose another --port)") from None
    return sock


def check_max_model_len(model: str, wanted: int | None) -> None:
    """``--max-model-len`` above the model's own limit is an error (read from config.json, before
    anything loads)."""
    from orthrus_real.engine.model_files import read_config

    if wanted is None:
        return
    if wanted < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {wanted}")
    limit = read_config(model).max_model_len
    if wanted > limit:
        raise ValueError(f"--max-model-len {wanted} is more than the model's maximum length {limit} "
                         f"({model}/config.json); give at most {limit}, or leave it out")


def build(model: str, adapter: str | None = None, policy: str = "ibs", scheduler=None,
          kv_cache_tokens: int = 32768, max_queued: int = 1024, max_body_bytes: int = 1 << 20,
          served_model_name: str | None = None, device: str | None = None, dtype: str | None = None,
          pooling: str = "mean", threads: int = 0, backend: str = "torch",
          api_key: str | None = None, max_inputs_per_request: int = 256,
          body_timeout: float = 30.0, calibration: str | None = None,
          engine_options: dict | None = None):
    """Engine thread, metrics and app; the engine is ready when this returns.
    ``engine_options``: the PyTorch engine's attention, static-step and CPU GEMM settings."""
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the option (and "
                         "ORTHRUS_API_KEY) unset to serve without authentication")
    if max_inputs_per_request < 1:
        raise ValueError(f"--max-inputs-per-request must be >= 1, got {max_inputs_per_request}")
    limit_heap_fragmentation()

    def make_engine():
        return backends.make_engine(backend, model, adapter, policy, scheduler, kv_cache_tokens,
                                    device, dtype, threads, calibration=calibration,
                                    engine_options=engine_options)

    runner = EngineThread(make_engine, max_queued=max_queued)
    metrics = EngineMetrics.attach(runner)
    runner.start()  # the engine is built (and steps) in its own thread
    for key, value in runner.engine.describe().items():
        log.info("%s: %s", key, value)
    name = served_model_name or runner.engine.model_dir.name
    metrics.model_name = name
    app = create_app(runner, name, metrics, max_body_bytes, default_pooling=pooling,
                     api_key=api_key, max_inputs_per_request=max_inputs_per_request,
                     body_timeout=body_timeout)
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
    """On the first SIGTERM/SIGINT: answer 503 to new requests while the ones in flight finish
    (at most ``drain_timeout`` seconds), then shut down; on a second signal, at once."""

    def __init__(self, config: uvicorn.Config, runner: EngineThread, drain_timeout: float) -> None:
        super().__init__(config)
        self.runner = runner
        self.drain_timeout = drain_timeout

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: say so, for scripts that wait on this line
            cfg = self.config
            host, port = (cfg.host, cfg.port) if sockets is None else sockets[0].getsockname()[:2]
            where = f"http://{host}:{port}"
            log.info("orthrus ready: %s", where)

    def handle_exit(self, sig, frame) -> None:
        if self.runner.draining:  # the second signal: exit now, without running C++ teardown
            log.warning("second signal (%s): exiting now; %d request(s) in flight are dropped",
                        signal.Signals(sig).name, self.runner.outstanding)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + sig)
        self.runner.draining = True
        log.info("draining: %d request(s) in flight; new requests get 503", self.runner.outstanding)
        threading.Thread(target=self._exit_when_drained, args=(sig, frame), daemon=True).start()

    def _exit_when_drained(self, sig, frame) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.runner.outstanding > 0 and time.monotonic() < deadline and not self.runner.failed:
            time.sleep(0.05)
        super().handle_exit(sig, frame)


def serve(app, runner: EngineThread, host: str = "127.0.0.1", port: int = 8000,
          sock: socket.socket | None = None, log_level: str = "info",
          graceful_timeout: float = 300.0) -> None:
    # h11 wherever httptools happens to be installed too: the same parser and limits everywhere
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http="h11",
                            timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEAD,
                            timeout_graceful_shutdown=graceful_timeout)
    server = DrainingServer(config, runner, graceful_timeout)
    server.run(sockets=[sock] if sock is not None else None)
