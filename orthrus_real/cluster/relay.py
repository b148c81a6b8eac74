"""One client request through the gateway, across as many replicas as it takes.

A ``Relay`` sends the request's body to the replica the router picks (an ``Attempt``: one
exchange, in its own task, so that a replica going down can end it) and relays the answer. When
the replica goes down, refuses the request, or is drained before the answer is complete, the
relay asks ``retry.RetryRules`` whether it may go on, and then:

* nothing has reached the client (an embedding, a non-streamed generation, a stream before its
  first event): the same body goes to another replica;
* a streaming generation has sent tokens: it continues on another replica from its prompt plus
  those tokens (the body with ``resume_token_ids``: the replica prefills them and streams only
  what follows), and the client's stream goes on under its first id, with no token repeated or
  missing. To know the tokens, the gateway asks the replica for them (``return_token_ids``) and
  takes them out of the events again unless the client asked for them too.

A stream that cannot continue (several prompts or ``n`` > 1 in one request, or no replica left)
ends with an SSE error event, ``replica_failed``; a request the rules will not send again gets a
503 ``replica_failed`` naming why, or 422 ``request_quarantined``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse

from orthrus_real.cluster.retry import Quarantine
from orthrus_real.cluster.upstream import UpstreamError
from orthrus_real.server.api.errors import error_response
from orthrus_sim.engine.request import Request as RoutedRequest
from orthrus_sim.engine.request import RequestKind

if TYPE_CHECKING:
    from orthrus_real.cluster.replicas import Replica

Gateway = Any  # orthrus_real.cluster.gateway.Gateway (which imports this module)

log = logging.getLogger("orthrus")
REPLICA_HEADER = "x-orthrus-replica"  # which replica answered (a stream: where it began)
RETRIES_HEADER = "x-orthrus-retries"  # how many times the gateway sent the request again
ENDED_BY_CLIENT = "client"


@dataclass
class Refusal:
    """Why a request is not sent again: an HTTP error, or an SSE error event mid-stream
    (``raw``: a replica's own answer, relayed as it came)."""

    status: int
    message: str
    code: str
    raw: Response | None = None

    @property
    def kind(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def response(self) -> Response:
        if self.raw is not None:
            return self.raw
        return error_response(self.status, self.message, kind=self.kind, code=self.code)

    def event(self) -> bytes:
        return _sse({"error": {"message": self.message, "type": self.kind, "param": None,
                               "code": self.code}})


class Attempt:
    """One exchange with one replica, run in its own task (kept in ``replica.flights``); what
    comes back goes to the relay through a queue: ``("head", status, content type)``, then
    ``("data", bytes)`` ... ``("end",)``, or ``("failed", why, how, replica)`` where ``how`` is
    ``refused`` (it never reached the engine), ``down`` (it failed at the replica: the relay
    tells ``lost``, the connection only, from a replica that went down), ``stalled`` (its
    replica hung), ``moved`` (a drain took it off) or ``client`` (the client went away)."""

    def __init__(self, relay: Relay, replica: Replica, routed: RoutedRequest,
                 is_retry: bool) -> None:
        self.relay, self.replica, self.routed, self.is_retry = relay, replica, routed, is_retry
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.ended_by: str | None = None
        self.pumped = False  # its task began (a task cancelled before that runs nothing)
        self.work = 0

    @property
    def movable(self) -> bool:
        """A drain may move it to another replica (a generation the relay can send again)."""
        return self.relay.movable

    async def start(self, body: bytes) -> tuple:
        gw, replica = self.relay.gw, self.replica
        key = (replica.index, self.relay.kind.value)
        gw.routed[key] = gw.routed.get(key, 0) + 1
        self.work = self.routed.remaining_work(True)
        replica.outstanding_work += self.work
        gw.outstanding += 1
        gw.retrying += self.is_retry
        self.task = asyncio.create_task(self._pump(body))
        self.task.add_done_callback(self._ended)
        replica.flights.add(self)
        return await self.queue.get()

    def _ended(self, _task: asyncio.Task) -> None:
        """Cancelled before its first step (a replica taken down in the same turn of the loop):
        nothing of ``_pump`` ran, so its books are settled and its failure told here."""
        if not self.pumped:
            self.queue.put_nowait(("failed", f"replica {self.replica.index}: cancelled before "
                                   "it was sent", self.ended_by or ENDED_BY_CLIENT, self.replica))
            self._release()

    def _release(self) -> None:
        gw, replica = self.relay.gw, self.replica
        replica.flights.discard(self)
        replica.outstanding_work -= self.work
        gw.outstanding -= 1
        gw.retrying -= self.is_retry
        gw.router.release(self.routed)

    def end(self, reason: str, how: str) -> None:
        """The gateway ends it: its replica went down (``down``) or a drain moves it (``moved``)."""
        self.ended_by = how
        if self.task is not None and not self.task.done():
            self.task.cancel(reason)

    def abandon(self) -> None:
        """The client went away: the replica aborts the request when its connection closes."""
        if self.task is not None and not self.task.done():
            self.task.cancel("the client went away")

    async def _pump(self, body: bytes) -> None:
        self.pumped = True
        gw, replica, relay = self.relay.gw, self.replica, self.relay
        started = False
        try:
            resp = await gw.upstream.send(replica.url, relay.path, body, relay.headers)
            try:
                started = True
                replica.last_heard = time.monotonic()
                self.queue.put_nowait(("head", resp.status, resp.headers.get("content-type")))
                async for chunk in resp.chunks():
                    replica.last_heard = time.monotonic()
                    self.queue.put_nowait(("data", chunk))
                self.queue.put_nowait(("end",))
            finally:
                await resp.aclose()
        except asyncio.CancelledError as exc:
            reason = exc.args[0] if exc.args else f"replica {replica.index}: request cancelled"
            self.queue.put_nowait(("failed", reason, self.ended_by or ENDED_BY_CLIENT, replica))
            raise
        except UpstreamError as exc:
            refused = exc.refused and not started
            reason = (f"replica {replica.index} failed "
                      f"{'mid-answer' if started else 'before answering'}: {exc}")
            self.queue.put_nowait(("failed", reason, "refused" if refused else "down", replica))
            if replica.exited() is not None:
                gw.take_down(replica, f"its process exited with code {replica.exited()}")
            elif exc.nothing_listens:
                gw.take_down(replica, reason)
            else:
                gw.background(gw.probe(replica))
        except Exception as exc:  # a bug, or an error the client did not foresee: still an end
            log.error("relaying to replica %d failed", replica.index, exc_info=exc)
            self.queue.put_nowait(("failed", f"replica {replica.index}: {type(exc).__name__}: "
                                             f"{exc}", "down", replica))
        finally:
            self._release()

    async def body(self) -> tuple[bytes, tuple | None]:
        """The whole answer, or the failure that cut it."""
        parts = []
        while True:
            item = await self.queue.get()
            if item[0] == "data":
                parts.append(item[1])
            elif item[0] == "end":
                return b"".join(parts), None
            else:
                return b"", item


class Relay:
    """A request's life in the gateway: its attempts, what reached the client, whether it may
    be sent again."""

    def __init__(self, gw: Gateway, path: str, kind: RequestKind, body: bytes, headers: dict,
                 routed: RoutedRequest, doc: dict) -> None:
        self.gw, self.path, self.kind, self.body, self.headers = gw, path, kind, body, headers
        self.routed, self.doc = routed, doc
        self.streamed = doc.get("stream") is True
        # a stream of one generation can continue elsewhere from the tokens it has sent (a body
        # whose return_token_ids is not a boolean is left as it is: its replica refuses it)
        self.continues = (kind is RequestKind.GENERATION and self.streamed and _one_choice(doc)
                          and doc.get("return_token_ids") in (None, True, False))
        self.client_ids = doc.get("return_token_ids") is True
        given = doc.get("resume_token_ids")
        self.resumed = list(given) if isinstance(given, list) else []
        self.sent: list[int] = []  # output token ids relayed to the client
        self.key = Quarantine.fingerprint(path, body)
        self.attempts = self.retries = self.downs = self.moves = 0
        self.suspects: list[tuple[Replica, int]] = []  # replicas that stalled with it (restarts)
        self.current: Attempt | None = None  # the attempt in flight (abandoned if the client goes)
        # the stream as relayed
        self.buffer = b""
        self.relayed = False  # some of the answer reached the client
        self.first_id = self.created = None
        self.role_sent = self.finished = self.done = self.usage_seen = self.replica_error = False
        self.prompt_ids_sent = False
        self.last_how = ""  # why the last attempt ended, as the rules saw it
        self.prompt_len: int | None = None

    @property
    def movable(self) -> bool:
        return self.kind is RequestKind.GENERATION and (self.continues or not self.relayed)

    # ----- answering the client ---------------------------------------------------------------
    async def respond(self) -> Response:
        if self.gw.quarantine.holds(self.key):
            return Refusal(422, "this request was in flight on replicas that went down with it "
                                "and is quarantined: identical requests are refused for "
                                f"{self.gw.rules.quarantine_s:.0f} s", "request_quarantined").response()
        got = await self._send(None)
        if isinstance(got, Refusal):
            return got.response()
        attempt, status, media = got
        if media and media.startswith("text/event-stream"):
            return StreamingResponse(self._events(attempt), status_code=status, media_type=media,
                                     headers=self._headers(attempt))
        try:
            while True:  # a whole answer: nothing reached the client until it is complete
                data, failure = await attempt.body()
                if failure is None:
                    return Response(data, status_code=status, media_type=media,
                                    headers=self._headers(attempt))
                got = await self._send(failure)
                if isinstance(got, Refusal):
                    return got.response()
                attempt, status, media = got
        finally:  # the client went away (this task cancelled): the replica aborts it
            if self.current is not None:
                self.current.abandon()

    def _headers(self, attempt: Attempt) -> dict:
        return {REPLICA_HEADER: str(attempt.replica.index), RETRIES_HEADER: str(self.attempts - 1)}

    async def _events(self, attempt: Attempt):
        try:
            while True:
                item = await attempt.queue.get()
                if item[0] == "data":
                    out = self._relay(item[1])
                    if out:
                        self.relayed = True
                        yield out
                    continue
                if item[0] == "end":
                    if self.done or not self.continues:
                        if self.buffer:
                            yield self.buffer
                        return
                    item = ("failed", f"replica {attempt.replica.index} ended the stream before "
                                      "its last event", "down", attempt.replica)
                if self.done:
                    return
                if self.finished:  # only the usage chunk or [DONE] was lost
                    yield self._closing()
                    return
                if self.replica_error or not self.movable:
                    yield Refusal(503, item[1], "replica_failed").event()
                    return
                got = await self._send(item)
                if isinstance(got, Refusal):
                    yield got.event()
                    return
                attempt, status, media = got
                self.buffer = b""  # a partial event of the stream before is not glued on
                if status != 200 or not (media or "").startswith("text/event-stream"):
                    data, _ = await attempt.body()
                    yield Refusal(503, f"replica {attempt.replica.index} answered {status} when "
                                       f"the stream moved there: {data[:300]!r}", "replica_failed"
                                  ).event()
                    return
                self.moves += self.relayed
                self.gw.migrated[self.last_how] += self.relayed
        finally:
            if self.current is not None:
                self.current.abandon()

    # ----- attempts ---------------------------------------------------------------------------
    async def _send(self, failure: tuple | None):
        """Send the request (after ``failure``: again, if the rules allow) until a replica
        answers with a head; ``(attempt, status, content type)`` or a ``Refusal``."""
        gw = self.gw
        gw.placing += 1  # the cluster's drain waits for requests between attempts too
        try:
            while True:
                if failure is not None:
                    refusal = await self._may_retry(failure)
                    if refusal is not None:
                        return refusal
                routed = self._routed_now()
                replica = await gw.place(routed)
                if replica is None:
                    return Refusal(503, f"no replica serving {self.kind.value} requests is up "
                                        "(see /health)" + (f"; the last one failed: {failure[1]}"
                                                           if failure else ""),
                                   "replica_failed" if failure else "no_replica")
                attempt = self.current = Attempt(self, replica, routed,
                                                 is_retry=failure is not None)
                self.attempts += 1
                first = await attempt.start(self._body_now())
                if first[0] != "head":
                    failure = first
                    continue
                if first[1] == 503:  # a replica that drains refuses new requests: another one
                    data, cut = await attempt.body()
                    if cut is None and b'"draining"' not in data:  # its own 503: as it came
                        return Refusal(503, _message(data), "replica_failed", raw=Response(
                            data, 503, media_type=first[2], headers=self._headers(attempt)))
                    gw.stop_routing(replica, "it answers 503: draining")
                    failure = cut or ("failed", f"replica {replica.index} is draining",
                                      "refused", replica)
                    continue
                return attempt, first[1], first[2]
        finally:
            gw.placing -= 1

    async def _may_retry(self, failure: tuple) -> Refusal | None:
        """None if the request may go to another replica after ``failure``; else why not."""
        gw, rules = self.gw, self.gw.rules
        _, reason, how, replica = failure
        if how == ENDED_BY_CLIENT:
            return Refusal(499, "client disconnected", "client_disconnected")
        if self.attempts >= rules.max_attempts:
            gw.not_retried["attempts"] += 1
            return Refusal(503, f"{reason}; not sent again after {self.attempts} attempts",
                           "replica_failed")
        if how == "down" and replica.up and await gw.still_there(replica):
            how = "lost"  # the connection failed, not the replica (a stale keep-alive, say)
        self.last_how = how
        if how == "stalled":  # counts as a death only if it turns out to be one
            self.suspects.append((replica, replica.restarts))
        if how == "down":
            self.downs += 1
        if how in ("down", "stalled"):
            died = self.downs + sum(1 for r, n in self.suspects
                                    if r is not replica and (not r.up or r.restarts != n))
            if rules.poison_after and died >= rules.poison_after:
                gw.quarantine.add(self.key)
                log.warning("a %s request was in flight on %d replicas that went down: "
                            "quarantined (%s)", self.kind.value, died, reason)
                return Refusal(422, f"{reason}; this request was in flight on {died} "
                                    "replicas that went down with it: it is not sent to "
                                    "another, and identical requests are refused for "
                                    f"{rules.quarantine_s:.0f} s", "request_quarantined")
        if how in ("down", "stalled", "lost"):
            if self.retries >= rules.per_request:
                gw.not_retried["per_request"] += 1
                return Refusal(503, f"{reason}; not sent again: it was retried {self.retries} "
                                    "times already", "replica_failed")
            if not rules.budget_allows(gw.retrying, gw.outstanding):
                gw.not_retried["budget"] += 1
                return Refusal(503, f"{reason}; not sent again: the cluster's retry budget is "
                                    f"spent ({gw.retrying} requests retrying)", "replica_failed")
            self.retries += 1
        gw.retried[(self.kind.value, how)] += 1
        log.info("%s request sent again (%s): %s", self.kind.value, how, reason)
        return None

    def _routed_now(self) -> RoutedRequest:
        """What the router weighs now: the prompt plus what was sent, the rest of the output."""
        n = len(self.sent)
        r = self.routed
        out = max(r.max_output_tokens - n, 1) if r.max_output_tokens else 0
        return replace(r, request_id=f"{r.request_id}-{self.attempts}", input_len=r.input_len + n,
                       max_output_tokens=out, expected_output_tokens=out or None)

    def _body_now(self) -> bytes:
        """The body for the next attempt: a continuable stream asks for its token ids, and
        continues from those sent."""
        if not self.continues:
            return self.body
        doc = {**self.doc, "return_token_ids": True}
        resume = self.resumed + self.sent
        if resume:
            doc["resume_token_ids"] = resume
        return json.dumps(doc).encode()

    # ----- the stream as relayed --------------------------------------------------------------
    def _relay(self, chunk: bytes) -> bytes:
        """What of ``chunk`` goes to the client (whole events; a continuable stream's read)."""
        if not self.continues:
            return chunk
        self.buffer += chunk
        out = []
        while (cut := self.buffer.find(b"\n\n")) >= 0:
            event, self.buffer = self.buffer[:cut], self.buffer[cut + 2:]
            event = self._event(event)
            if event is not None:
                out.append(event + b"\n\n")
        return b"".join(out)

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data: "):
            return event
        payload = event[6:]
        if payload.strip() == b"[DONE]":
            self.done = True
            return event
        try:
            doc = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(doc, dict):
            return event
        if "error" in doc:  # the engine's own error: the stream ends with it, not moved
            self.replica_error = True
            return event
        changed = False
        if self.first_id is None:
            self.first_id, self.created = doc.get("id"), doc.get("created")
        elif doc.get("id") != self.first_id:  # a continuation keeps the client's stream's id
            doc["id"], doc["created"] = self.first_id, self.created
            changed = True
        if doc.get("usage") is not None and not doc.get("choices"):
            self.usage_seen = True  # the closing usage chunk (with continuous_usage_stats every
            # chunk has a usage, and the closing one is still owed)
        for c in doc.get("choices") or ():
            if not isinstance(c, dict):
                continue
            ids = c.get("token_ids")
            if isinstance(ids, list):
                self.sent.extend(ids)
            prompt = c.get("prompt_token_ids")
            if isinstance(prompt, list) and self.prompt_len is None:
                self.prompt_len = len(prompt)
            if c.get("finish_reason"):
                self.finished = True
            if not self.client_ids:
                changed |= c.pop("token_ids", None) is not None
                changed |= c.pop("prompt_token_ids", None) is not None
            elif "prompt_token_ids" in c:
                if self.prompt_ids_sent:  # a continuation's: the client has them
                    del c["prompt_token_ids"]
                    changed = True
                self.prompt_ids_sent = True
            delta = c.get("delta")
            if isinstance(delta, dict) and set(delta) == {"role"}:
                if self.role_sent:  # a stream started again says its role again: once is enough
                    return None
                self.role_sent = True
        return b"data: " + json.dumps(doc).encode() if changed else event

    def _closing(self) -> bytes:
        """The end of a stream whose last token was sent before its replica went down."""
        out = b""
        if (self.doc.get("stream_options") or {}).get("include_usage") and not self.usage_seen:
            prompt = self.prompt_len or self.routed.input_len
            done = len(self.resumed) + len(self.sent)
            out += _sse({"id": self.first_id, "object": _chunk_object(self.path),
                         "created": self.created, "model": self.doc.get("model"), "choices": [],
                         "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                                   "total_tokens": prompt + done}})
        return out + b"data: [DONE]\n\n"


def _sse(payload: dict) -> bytes:
    return ("data: " + json.dumps(payload) + "\n\n").encode()


def _chunk_object(path: str) -> str:
    return "chat.completion.chunk" if path.endswith("chat/completions") else "text_completion"


def _one_choice(doc: dict) -> bool:
    """The request makes one generation (one prompt, ``n`` 1): its stream can be continued."""
    if doc.get("n") not in (None, 1) or doc.get("n") is True:
        return False
    prompt = doc.get("prompt")
    if prompt is None:
        return "messages" in doc
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and (all(isinstance(t, int) for t in prompt)
                                         or len(prompt) == 1)


def _message(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return data[:300].decode(errors="replace")
