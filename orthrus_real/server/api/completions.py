"""``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed or not.

A list of prompts gives one choice per prompt (``index`` in order); streamed, the choices'
chunks interleave as tokens come. ``stream_options.include_usage`` adds a last chunk with the
usage and no choices, as OpenAI's API does; with vLLM's ``continuous_usage_stats`` too, every
chunk carries the usage so far, in vLLM's shape (its prompt's tokens and its choice's completion
tokens; a chat's role chunk 0), which load clients built for vLLM (guidellm) ask for.

Two extensions: ``return_token_ids`` (vLLM's) adds each choice's ``token_ids`` (streamed: the
chunk's new ones) and, once, its ``prompt_token_ids``; ``resume_token_ids`` continues a
generation from output tokens it already has (the cluster's gateway moving a stream off a replica
that went down): a stream sends only what follows them (and no role chunk: the stream it
continues had one), a whole answer holds them too; ``usage`` and ``max_tokens`` count them.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError

from orthrus_real.engine.sampling import SamplingParams
from orthrus_real.server.api.bodies import ChatBody, CompletionBody
from orthrus_real.server.api.context import GENERATE, ServerContext, context
from orthrus_real.server.api.errors import ApiError

router = APIRouter()


def _sse(payload: dict) -> str:
    return "data: " + json.dumps(payload) + "\n\n"


def _params(ctx: ServerContext, body, prompt_ids: list[int], param: str, chat: bool) -> dict:
    limit = ctx.max_model_len
    room = limit - len(prompt_ids)
    wanted = body.tokens_to_generate(default=max(room, 1) if chat else 16)
    if len(prompt_ids) + wanted > limit:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({wanted}) exceeds the "
                            f"model's maximum length {limit}", param, code="context_length_exceeded")
    try:
        params = SamplingParams(**{**body.sampling_kwargs(), "max_tokens": wanted})
    except ValueError as exc:  # the message starts with the parameter's name
        raise ApiError(400, str(exc), str(exc).split()[0]) from None
    return dict(token_ids=prompt_ids, params=params, resume_ids=body.resume_token_ids)


async def _generate(ctx: ServerContext, body, prompts: list[list[int]], request: Request, chat: bool):
    param = "messages" if chat else "prompt"
    model = body.model or ctx.served_name
    if body.resume_token_ids and len(prompts) != 1:
        raise ApiError(400, f"resume_token_ids continues one generation; this request has "
                            f"{len(prompts)} prompts", "resume_token_ids")
    resumed = len(body.resume_token_ids or ())
    with_ids = bool(body.return_token_ids)
    kwargs = [_params(ctx, body, ids, param, chat) for ids in prompts]
    pending: list[tuple[str, asyncio.Queue]] = []
    try:
        for kw in kwargs:
            pending.append(ctx.submit(GENERATE, kw, streamed=body.stream))
        created = int(time.time())
        rid = body.answer_id(pending[0][0])
        obj = "chat.completion" if chat else "text_completion"
        prompt_tokens = sum(len(ids) for ids in prompts)
        if not body.stream:
            outs = await ctx.finals(pending, request, param)
            choices = []
            for i, out in enumerate(outs):
                choice = {"index": i, "finish_reason": out.finish_reason, "logprobs": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": out.text}
                else:
                    choice["text"] = out.text
                if with_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = prompts[i], out.token_ids
                choices.append(choice)
            completion = sum(len(o.token_ids) for o in outs)
            return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                              "total_tokens": prompt_tokens + completion}}
        # a rejection still gets a proper status before the stream starts
        firsts = [await q.get() for _, q in pending]
        for item in firsts:
            ctx.raise_for(item, param)
    except ApiError:
        ctx.abort_all(r for r, _ in pending)
        raise
    chunk_obj = obj + ".chunk" if chat else obj

    async def events():
        merged: asyncio.Queue = asyncio.Queue()
        for i, item in enumerate(firsts):
            merged.put_nowait((i, item))

        async def forward(i: int, q: asyncio.Queue) -> None:
            while True:
                item = await q.get()
                await merged.put((i, item))
                if isinstance(item, Exception) or item.finished:
                    return

        forwarders = [asyncio.create_task(forward(i, q)) for i, (_, q) in enumerate(pending)
                      if not (isinstance(firsts[i], Exception) or firsts[i].finished)]
        done: set[int] = set()
        seen: set[int] = set()  # choices whose prompt_token_ids were sent
        counts = [resumed] * len(pending)  # each choice's completion tokens so far
        continuous = body.continuous_usage

        def usage(prompt: int, completion: int) -> dict:
            return {"prompt_tokens": prompt, "completion_tokens": completion,
                    "total_tokens": prompt + completion}

        def chunk(choice: dict, i: int) -> str:
            doc = {"id": rid, "object": chunk_obj, "created": created, "model": model,
                   "choices": [choice]}
            if continuous:
                doc["usage"] = usage(len(prompts[i]), counts[i])
            return _sse(doc)

        try:
            if chat and not resumed:
                for i in range(len(pending)):
                    yield chunk({"index": i, "delta": {"role": "assistant"}, "finish_reason": None}, i)
            while len(done) < len(pending):
                i, item = await merged.get()
                if isinstance(item, Exception):
                    yield _sse({"error": {"message": f"engine error: {item}", "type": "server_error",
                                          "param": None, "code": "engine_error"}})
                    done.add(i)
                    continue
                counts[i] += len(item.new_token_ids)
                if chat:
                    choice = {"index": i, "delta": {"content": item.new_text},
                              "finish_reason": item.finish_reason}
                else:
                    choice = {"index": i, "text": item.new_text, "logprobs": None,
                              "finish_reason": item.finish_reason}
                if with_ids:
                    choice["token_ids"] = item.new_token_ids
                    if i not in seen:
                        choice["prompt_token_ids"] = prompts[i]
                        seen.add(i)
                yield chunk(choice, i)
                if item.finished:
                    done.add(i)
            if body.include_usage:
                yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": model,
                            "choices": [], "usage": usage(prompt_tokens, sum(counts))})
            yield "data: [DONE]\n\n"
        finally:
            for task in forwarders:
                task.cancel()
            # the client went away mid-stream: abort what is still running
            ctx.abort_all(r for i, (r, _) in enumerate(pending) if i not in done)

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request, ctx: ServerContext = Depends(context)):
    body.check_supported()
    ctx.check_kind(GENERATE)
    ctx.check_model(body.model, "completions")
    items = body.prompts()
    ctx.check_count(len(items), "prompt")
    prompts = [await ctx.tokens_of(item, "prompt", body) for item in items]
    return await _generate(ctx, body, prompts, request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, request: Request, ctx: ServerContext = Depends(context)):
    body.check_supported()
    ctx.check_kind(GENERATE)
    ctx.check_model(body.model, "chat")
    if ctx.chat_template is None:
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       "messages")
    try:
        text = ctx.chat_template.render(body.template_variables())
    except TemplateError as exc:  # e.g. the template's raise_exception on what it was given
        raise ApiError(400, f"the chat template could not render this request: {exc}",
                       "messages") from None
    return await _generate(ctx, body, [await ctx.tokens_of({"text": text}, "messages", body)], request,
                           chat=True)
