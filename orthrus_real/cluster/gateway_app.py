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

from orthrus_real.cluster.gateway import ROUTES, Gateway, log
from orthrus_real.cluster.replicas import Replica, stop_all
from orthrus_real.server.api.errors import BearerAuth, BodyLimit, error_response


def create_gateway_app(gateway: Gateway, max_body_bytes: int = 1 << 20,
                       api_key: str | None = None) -> FastAPI:
    """The OpenAI routes, ``/health``, ``/metrics`` (aggregated and per replica) and the admin
    routes over a gateway whose replicas are ready."""
    from orthrus_sim import __version__

    app = FastAPI(title="Orthrus cluster", version=__version__, lifespan=_lifespan(gateway))
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
        await gateway.attach()
        await gateway.load_models()
        watch = asyncio.create_task(gateway.monitor())
        try:
            yield
        finally:
            watch.cancel()
            await gateway.client.aclose()
            if gateway.owns_replicas:
                log.info("stopping %d replica(s)", len(gateway.replicas))
                await asyncio.to_thread(stop_all, gateway.replicas)

    return lifespan


def relay_routes(gateway: Gateway) -> APIRouter:
    """The OpenAI routes, each request routed by the cluster's rule; tokenize and detokenize
    on any replica up (every replica has the same model)."""
    router = APIRouter()
    for path, kind in ROUTES.items():
        async def route(request: Request, _path=path, _kind=kind):
            return await gateway.forward(request, _path, _kind)
        router.add_api_route(path, route, methods=["POST"])

    async def any_replica(request: Request):
        replica = gateway.any_up()
        if replica is None:
            return error_response(503, "no replica is up", kind="server_error", code="no_replica")
        resp = await gateway.client.post(replica.url + request.url.path, content=await request.body(),
                                         headers={"content-type": "application/json"})
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    for path in ("/tokenize", "/detokenize"):
        router.add_api_route(path, any_replica, methods=["POST"])
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
    """One replica's metrics, every replica's status, and restarting one."""
    router = APIRouter()

    def replica_at(index: int) -> Replica | None:
        return gateway.replicas[index] if 0 <= index < len(gateway.replicas) else None

    def no_replica(index: int):
        return error_response(404, f"no replica {index}: the cluster has replicas 0-"
                                   f"{len(gateway.replicas) - 1}", "replica",
                              code="replica_not_found")

    @router.get("/replicas/{index}/metrics")
    async def replica_metrics(index: int):
        replica = replica_at(index)
        if replica is None:
            return no_replica(index)
        if not replica.up:
            return error_response(503, f"replica {index} is down", kind="server_error",
                                  code="replica_down")
        resp = await gateway.client.get(replica.url + "/metrics", timeout=5.0)
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    @router.get("/admin/replicas")
    async def replicas():
        return {"replicas": [r.status() for r in gateway.replicas]}

    @router.post("/admin/replicas/{index}/restart")
    async def restart(index: int):
        replica = replica_at(index)
        if replica is None:
            return no_replica(index)
        if gateway.draining:
            return error_response(503, "draining: no restarts", kind="server_error",
                                  code="draining")
        if index in gateway.restarting:
            return JSONResponse({"replica": index, "status": "restarting"}, status_code=202)
        gateway.background(gateway.restart(replica))
        return JSONResponse({"replica": index, "status": "restarting"}, status_code=202)

    return router
