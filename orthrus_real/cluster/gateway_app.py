"""The gateway's HTTP application: the OpenAI routes relayed to a replica, the routes that
describe the cluster (health, version, models, metrics) and the admin routes over its replicas,
each set one ``APIRouter`` built over the ``Gateway`` (``gateway.py``), which does the routing,
forwarding and failover."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from orthrus_real.cluster.gateway import ROUTES, Gateway, log
from orthrus_real.cluster.replicas import Replica, stop_all
from orthrus_real.cluster.upstream import UpstreamPool
from orthrus_real.server.api.admin import DetokenizeBody, TokenizeBody
from orthrus_real.server.api.bodies import ChatBody, CompletionBody, EmbeddingBody
from orthrus_real.server.api.errors import BearerAuth, BodyLimit, error_response, install_handlers
from orthrus_sim.engine.request import RequestKind


def create_gateway_app(gateway: Gateway, max_body_bytes: int = 1 << 20,
                       api_key: str | None = None) -> FastAPI:
    """The OpenAI routes, ``/health``, ``/metrics`` (aggregated and per replica) and the admin
    routes over a gateway whose replicas are ready."""
    from orthrus_sim import __version__

    app = FastAPI(title="Orthrus cluster", version=__version__, lifespan=_lifespan(gateway))
    install_handlers(app)  # its own errors (unknown path, bad path parameter) in OpenAI's shape
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)
    for router in (relay_routes(gateway), cluster_routes(gateway, __version__),
                   replica_routes(gateway)):
        app.include_router(router)
    return app


def _lifespan(gateway: Gateway):
    """Start: the HTTP client to the replicas, their models and the health monitor. End (after
    uvicorn drained the gateway): each replica the gateway owns drains and exits."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        gateway.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                           limits=httpx.Limits(max_connections=4096,
                                                               max_keepalive_connections=256),
                                           headers=gateway.headers)
        gateway.upstream = UpstreamPool(gateway.headers)  # the relayed requests' connections
        await gateway.attach()
        await gateway.load_models()
        watch = asyncio.create_task(gateway.monitor())
        try:
            yield
        finally:
            watch.cancel()
            gateway.upstream.close()
            await gateway.client.aclose()
            if gateway.owns_replicas:
                log.info("stopping %d replica(s)", len(gateway.replicas))
                await asyncio.to_thread(stop_all, gateway.replicas)

    return lifespan


def relay_routes(gateway: Gateway) -> APIRouter:
    """The OpenAI routes, each request routed by the cluster's rule; tokenize and detokenize
    on any replica up (every replica has the same model)."""
    router = APIRouter()

    def documented(body: type[BaseModel]) -> dict:
        """The replica's body schema, for the OpenAPI document only (the body is relayed as
        it came; the replica validates it): its ``$defs`` inlined so every ref resolves here."""
        schema = body.model_json_schema()
        defs = schema.pop("$defs", {})

        def inline(node):
            if isinstance(node, dict):
                ref = node.get("$ref", "")
                if ref.startswith("#/$defs/"):
                    return inline(defs[ref.removeprefix("#/$defs/")])
                return {k: inline(v) for k, v in node.items()}
            return [inline(v) for v in node] if isinstance(node, list) else node

        return {"requestBody": {"required": True, "content": {
            "application/json": {"schema": inline(schema)}}}}

    bodies = {"/v1/embeddings": EmbeddingBody, "/v1/completions": CompletionBody,
              "/v1/chat/completions": ChatBody, "/tokenize": TokenizeBody,
              "/detokenize": DetokenizeBody}

    def relay(path: str, kind: RequestKind):
        # path and kind bound here, not as defaults: FastAPI makes a default a query parameter
        async def route(request: Request):
            return await gateway.forward(request, path, kind)
        return route

    for path, kind in ROUTES.items():
        router.add_api_route(path, relay(path, kind), methods=["POST"],
                             openapi_extra=documented(bodies[path]))

    async def any_replica(request: Request):
        replica = gateway.any_up()
        if replica is None:
            return error_response(503, "no replica is up", kind="server_error", code="no_replica")
        resp = await gateway.client.post(replica.url + request.url.path, content=await request.body(),
                                         headers={"content-type": "application/json"})
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    for path in ("/tokenize", "/detokenize"):
        router.add_api_route(path, any_replica, methods=["POST"],
                             openapi_extra=documented(bodies[path]))
    return router


def cluster_routes(gateway: Gateway, app_version: str) -> APIRouter:
    """What the cluster is: its health, version, models and aggregated metrics."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        status, doc = gateway.health()
        return JSONResponse(doc, status_code=status)

    @router.get("/version")
    async def version():
        return {"version": app_version}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": gateway.models}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        card = next((m for m in gateway.models if m["id"] == model_id), None)
        if card is None:
            return error_response(404, f"model {model_id!r} does not exist; this cluster serves "
                                       f"{', '.join(m['id'] for m in gateway.models)}", "model",
                                  code="model_not_found")
        return card

    @router.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await gateway.metrics(), media_type=CONTENT_TYPE_LATEST)

    return router


def replica_routes(gateway: Gateway) -> APIRouter:
    """One replica's metrics, every replica's status, restarting, draining and resuming one."""
    router = APIRouter()

    def replica_at(index: int) -> Replica | None:
        return gateway.replicas[index] if 0 <= index < len(gateway.replicas) else None

    def no_replica(index: int):
        return error_response(404, f"no replica {index}: the cluster has replicas 0-"
                                   f"{len(gateway.replicas) - 1}", "replica",
                              code="replica_not_found")

    def up_at(index: int) -> tuple[Replica | None, Response | None]:
        """The replica ``index`` if it is up, else the error that says why not."""
        replica = replica_at(index)
        if replica is None:
            return None, no_replica(index)
        if not replica.up:
            return None, error_response(503, f"replica {index} is down", kind="server_error",
                                        code="replica_down")
        return replica, None

    @router.get("/replicas/{index}/metrics")
    async def replica_metrics(index: int):
        replica, error = up_at(index)
        if error is not None:
            return error
        resp = await gateway.client.get(replica.url + "/metrics", timeout=5.0)
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    @router.get("/admin/replicas")
    async def replicas():
        return {"replicas": [r.status() for r in gateway.replicas]}

    @router.post("/admin/replicas/{index}/restart")
    async def restart(index: int, migrate: bool = False):
        """Drain the replica (``migrate``: its generations move to the others at once), stop
        it, start it again; answers at once (202)."""
        replica = replica_at(index)
        if replica is None:
            return no_replica(index)
        if gateway.draining:
            return error_response(503, "draining: no restarts", kind="server_error",
                                  code="draining")
        if index in gateway.restarting:
            return JSONResponse({"replica": index, "status": "restarting"}, status_code=202)
        gateway.background(gateway.restart(replica, migrate))
        return JSONResponse({"replica": index, "status": "restarting"}, status_code=202)

    @router.post("/admin/replicas/{index}/drain")
    async def drain(index: int, migrate: bool = False, timeout: float = 300.0):
        """No new requests to the replica; ``migrate``: its generations move to other replicas
        now (streams continue from the tokens they sent) instead of finishing there. Answers
        when nothing is left there (or after ``timeout`` s), with how many moved."""
        replica, error = up_at(index)
        if error is not None:
            return error
        return await gateway.drain_replica(replica, migrate, max(timeout, 0.0))

    @router.post("/admin/replicas/{index}/resume")
    async def resume(index: int):
        """A drained replica is routed to again."""
        replica = replica_at(index)
        if replica is None:
            return no_replica(index)
        gateway.resume(replica)
        return {"replica": index, "status": "up" if replica.up else "down"}

    return router
