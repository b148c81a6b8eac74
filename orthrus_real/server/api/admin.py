"""Health, models, metrics, version, and the tokenizer (``/tokenize``, ``/detokenize``, as
vLLM's server offers them)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from orthrus_real.server.api.bodies import ChatMessage, check_text
from orthrus_real.server.api.context import ServerContext, context
from orthrus_real.server.api.errors import ApiError, error_response

router = APIRouter()


@router.get("/health")
async def health(ctx: ServerContext = Depends(context)):
    runner = ctx.runner
    if runner.failed:
        return error_response(503, f"engine failed: {runner.failed}", kind="server_error",
                              code="engine_failed")
    if runner.draining:
        return error_response(503, "draining", kind="server_error", code="draining")
    return {"status": "ok"}


@router.get("/engine")
async def engine_info(ctx: ServerContext = Depends(context)):
    """What the engine loaded (as the startup log says it), its KV capacity and the request
    kinds its policy serves: what a cluster's gateway lists for each replica."""
    engine = ctx.engine
    cfg = engine.scheduler_config
    return {**{k: str(v) for k, v in engine.describe().items()}, "num_blocks": cfg.num_blocks,
            "block_size": cfg.block_size, "serves": list(ctx.serves_kinds)}


@router.get("/iterations")
async def iterations(since: int = 0, limit: int = 10_000, ctx: ServerContext = Depends(context)):
    """The engine's most recent iterations after iteration ``since`` (at most ``limit``, the
    oldest first): when each started, how long it took, what it carried and the cost model's
    ``shape`` of it, so what a deployment ran can be set beside what the cost model predicts
    (``scripts/iteration_residuals.py``). ``next`` is the ``since`` of the following call."""
    from dataclasses import asdict

    if since < 0 or not 1 <= limit <= 100_000:
        raise ApiError(400, "since must be >= 0 and limit 1-100000, got "
                            f"since={since}, limit={limit}", param="since" if since < 0 else "limit")
    kept = list(ctx.engine.stats)  # one C-level copy under the GIL: the engine thread appends
    rows = [s for s in kept if s.iteration > since][:limit]
    return {"object": "list", "next": rows[-1].iteration if rows else since,
            "data": [{k: v for k, v in asdict(s).items() if k != "admitted"} for s in rows]}


@router.get("/version")
async def version():
    from orthrus_sim import __version__

    return {"version": __version__}


def _model_card(ctx: ServerContext, name: str) -> dict:
    entry = ctx.models[name]
    return {"id": name, "object": "model", "created": 0, "owned_by": "orthrus",
            "root": ctx.served_name, "parent": None if name == ctx.served_name else ctx.served_name,
            "max_model_len": ctx.max_model_len, "serves": entry["serves"],
            "description": entry["about"]}


@router.get("/v1/models")
async def models(ctx: ServerContext = Depends(context)):
    """Each id with what it serves (``serves``) and what it is (``description``)."""
    return {"object": "list", "data": [_model_card(ctx, name) for name in ctx.models]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, ctx: ServerContext = Depends(context)):
    """One id's card (the ``openai`` client's ``models.retrieve``)."""
    if model_id not in ctx.models:
        ctx.check_model(model_id, "")  # the 404, naming the ids there are
    return _model_card(ctx, model_id)


@router.get("/metrics")
async def prometheus(ctx: ServerContext = Depends(context)):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    if ctx.metrics is None:
        raise ApiError(404, "metrics are disabled")
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True  # vLLM's


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[StrictInt]


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, ctx: ServerContext = Depends(context)):
    check_text(body)
    ctx.check_model(body.model, "embeddings")
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        if ctx.chat_template is None:
            raise ApiError(400, "this model's tokenizer has no chat template", "messages")
        text = ctx.chat_template.render(
            messages=[{"role": m.role, "content": m.text()} for m in body.messages],
            add_generation_prompt=body.add_generation_prompt, bos_token="<s>", eos_token="</s>")
    else:
        text = body.prompt
    ids = await ctx.encode(text, "messages" if body.messages is not None else "prompt",
                           body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, ctx: ServerContext = Depends(context)):
    vocab = ctx.engine.cfg.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"tokens must be in [0, {vocab}), got {bad[0]}", "tokens")
    return {"prompt": ctx.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}
