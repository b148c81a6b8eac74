"""The cluster's one OpenAI endpoint: each request routed to a replica by the project's router.

The rule is ``orthrus_sim.experiment.routing``'s (``make_router``: the simulator's own), over
``Replica`` objects that expose what it reads. On arrival the gateway counts the request's
tokens (the model's tokenizer; the output cap for generations), asks ``route`` for a replica
among those up, forwards the body unchanged and relays the answer (streamed bytes as they
come); when the answer ends, ``release``. A kind goes only to replicas whose role serves it,
so a dedicated split's embedding replicas get embeddings only.

A replica whose process exits, or that stops answering ``/health``, is taken out of routing at
once (the router is rebuilt over the replicas up) and every request in flight there ends with
a ``replica_failed`` error: a 503 before its answer started, an SSE error event mid-stream.
``POST /admin/replicas/{i}/restart`` starts it again (``--auto-restart``: the gateway does so by
itself). On SIGTERM the gateway drains: new requests get 503, those in flight finish, then each
replica drains and exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from orthrus_real.cluster.metrics_text import merge
from orthrus_real.cluster.replicas import SERVES, Replica, ServeOptions
from orthrus_real.server.api.errors import error_response
from orthrus_sim.engine.request import Request as RoutedRequest
from orthrus_sim.engine.request import RequestKind
from orthrus_sim.experiment.routing import make_router

log = logging.getLogger("orthrus")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
ROUTES = {"/v1/embeddings": RequestKind.EMBEDDING, "/v1/completions": RequestKind.GENERATION,
          "/v1/chat/completions": RequestKind.GENERATION}
FORWARDED_HEADERS = ("content-type", "authorization", "accept")
REPLICA_HEADER = "x-orthrus-replica"  # which replica answered (responses the gateway relays)
HEALTH_EVERY_S = 1.0
HEALTH_FAILURES = 3  # consecutive failed /health probes take a replica out


class Gateway:
    """The replicas, the router over those up, and the requests in flight."""

    def __init__(self, replicas: list[Replica], opts: ServeOptions, rule: str,
                 target_s: float | None = None, pack: float = 1.0, auto_restart: bool = False,
                 api_key: str | None = None, start_timeout: float = 300.0) -> None:
        self.replicas = replicas
        self.opts = opts
        self.rule, self.target_s, self.pack = rule, target_s, pack
        self.auto_restart = auto_restart
        self.start_timeout = start_timeout
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.owns_replicas = True  # stops them when it exits (Ray Serve stops its own)
        self.draining = False  # DrainingServer's protocol (as an EngineThread's)
        self.failed = None
        self.outstanding = 0  # requests in flight through the gateway
        self.routed: dict[tuple[int, str], int] = {}
        self.restarting: set[int] = set()
        self._probe_failures: dict[int, int] = {}
        self._tasks: set[asyncio.Task] = set()  # background restarts and probes, kept alive
        self.models: list[dict] = []
        self.client: httpx.AsyncClient | None = None
        self.tokenizer = _tokenizer(opts.model)
        self.router = self._router()

    # ----- routing --------------------------------------------------------------------------
    def _router(self):
        return make_router(self.rule, [r for r in self.replicas if r.up], self.target_s, self.pack)

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

    def routed_request(self, kind: RequestKind, body: bytes) -> RoutedRequest:
        """What the router weighs: prompt tokens, and for generations the output cap."""
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        doc = doc if isinstance(doc, dict) else {}
        if kind is RequestKind.EMBEDDING:
            n_in, n_out = self._count(doc.get("input", "")), 0
        else:
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
            n_out = (cap if isinstance(cap, int) and cap > 0 else 16) * count
        return RoutedRequest(f"gw-{uuid.uuid4().hex}", kind, time.monotonic(), max(n_in, 1),
                             max_output_tokens=n_out, expected_output_tokens=n_out or None)

    async def forward(self, request: Request, path: str, kind: RequestKind) -> Response:
        if self.draining:
            return error_response(503, "draining: the cluster is shutting down", kind="server_error",
                                  code="draining")
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        loop = asyncio.get_running_loop()
        routed = await loop.run_in_executor(None, self.routed_request, kind, body)
        for attempt in range(2):
            replica = self.router.route(routed)
            if replica is None:
                return error_response(503, f"no replica serving {kind.value} requests is up "
                                           f"(see /health)", kind="server_error",
                                      code="no_replica")
            self.routed[(replica.index, kind.value)] = self.routed.get(
                (replica.index, kind.value), 0) + 1
            upstream = self.client.build_request("POST", replica.url + path, content=body,
                                                 headers=headers)
            flight = Flight(self, replica, routed)
            first = await flight.start(upstream)
            if first[0] == "head":
                break
            if first[0] == "retry" and attempt == 0:
                continue  # it died before taking the request: another replica gets it
            return error_response(503, first[1], kind="server_error", code="replica_failed")
        _, status, media_type = first
        which = {REPLICA_HEADER: str(replica.index)}
        if media_type and media_type.startswith("text/event-stream"):
            return StreamingResponse(flight.events(), status_code=status, media_type=media_type,
                                     headers=which)
        data, error = await flight.body()
        if error:
            return error_response(502, error, kind="server_error", code="replica_failed")
        return Response(data, status_code=status, media_type=media_type, headers=which)

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
        log.warning("replica %d (%s on %s) is down: %s; %d request(s) in flight there end with "
                    "an error", replica.index, replica.role, replica.spec.device, reason,
                    len(replica.flights))
        for task in list(replica.flights):
            task.cancel(f"replica {replica.index} went down: {reason}")
        replica.kill()  # if it hangs: gone before a restart

    async def restart(self, replica: Replica) -> None:
        """Drain and stop the replica if it runs, start it again, route to it once ready."""
        if replica.index in self.restarting:
            return
        self.restarting.add(replica.index)
        try:
            if replica.up:
                replica.up = False
                self.reroute()
            await asyncio.to_thread(replica.stop)
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
        while self.outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.outstanding

    async def monitor(self) -> None:
        """Every 0.2 s: a replica whose process exited goes down; every second each one up is
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
                await asyncio.gather(*(self._probe(r) for r in self.replicas if r.up))
            await asyncio.sleep(0.2)

    async def _probe(self, replica: Replica) -> None:
        try:
            r = await self.client.get(replica.url + "/health", timeout=2.0, headers=self.headers)
            ok = r.status_code == 200 or (r.status_code == 503 and "draining" in r.text)
        except httpx.ConnectError as exc:  # nothing listens: down now
            self.take_down(replica, f"refused a connection ({exc})")
            return
        except httpx.HTTPError:
            ok = False
        n = 0 if ok else self._probe_failures.get(replica.index, 0) + 1
        self._probe_failures[replica.index] = n
        if n >= HEALTH_FAILURES and replica.up:
            self.take_down(replica, f"no answer to /health {n} times in a row")

    # ----- what the cluster reports ---------------------------------------------------------
    def health(self) -> tuple[int, dict]:
        up = {k for r in self.replicas if r.up for k in SERVES[r.role]}
        missing = sorted(self.serves() - up)
        status = ("draining" if self.draining else "down" if missing
                  else "degraded" if not all(r.up for r in self.replicas) else "ok")
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


class Flight:
    """One request's exchange with a replica, run in its own task (``replica.flights``) so that
    a replica going down can end it; what comes back goes through a queue to the client."""

    def __init__(self, gateway: Gateway, replica: Replica, routed: RoutedRequest) -> None:
        self.gateway, self.replica, self.routed = gateway, replica, routed
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def start(self, upstream: httpx.Request) -> tuple:
        """Send it; the first item: ``("head", status, content type)``, ``("retry", why)``
        (refused before the replica took it) or ``("error", why)``."""
        gw, replica = self.gateway, self.replica
        work = self.routed.remaining_work(True)
        replica.outstanding_work += work
        gw.outstanding += 1
        self.task = asyncio.create_task(self._pump(upstream, work))
        replica.flights.add(self.task)
        return await self.queue.get()

    async def _pump(self, upstream: httpx.Request, work: int) -> None:
        gw, replica = self.gateway, self.replica
        started = False
        try:
            resp = await gw.client.send(upstream, stream=True)
            try:
                started = True
                self.queue.put_nowait(("head", resp.status_code, resp.headers.get("content-type")))
                async for chunk in resp.aiter_raw():
                    self.queue.put_nowait(("data", chunk))
                self.queue.put_nowait(("end",))
            finally:
                await resp.aclose()
        except asyncio.CancelledError as exc:
            reason = exc.args[0] if exc.args else f"replica {replica.index}: request cancelled"
            self.queue.put_nowait(("error", reason))
            raise
        except httpx.HTTPError as exc:
            refused = isinstance(exc, httpx.ConnectError) and not started
            reason = (f"replica {replica.index} failed "
                      f"{'mid-answer' if started else 'before answering'}: "
                      f"{type(exc).__name__}: {exc}")
            self.queue.put_nowait(("retry" if refused else "error", reason))
            if replica.exited() is not None:
                gw.take_down(replica, f"its process exited with code {replica.exited()}")
            elif refused:  # nothing listens there any more
                gw.take_down(replica, reason)
            else:
                gw.background(gw._probe(replica))
        finally:
            replica.flights.discard(self.task)
            replica.outstanding_work -= work
            gw.outstanding -= 1
            gw.router.release(self.routed)

    async def body(self) -> tuple[bytes, str | None]:
        parts = []
        while True:
            item = await self.queue.get()
            if item[0] == "data":
                parts.append(item[1])
            elif item[0] == "end":
                return b"".join(parts), None
            else:
                return b"", item[1]

    async def events(self):
        try:
            while True:
                item = await self.queue.get()
                if item[0] == "data":
                    yield item[1]
                elif item[0] == "end":
                    return
                else:  # the replica went away mid-stream: say so, and end the stream
                    yield ("data: " + json.dumps({"error": {
                        "message": item[1], "type": "server_error", "param": None,
                        "code": "replica_failed"}}) + "\n\n").encode()
                    return
        finally:
            if self.task is not None and not self.task.done():
                self.task.cancel("the client went away")  # the replica aborts the request


def _tokenizer(model: str):
    """The model's tokenizer, for counting a request's tokens (None: counted by characters)."""
    path = Path(model) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
