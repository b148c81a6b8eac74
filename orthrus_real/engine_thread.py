"""Run an Engine in its own thread; requests enter through a queue and their outputs come back
through callbacks (the HTTP server turns them into asyncio queues)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from orthrus_real.engine_base import EngineBase, RequestOutput

Sink = Callable[[Any], None]  # receives RequestOutput objects, or an Exception


def asyncio_sink(loop, q) -> Sink:
    """A sink that hands outputs to an asyncio queue of ``loop`` from the engine thread; outputs
    for a caller whose loop has closed (it went away) are dropped."""

    def deliver(item) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # event loop is closed
            pass

    return deliver


class QueueFull(RuntimeError):
    pass


class Draining(RuntimeError):
    pass


class EngineThread:
    """Owns the engine: builds it (``factory``) and steps it in one thread.

    Every torch call happens in that thread. On a 2-core CPU, torch work issued from two OS
    threads (say, loading in the main thread and stepping in this one) leaves OpenMP teams
    spinning against each other and made decode steps ~35 % slower.
    """

    def __init__(self, factory: Callable[[], EngineBase], max_queued: int = 1024,
                 on_step: Callable[[EngineBase], None] | None = None) -> None:
        self.factory = factory
        self.engine: EngineBase | None = None
        self.max_queued = max_queued
        self.on_step = on_step
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, Sink] = {}
        self.outstanding = 0  # accepted and not finished (read by the HTTP side)
        self.draining = False
        self.failed: str | None = None  # why the engine stopped stepping, if it did
        self.snapshot: dict = {}
        self.busy_s = 0.0  # seconds spent inside engine.step()
        self.step_started: float | None = None  # time.monotonic() of the step in flight
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._main, name="orthrus-engine", daemon=True)

    def start(self) -> EngineThread:
        """Build the engine in its thread and wait until it is ready (or raise its error)."""
        if not self.thread.is_alive() and not self._ready.is_set():
            self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        try:
            self.engine = self.factory()
            self._publish()
        except BaseException as exc:  # reported to start()'s caller
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._run()
        finally:
            self.engine.close()  # the vLLM backend's worker process, say

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout)

    # ----- called from other threads ---------------------------------------------------------
    def submit(self, kind: str, request_id: str, kwargs: dict, sink: Sink) -> None:
        with self._lock:
            if self.failed:
                raise Draining(f"the engine failed ({self.failed}); restart the server")
            if self.draining:
                raise Draining("the server is shutting down and takes no new requests")
            if self.outstanding >= self.max_queued:
                raise QueueFull(f"the request queue is full ({self.outstanding} requests in flight, "
                                f"limit {self.max_queued})")
            self.outstanding += 1
        self.inbox.put(("add", kind, request_id, kwargs, sink))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    # ----- the engine thread -------------------------------------------------------------------
    def _done(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)
        with self._lock:
            self.outstanding -= 1

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "add":
            _, kind, rid, kwargs, sink = msg
            try:
                if kind == "embedding":
                    self.engine.add_embedding(rid, **kwargs)
                else:
                    self.engine.add_generation(rid, **kwargs)
            except Exception as exc:  # rejected: tell the caller, nothing is in flight
                with self._lock:
                    self.outstanding -= 1
                sink(exc)
                return
            self.sinks[rid] = sink
        elif msg[0] == "abort":
            rid = msg[1]
            if rid in self.sinks:
                out = self.engine.abort(rid)
                sink = self.sinks.get(rid)
                self._done(rid)
                if out is not None and sink is not None:
                    sink(out)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                block = not engine.has_work
                msg = self.inbox.get(block=block, timeout=0.5 if block else None)
                self._handle(msg)
                while True:
                    self._handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if not engine.has_work:
                self._publish()
                continue
            self.step_started = time.monotonic()
            try:
                outputs: list[RequestOutput] = engine.step()
            except Exception as exc:  # e.g. vLLM's worker process died
                self._fail(exc)
                return
            finally:
                self.busy_s += time.monotonic() - self.step_started
                self.step_started = None
            for out in outputs:
                sink = self.sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
                if out.finished:
                    self._done(out.request_id)
            if self.on_step is not None:
                self.on_step(engine)
            self._publish()

    def _fail(self, exc: Exception) -> None:
        """The engine cannot step any more: every request in flight or queued ends with the
        error (the server answers 500), and new requests are refused (503)."""
        with self._lock:
            self.failed = f"{type(exc).__name__}: {exc}"
        error = RuntimeError(f"engine failed: {self.failed}")
        pending = list(self.sinks.items())
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "add":  # accepted (counted in outstanding), not yet in the engine
                pending.append((msg[2], msg[4]))
        for rid, sink in pending:
            sink(error)
            self._done(rid)
        self._publish()

    def _publish(self) -> None:
        """A consistent picture of the engine for the metrics endpoint (read by other threads)."""
        self.snapshot = {
            "time": time.time(),
            "policy": self.engine.policy.snapshot(),
            "counters": dict(self.engine.counters),
            "iterations": self.engine.iterations,
            "outstanding": self.outstanding,
        }

    def busy_seconds(self) -> float:
        """Seconds spent stepping, the step in flight included (read by the metrics)."""
        started = self.step_started
        return self.busy_s + (time.monotonic() - started if started is not None else 0.0)
