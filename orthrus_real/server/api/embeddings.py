"""``POST /v1/embeddings``."""

from __future__ import annotations

import base64
import struct

from fastapi import APIRouter, Depends, Request

from orthrus_real.server.api.bodies import EmbeddingBody
from orthrus_real.server.api.context import EMBED, ServerContext, context
from orthrus_real.server.api.errors import ApiError

router = APIRouter()


BYTE_ORDER = {"native": "=", "little": "<", "big": ">"}  # vLLM's endianness, as struct spells it


def _encode(vec: list[float], fmt: str, endianness: str = "native"):
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"{BYTE_ORDER[endianness]}{len(vec)}f", *vec)).decode()
    return vec


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingBody, request: Request, ctx: ServerContext = Depends(context)):
    body.check_supported()
    ctx.check_kind(EMBED)
    ctx.check_model(body.model, "embeddings")
    pooling = body.pooling or ctx.default_pooling
    normalize = body.normalized(ctx.default_normalize)
    items = body.items()
    ctx.check_count(len(items), "input")
    inputs = [await ctx.tokens_of(item, "input", body) for item in items]
    limit = ctx.max_model_len
    for ids in inputs:
        if len(ids) > limit:
            raise ApiError(400, f"input has {len(ids)} tokens, more than the model's maximum "
                                f"length {limit}", "input", code="context_length_exceeded")
    pending = []
    try:
        for ids in inputs:
            pending.append(ctx.submit(EMBED, dict(token_ids=ids, pooling=pooling, normalize=normalize)))
        outs = await ctx.finals(pending, request, "input")
    except ApiError:
        ctx.abort_all(rid for rid, _ in pending)
        raise
    tokens = sum(len(x) for x in inputs)
    return {"object": "list", "model": body.model or ctx.served_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(o.embedding, body.encoding_format, body.endianness)}
                     for i, o in enumerate(outs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
