"""The cluster's one OpenAI endpoint: each request routed to a replica by the project's router.

The rule is ``orthrus_sim.routing.rules``'s (``make_router``: the simulator's own), over
``Replica`` objects that expose what it reads. On arrival the gateway counts the request's
tokens (the model's tokenizer; the output cap for generations), asks ``route`` for a replica
among those up, forwards the body unchanged and relays the answer (streamed bytes as they
come); when the answer ends, ``release``. A kind goes only to replicas whose role serves it,
so a dedicated split's embedding replicas get embeddings only.

A replica whose process exits, or that stops answering ``/health``, is taken out of routing at
once (the router is rebuilt over the replicas up) and every request in flight there goes to
another replica when that is safe (``relay``: embeddings and generations that have sent nothing
again, streams that have sent tokens continued from them; bounded by ``retry.RetryRules``),
else ends with a ``replica_failed`` error: a 503 before its answer started, an SSE error event
mid-stream. ``POST /admin/replicas/{i}/restart`` starts it again (``--auto-restart``: the
gateway does so by itself); ``POST /admin/replicas/{i}/drain?migrate=true`` takes it out of
routing and moves its generations to the others at once. On SIGTERM the gateway drains: new
requests get 503, those in flight finish, then each replica drains and exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
from fastapi import Request
from fastapi.responses import Response

from orthrus_real.cluster.metrics_text import merge
from orthrus_real.cluster.relay import Relay
from orthrus_real.cluster.replicas import SERVES, Replica, ServeOptions
from orthrus_real.cluster.retry import Quarantine, RetryRules
from orthrus_real.server.api.errors import error_response
from orthrus_sim.engine.request import Request as RoutedRequest
from orthrus_sim.engine.request import RequestKind
from orthrus_sim.routing.rules import RouterRule

log = logging.getLogger("orthrus")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
ROUTES = {"/v1/embeddings": RequestKind.EMBEDDING, "/v1/completions": RequestKind.GENERATION,
          "/v1/chat/completions": RequestKind.GENERATION}
FORWARDED_HEADERS = ("content-type", "authorization", "accept")
HEALTH_EVERY_S = 0.5
HEALTH_FAILURES = 3  # consecutive failed /health probes take a replica out
STALL_S = 1.5  # a probe unanswered this long, and no answer bytes from the replica either: it
# is stalled (routed nothing new, its work moved)


class Gateway:
    """The replicas, the router over those up, and the requests in flight."""

    def __init__(self, replicas: list[Replica], opts: ServeOptions, rule: RouterRule,
                 auto_restart: bool = False, api_key: str | None = None,
                 start_timeout: float = 300.0, rules: RetryRules | None = None) -> None:
        self.replicas = replicas
        self.opts = opts
        self.rule = rule  # the scenario's (``RouterRule.of``), made over the replicas up
        self.auto_restart = auto_restart
        self.start_timeout = start_timeout
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.owns_replicas = True  # stops them when it exits (Ray Serve stops its own)
        self.draining = False  # DrainingServer's protocol (as an EngineThread's)
        self.failed = None
        self.outstanding = 0  # requests in flight through the gateway (attempts at a replica)
        self.rules = rules or opts.retry
        self.quarantine = Quarantine(self.rules.quarantine_s)
        self.retrying = 0  # attempts in flight that are retries (the retry budget's count)
        self.placing = 0  # requests between attempts (placed again after a failure)
        self.retried: Counter = Counter()  # (kind, why): requests sent again
        self.migrated: Counter = Counter()  # why: streams continued on another replica
        self.not_retried: Counter = Counter()  # why a request was not sent again
        self.routed: dict[tuple[int, str], int] = {}
        self.restarting: set[int] = set()
        self._probe_failures: dict[int, int] = {}
        self._probing: dict[int, asyncio.Task] = {}  # one probe of a replica at a time
        self._tasks: set[asyncio.Task] = set()  # background restarts and probes, kept alive
        self.models: list[dict] = []
        self.client: httpx.AsyncClient | None = None  # probes, metrics, models, admin
        self.upstream = None  # upstream.UpstreamPool: the relayed requests (set at start)
        self.tokenizer = _tokenizer(opts.model)
        # over the whole placement first, so the rule is checked against it before anything
        # starts (no replica is routable yet: a split's would look like no split at all)
        self.router = self._router(self.replicas)

    # ----- routing --------------------------------------------------------------------------
    def _router(self, replicas: list[Replica] | None = None):
        """The rule over ``replicas`` (default: those routable now)."""
        if replicas is None:
            replicas = [r for r in self.replicas if r.routable]
        return self.rule.make(replicas)

    def reroute(self) -> None:
        """The router over the replicas up now (a replica left or came back)."""
        self.router = self._router()

    def serves(self) -> set[str]:
        return {k for r in self.replicas for k in SERVES[r.role]}

    def _count(self, item) -> int:
        if isinstance(item, str):
            return len(self.tokenizer.encode(item).ids) if self.tokenizer else max(len(item) // 4, 1)
        if isinstance(item, list):
            if item and all(isinstance(x, int) for x in item):
                return len(item)
            return sum(self._count(x) for x in item)
        return 1

    def routed_request(self, kind: RequestKind, body: bytes) -> tuple[RoutedRequest, dict]:
        """What the router weighs: prompt tokens, and for generations the output cap (an
        estimate from whatever the body holds: the replica validates it and names what is
        wrong, so a body the gateway cannot read counts one token); and the body's JSON object
        ({} if it is none)."""
        try:
            doc = json.loads(body)
            doc = doc if isinstance(doc, dict) else {}
            n_in, n_out = self._sizes(kind, doc)
        except (ValueError, TypeError, RecursionError):  # not JSON, too deep, text not Unicode
            doc, n_in, n_out = {}, 1, 0 if kind is RequestKind.EMBEDDING else 16
        routed = RoutedRequest(f"gw-{uuid.uuid4().hex}", kind, time.monotonic(), max(n_in, 1),
                               max_output_tokens=n_out, expected_output_tokens=n_out or None)
        return routed, doc

    def _sizes(self, kind: RequestKind, doc: dict) -> tuple[int, int]:
        if kind is RequestKind.EMBEDDING:
            return self._count(doc.get("input", "")), 0
        prompts = doc.get("prompt")
        if prompts is None:  # chat
            messages = doc.get("messages")
            text = "".join(str(m.get("content", "")) for m in messages
                           if isinstance(m, dict)) if isinstance(messages, list) else ""
            n_in, count = self._count(text), 1
        else:
            n_in = self._count(prompts)
            count = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(
                prompts[0], int) else 1
        cap = doc.get("max_completion_tokens") or doc.get("max_tokens") or 16
        return n_in, (cap if isinstance(cap, int) and cap > 0 else 16) * count

    async def forward(self, request: Request, path: str, kind: RequestKind) -> Response:
        if self.draining:
            return error_response(503, "draining: the cluster is shutting down", kind="server_error",
                                  code="draining")
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        loop = asyncio.get_running_loop()
        routed, doc = await loop.run_in_executor(None, self.routed_request, kind, body)
        return await Relay(self, path, kind, body, headers, routed, doc).respond()

    async def place(self, routed: RoutedRequest) -> Replica | None:
        """The replica the router picks for ``routed``; while none serving its kind is up but
        one is coming back (restarting), wait for it (at most ``rules.wait_s``)."""
        deadline = time.monotonic() + self.rules.wait_s
        while True:
            replica = self.router.route(routed)
            if (replica is not None or not self._coming_back(routed.kind.value)
                    or time.monotonic() >= deadline):
                return replica
            await asyncio.sleep(0.1)

    def _coming_back(self, kind: str) -> bool:
        return not self.draining and any(
            kind in SERVES[r.role] and not r.up and not r.draining
            and (self.auto_restart or r.index in self.restarting) for r in self.replicas)

    # ----- replicas up and down -------------------------------------------------------------
    def background(self, coro) -> None:
        """Run ``coro`` as a task the gateway holds until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def take_down(self, replica: Replica, reason: str) -> None:
        """Out of routing now; its requests in flight end with an error naming ``reason``."""
        if not replica.up:
            return
        replica.up = False
        replica.last_exit = reason
        self.reroute()
        log.warning("replica %d (%s on %s) is down: %s; %d request(s) in flight there go to "
                    "another replica where that is safe", replica.index, replica.role,
                    replica.spec.device, reason, len(replica.flights))
        for attempt in list(replica.flights):
            attempt.end(f"replica {replica.index} went down: {reason}", "down")
        if self.upstream is not None:
            self.upstream.forget(replica.url)  # its kept connections (it restarts on a new port)
        replica.kill()  # if it hangs: gone before a restart

    def stop_routing(self, replica: Replica, why: str) -> None:
        """No new requests to ``replica`` (it drains); those there finish. Until it is ready
        again (restarted) or resumed (``resume``)."""
        if not replica.draining:
            replica.draining = True
            self.reroute()
            log.info("replica %d: no new requests (%s)", replica.index, why)

    async def drain_replica(self, replica: Replica, migrate: bool, timeout: float = 300.0) -> dict:
        """Out of routing; with ``migrate`` its generations move to other replicas now (streams
        continue from their tokens), the rest finish there; returns once nothing is left there
        (or after ``timeout``)."""
        self.stop_routing(replica, "drained" + (" with migration" if migrate else ""))
        moved = 0
        if migrate:
            for attempt in list(replica.flights):
                if attempt.movable:
                    attempt.end(f"replica {replica.index} was drained", "moved")
                    moved += 1
        deadline = time.monotonic() + timeout
        while replica.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {"replica": replica.index, "status": "drained" if not replica.flights else "draining",
                "moved": moved, "in_flight": len(replica.flights)}

    def resume(self, replica: Replica) -> None:
        """A drained replica is routed to again."""
        replica.draining = False
        self.reroute()

    async def restart(self, replica: Replica, migrate: bool = False) -> None:
        """Drain and stop the replica if it runs (``migrate``: its generations move to the
        others first), start it again, route to it once ready."""
        if replica.index in self.restarting:
            return
        self.restarting.add(replica.index)
        try:
            if migrate and replica.up:
                await self.drain_replica(replica, True)
            if replica.up:
                replica.up = False
                self.reroute()
            await asyncio.to_thread(replica.stop)
            replica.draining = False
            replica.start(self.opts)  # in the loop's (main) thread: the child's parent-death signal
            await asyncio.to_thread(replica.wait_ready, self.start_timeout)
            replica.restarts += 1
            self._probe_failures[replica.index] = 0
            self.reroute()
            log.info("replica %d is back: %s", replica.index, replica.describe())
        except RuntimeError as exc:
            replica.last_exit = str(exc)
            log.error("replica %d did not restart: %s", replica.index, exc)
        finally:
            self.restarting.discard(replica.index)

    async def attach(self) -> None:
        """Wait for every replica not up yet (Ray Serve starts its own), then route to them."""
        waiting = [r for r in self.replicas if not r.up]
        await asyncio.gather(*(asyncio.to_thread(r.wait_ready, self.start_timeout)
                               for r in waiting))
        self.reroute()

    async def drain(self, timeout: float = 300.0) -> int:
        """No new requests; wait (at most ``timeout``) for those in flight; how many are left."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while (self.outstanding or self.placing) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.outstanding + self.placing

    async def monitor(self) -> None:
        """Every 0.2 s: a replica whose process exited goes down; every half second each one up is
        probed (``HEALTH_FAILURES`` failed probes in a row: down); with auto-restart, a replica
        down is started again."""
        last_probe = 0.0
        while True:
            for r in self.replicas:
                code = r.exited()
                if r.up and code is not None:
                    self.take_down(r, f"its process exited with code {code}")
                if (self.auto_restart and not r.up and r.index not in self.restarting
                        and not self.draining):
                    self.background(self.restart(r))
            if time.monotonic() - last_probe >= HEALTH_EVERY_S:
                last_probe = time.monotonic()
                await asyncio.gather(*(self.probe(r) for r in self.replicas if r.up))
            await asyncio.sleep(0.2)

    async def still_there(self, replica: Replica) -> bool:
        """After an exchange with ``replica`` failed: is the replica itself still there? Its
        process (an exit shows within a moment of the connection's end), then a probe of its
        own (not one begun before the failure); taken down if not."""
        asked = time.monotonic()
        for _ in range(10):
            code = replica.exited()
            if code is not None:
                self.take_down(replica, f"its process exited with code {code}")
                return False
            await asyncio.sleep(0.02)
        running = self._probing.get(replica.index)
        if running is not None and running.started < asked:  # begun before: its answer is old
            await asyncio.shield(running)
        await self.probe(replica)
        return replica.up

    async def probe(self, replica: Replica) -> None:
        """Ask ``replica`` for ``/health`` (callers at the same time share one probe, so a burst
        of failed requests counts as one failure)."""
        task = self._probing.get(replica.index)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._probe_once(replica))
            task.started = time.monotonic()
            self._probing[replica.index] = task
            task.add_done_callback(lambda _: self._probing.pop(replica.index, None))
        await asyncio.shield(task)

    async def _probe_once(self, replica: Replica) -> None:
        watchdog = asyncio.get_running_loop().call_later(STALL_S, self.stalled, replica)
        try:
            r = await self.client.get(replica.url + "/health", timeout=2.0, headers=self.headers)
            ok = r.status_code == 200 or (r.status_code == 503 and "draining" in r.text)
        except httpx.ConnectError as exc:  # nothing listens: down now
            self.take_down(replica, f"refused a connection ({exc})")
            return
        except httpx.HTTPError:
            ok = False
        finally:
            watchdog.cancel()
        n = 0 if ok else self._probe_failures.get(replica.index, 0) + 1
        self._probe_failures[replica.index] = n
        if ok and replica.stalled:
            replica.stalled = False
            self.reroute()
            log.info("replica %d answers again: routed to", replica.index)
        if n >= HEALTH_FAILURES and replica.up:
            self.take_down(replica, f"no answer to /health {n} times in a row")

    def stalled(self, replica: Replica) -> None:
        """A replica that has not answered a probe within ``STALL_S``, nor sent a byte of any
        answer meanwhile (a hung process, a stopped one): routed nothing new, and what runs
        there moves to the others now (it is safe to: embeddings, generations as on a drain),
        instead of waiting for it."""
        if (not replica.up or replica.stalled
                or time.monotonic() - replica.last_heard < STALL_S):  # busy, but answering
            return
        replica.stalled = True
        self.reroute()
        moving = [a for a in replica.flights if a.movable or a.relay.kind is RequestKind.EMBEDDING]
        log.warning("replica %d did not answer /health within %.1f s: routed nothing new; %d "
                    "request(s) there move to other replicas", replica.index, STALL_S,
                    len(moving))
        for attempt in moving:
            attempt.end(f"replica {replica.index} stalled (no answer to /health in {STALL_S} s)",
                        "stalled")

    # ----- what the cluster reports ---------------------------------------------------------
    def health(self) -> tuple[int, dict]:
        up = {k for r in self.replicas if r.routable for k in SERVES[r.role]}
        missing = sorted(self.serves() - up)
        status = ("draining" if self.draining else "down" if missing
                  else "degraded" if not all(r.routable for r in self.replicas) else "ok")
        doc = {"status": status, "router": self.router.rule, "replicas": [r.status()
                                                                          for r in self.replicas]}
        if missing:
            doc["unserved"] = missing
        return (200 if status in ("ok", "degraded") else 503), doc

    def own_metrics(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gateway = self

        class Collector:
            def collect(self):
                up = GaugeMetricFamily("orthrus_cluster_replica_up", "1 while the replica is "
                                       "routed to", labels=["replica", "role"])
                work = GaugeMetricFamily("orthrus_cluster_outstanding_tokens", "Tokens routed to "
                                         "the replica and not finished", labels=["replica"])
                restarts = CounterMetricFamily("orthrus_cluster_restarts", "Times the replica was "
                                               "started again", labels=["replica"])
                routed = CounterMetricFamily("orthrus_cluster_routed", "Requests routed, by "
                                             "replica and kind", labels=["replica", "kind"])
                retried = CounterMetricFamily("orthrus_cluster_retries", "Requests the gateway "
                                              "sent again, by kind and why (down: the replica "
                                              "failed with it; lost: the connection failed, not "
                                              "the replica; stalled: the replica hung; refused: "
                                              "it never reached the engine; moved: a drain "
                                              "moved it)", labels=["kind", "why"])
                for (kind, why), n in sorted(gateway.retried.items()):
                    retried.add_metric([kind, why], n)
                moved = CounterMetricFamily("orthrus_cluster_migrations", "Streams that went on "
                                            "on another replica from the tokens they had sent",
                                            labels=["why"])
                for why, n in sorted(gateway.migrated.items()):
                    moved.add_metric([why], n)
                refused = CounterMetricFamily("orthrus_cluster_not_retried", "Requests whose "
                                              "replica failed and that were not sent again, by "
                                              "rule", labels=["why"])
                for why, n in sorted(gateway.not_retried.items()):
                    refused.add_metric([why], n)
                quarantined = CounterMetricFamily("orthrus_cluster_quarantined", "Requests "
                                                  "failed because replicas went down with them")
                quarantined.add_metric([], gateway.quarantine.total)
                yield from (retried, moved, refused, quarantined)
                for r in gateway.replicas:
                    i = str(r.index)
                    up.add_metric([i, r.role], 1.0 if r.up else 0.0)
                    work.add_metric([i], r.outstanding_work)
                    restarts.add_metric([i], r.restarts)
                    for kind in SERVES[r.role]:
                        routed.add_metric([i, kind], gateway.routed.get((r.index, kind), 0))
                yield from (up, work, restarts, routed)

        registry = CollectorRegistry()
        registry.register(Collector())
        return generate_latest(registry).decode()

    async def metrics(self) -> str:
        """Every replica's metrics under its ``replica`` label, then the gateway's own."""
        async def scrape(r: Replica) -> tuple[int, str | None]:
            try:
                resp = await self.client.get(r.url + "/metrics", timeout=5.0, headers=self.headers)
                return r.index, resp.text if resp.status_code == 200 else None
            except httpx.HTTPError:
                return r.index, None

        texts = await asyncio.gather(*(scrape(r) for r in self.replicas if r.up))
        return merge({i: t for i, t in texts if t is not None}) + self.own_metrics()

    async def load_models(self) -> None:
        """The model ids every replica answers to (a dedicated embedding replica may add the
        adapter's), each once."""
        seen: dict[str, dict] = {}
        for r in self.replicas:
            if r.up:
                resp = await self.client.get(r.url + "/v1/models", headers=self.headers)
                for card in resp.json()["data"]:
                    seen.setdefault(card["id"], card)
        self.models = list(seen.values())

    def any_up(self) -> Replica | None:
        return next((r for r in self.replicas if r.up), None)


def _tokenizer(model: str):
    """The model's tokenizer, for counting a request's tokens (None: counted by characters)."""
    path = Path(model) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
