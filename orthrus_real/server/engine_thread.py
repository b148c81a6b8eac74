"""Run an Engine in its own thread; requests enter through a queue and their outputs come back
through callbacks (the HTTP server turns them into asyncio queues).

Isolation: a request can fail, the engine thread does not. The PyTorch engine finds the rows
that make a step raise itself (``Engine._run_isolated``) and fails only their requests. An error
that escapes ``step`` (the vLLM backend's core, or anything outside the forward pass) cannot be
attributed from here: the thread logs it, fails the streamed requests that already sent output
(they cannot be re-run unseen), rebuilds the engine, and re-runs the others one at a time
("probation") before taking new ones again; a step that fails with one request in the engine
fails that request. Only when the engine cannot be rebuilt does the server stop serving (503).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from orthrus_real.engine.base import EngineBase, RequestOutput

log = logging.getLogger("orthrus")
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


class RequestFailed(RuntimeError):
    """The engine raised while running this request (the server answers 500)."""


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
        # called with (output, submitted at, now) for each output delivered (the metrics)
        self.on_output: Callable[[RequestOutput, float, float], None] | None = None
        self.on_done: Callable[[str], None] | None = None  # a request left, however it ended
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, Sink] = {}  # requests in the engine or on probation
        self.requests: dict[str, tuple[str, dict, float]] = {}  # rid -> (kind, kwargs, submitted)
        self.answered: set[str] = set()  # streamed requests that already delivered an output
        self.streamed: set[str] = set()  # requests whose outputs reach the client as they come
        self.probation: deque[str] = deque()  # re-run one at a time after an engine failure
        self.held: list[tuple] = []  # new requests waiting for probation to end
        self.solo: str | None = None  # the request on probation now in the engine
        self.rebuilds = 0
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
    def submit(self, kind: str, request_id: str, kwargs: dict, sink: Sink,
               streamed: bool = False) -> None:
        """Queue a request; ``streamed``: its client sees outputs as they come (so it cannot be
        re-run unseen once one was delivered)."""
        with self._lock:
            if self.failed:
                raise Draining(f"the engine failed ({self.failed}); restart the server")
            if self.draining:
                raise Draining("the server is shutting down and takes no new requests")
            if self.outstanding >= self.max_queued:
                raise QueueFull(f"the request queue is full ({self.outstanding} requests in flight, "
                                f"limit {self.max_queued})")
            self.outstanding += 1
        self.inbox.put(("add", kind, request_id, kwargs, sink, time.monotonic(), streamed))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    # ----- the engine thread -------------------------------------------------------------------
    def _done(self, request_id: str) -> None:
        if self.on_done is not None:
            self.on_done(request_id)
        self.sinks.pop(request_id, None)
        self.requests.pop(request_id, None)
        self.answered.discard(request_id)
        self.streamed.discard(request_id)
        with self._lock:
            self.outstanding -= 1

    def _deliver(self, out: RequestOutput) -> None:
        sink = self.sinks.get(out.request_id)
        if sink is not None:
            entry = self.requests.get(out.request_id)
            if self.on_output is not None and entry is not None:
                self.on_output(out, entry[2], time.monotonic())
            sink(RequestFailed(out.error) if out.error else out)
            if out.request_id in self.streamed:
                self.answered.add(out.request_id)
        if out.finished:
            self._done(out.request_id)

    def _add(self, kind: str, rid: str, kwargs: dict, sink: Sink) -> None:
        """Put a request into the engine; a refusal (or an engine error) goes to its sink."""
        try:
            if kind == "embedding":
                self.engine.add_embedding(rid, **kwargs)
            else:
                self.engine.add_generation(rid, **kwargs)
        except Exception as exc:  # rejected: tell the caller, nothing is in flight
            if not isinstance(exc, ValueError):
                log.error("adding request %s failed", rid, exc_info=exc)
            self.sinks.pop(rid, None)
            self.requests.pop(rid, None)
            with self._lock:
                self.outstanding -= 1
            sink(exc)
            return
        self.sinks[rid] = sink

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "add":
            _, kind, rid, kwargs, sink, submitted, streamed = msg
            self.requests[rid] = (kind, kwargs, submitted)
            if streamed:
                self.streamed.add(rid)
            if self._on_probation():  # re-running suspects one at a time: new work waits
                self.held.append(msg)
                return
            self._add(kind, rid, kwargs, sink)
        elif msg[0] == "abort":
            rid = msg[1]
            held = [m for m in self.held if m[2] == rid]
            if held:  # not in the engine yet
                self.held.remove(held[0])
                self._done(rid)
            elif rid in self.probation:
                self.probation.remove(rid)
                self._done(rid)
            elif rid in self.sinks:
                out = self.engine.abort(rid)
                sink = self.sinks.get(rid)
                self._done(rid)
                if out is not None and sink is not None:
                    sink(out)

    def _on_probation(self) -> bool:
        return bool(self.probation) or (self.solo is not None and self.solo in self.sinks)

    def _next_on_probation(self) -> None:
        """With the engine idle, run the next suspect alone (or, when none is left, let the
        held requests in)."""
        while self.probation and not self.engine.has_work:
            rid = self.solo = self.probation.popleft()
            kind, kwargs, _ = self.requests[rid]
            self._add(kind, rid, kwargs, self.sinks[rid])
        if not self._on_probation() and self.held:
            held, self.held = self.held, []
            for msg in held:
                self._handle(msg)

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
            if self.probation or self.held:
                self._next_on_probation()
            if not engine.has_work:
                self._publish()
                continue
            self.step_started = time.monotonic()
            try:
                outputs: list[RequestOutput] = engine.step()
            except Exception as exc:  # e.g. vLLM's worker process died
                self.busy_s += time.monotonic() - self.step_started
                self.step_started = None
                if not self._recover(exc):
                    return
                engine = self.engine
                continue
            self.busy_s += time.monotonic() - self.step_started
            self.step_started = None
            for out in outputs:
                self._deliver(out)
            if self.on_step is not None:
                self.on_step(engine)
            self._publish()

    def _recover(self, exc: Exception) -> bool:
        """A step raised and the engine could not say which request caused it: log it, fail
        what cannot be re-run unseen, rebuild the engine and put the rest on probation.
        False if the engine could not be rebuilt (then everything fails)."""
        in_engine = [rid for rid in self.sinks if rid not in self.probation]
        log.error("engine step failed with %d request(s) in the engine: %s: %s", len(in_engine),
                  type(exc).__name__, exc, exc_info=exc)
        error = RequestFailed(f"{type(exc).__name__}: {exc}")
        counters = self.engine.counters
        if len(in_engine) == 1:  # alone in the engine: it is the cause
            lost = in_engine
        else:
            lost = [rid for rid in in_engine if rid in self.answered]
        for rid in lost:
            counters[f"{self.requests[rid][0]}_failed"] += 1
            sink = self.sinks[rid]
            self._done(rid)
            sink(error)
        rerun = [rid for rid in in_engine if rid not in lost]
        for rid in rerun:  # starts afresh: its latencies too
            if self.on_done is not None:
                self.on_done(rid)
        try:
            self.engine.close()
        except Exception as close_exc:  # noqa: BLE001 - the old engine is gone either way
            log.error("closing the failed engine: %s", close_exc, exc_info=close_exc)
        iterations = self.engine.iterations
        try:
            self.engine = self.factory()
        except Exception as build_exc:
            log.error("rebuilding the engine failed", exc_info=build_exc)
            self._fail(build_exc)
            return False
        self.rebuilds += 1
        self.engine.counters, self.engine.iterations = counters, iterations
        self.probation.extendleft(reversed(rerun))
        log.warning("engine rebuilt; %d request(s) re-run one at a time, %d failed", len(rerun),
                    len(lost))
        self._publish()
        return True

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
        pending += [(m[2], m[4]) for m in self.held]
        self.held, self.probation, self.solo = [], deque(), None
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
