"""OpenAI-compatible request bodies (validated; a bad or unknown field is named in a 400 error).

What the server does with each parameter of vLLM's request models (and of OpenAI's that vLLM
lacks) is one mapping, ``surface.py``: a body declares the parameters it honours (checked at
import against that mapping), and before a body is validated the mapping drops what it ignores
and refuses, by name and with the reason, a parameter this server does not implement given a
value that would change the answer (its neutral values, which clients built for vLLM always
send, are accepted). Any other field is an unknown parameter: a typo must not be ignored.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from orthrus_real.server.api import surface
from orthrus_real.server.api.surface import ParameterError, Unsupported

__all__ = ["ChatBody", "ChatMessage", "CompletionBody", "EmbeddingBody", "ParameterError",
           "StreamOptions", "Unsupported", "check_text"]

TokenList = list[StrictInt]


def _undecodable(value, path: str) -> str | None:
    """The path of the first string in ``value`` that is not valid Unicode (a lone surrogate,
    which JSON's \\u escapes can carry), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            if (bad := _undecodable(v, f"{path}[{i}]")) is not None:
                return bad
    elif isinstance(value, dict):
        for k, v in value.items():
            if (bad := _undecodable(k, path) or _undecodable(v, f"{path}.{k}")) is not None:
                return bad
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            if (bad := _undecodable(getattr(value, name), f"{path}.{name}")) is not None:
                return bad
    return None


def check_text(body: BaseModel) -> None:
    """Every string of ``body`` must be valid Unicode: a 400 naming the field otherwise."""
    for name in type(body).model_fields:
        bad = _undecodable(getattr(body, name), name)
        if bad is not None:
            raise ParameterError(name, f"{bad} is not valid Unicode text (it holds a lone "
                                       "surrogate, such as \\udfff)")


def _surface_schema(schema: dict, cls: type) -> None:
    """The OpenAPI document lists the ignored and refused parameters too, with their reasons."""
    if cls.ENDPOINT:
        surface.schema_extra(cls.ENDPOINT)(schema)


class _Body(BaseModel):
    """A request body: its honoured parameters as fields; the rest of its endpoint's surface is
    dropped or refused before validation (``surface.apply``)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_surface_schema)
    ENDPOINT: ClassVar[str] = ""
    model: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _surface(cls, data):
        return surface.apply(cls.ENDPOINT, data) if isinstance(data, dict) else data

    def check_supported(self) -> None:
        check_text(self)


class _Truncating(_Body):
    """vLLM's ``truncate_prompt_tokens``, ``truncation_side`` and ``add_special_tokens``."""

    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: StrictBool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.truncate_prompt_tokens == 0:
            raise ParameterError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the "
                                 "model's maximum length) or a number of tokens >= 1")

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """``truncate_prompt_tokens`` tokens of ``ids``: the last ones, or with
        ``truncation_side: right`` the first (vLLM's meaning)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = max_model_len
        if k > max_model_len:
            raise ParameterError("truncate_prompt_tokens", f"truncate_prompt_tokens ({k}) is more "
                                 f"than the model's maximum length {max_model_len}")
        return ids[:k] if self.truncation_side == "right" else ids[-k:]


class EmbeddingBody(_Truncating):
    ENDPOINT: ClassVar[str] = "/v1/embeddings"
    input: StrictStr | list[StrictStr] | TokenList | list[TokenList]
    encoding_format: Literal["float", "base64"] = "float"
    endianness: Literal["native", "little", "big"] = "native"
    pooling: Literal["mean", "weighted-mean", "cls", "last"] | None = None
    normalize: StrictBool | None = None
    use_activation: StrictBool | None = None  # vLLM's name for normalize

    def check_supported(self) -> None:
        super().check_supported()
        if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
            raise ParameterError("use_activation", "use_activation (vLLM's name for normalize) "
                                 "and normalize disagree")

    def normalized(self, default: bool) -> bool:
        """Whether the pooled vector is normalised: ``normalize`` or ``use_activation``."""
        given = self.normalize if self.normalize is not None else self.use_activation
        return default if given is None else given

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, str):
            if not v:
                raise ValueError("input must not be empty")
        elif not v or any(isinstance(x, str | list) and len(x) == 0 for x in v):
            raise ValueError("input must not be empty (nor hold an empty item)")
        return v

    def items(self) -> list[dict]:
        """One engine request per input: ``{'text': ...}`` or ``{'token_ids': [...]}``."""
        v = self.input
        if isinstance(v, str):
            return [{"text": v}]
        if all(isinstance(x, int) for x in v):
            return [{"token_ids": list(v)}]
        return [{"text": x} if isinstance(x, str) else {"token_ids": list(x)} for x in v]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ENDPOINT: ClassVar[str] = "stream_options"
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _Sampling(_Truncating):
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)  # what torch takes
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenList | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    request_id: StrictStr | None = None  # vLLM's: the answer's id
    return_token_ids: StrictBool | None = None  # vLLM's: each choice's token ids in its answer
    # the output tokens this generation already has (a gateway moving it off a replica that went
    # down): prefilled with the prompt, counted in max_tokens, and only what follows is answered
    resume_token_ids: TokenList | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed with stream: true")
        if self.resume_token_ids is not None and not self.resume_token_ids:
            raise ParameterError("resume_token_ids", "resume_token_ids must not be empty")

    def tokens_to_generate(self, default: int = 16) -> int:
        return self.max_tokens if self.max_tokens is not None else default

    def sampling_kwargs(self) -> dict:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return dict(max_tokens=self.tokens_to_generate(),
                    temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p,
                    top_k=max(self.top_k or 0, 0), seed=self.seed, stop=stop,
                    stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's ``continuous_usage_stats``, with ``include_usage``."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def answer_id(self, rid: str) -> str:
        """The id the answer carries: ``cmpl-<request_id>`` if the client named it."""
        return f"cmpl-{self.request_id}" if self.request_id is not None else rid


class CompletionBody(_Sampling):
    ENDPOINT: ClassVar[str] = "/v1/completions"
    prompt: StrictStr | list[StrictStr] | TokenList | list[TokenList]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if len(v) == 0 or (not isinstance(v, str) and any(isinstance(x, str | list) and len(x) == 0
                                                          for x in v)):
            raise ValueError("prompt must not be empty (nor hold an empty item)")
        return v

    def prompts(self) -> list[dict]:
        """One generation per prompt: ``{'text': ...}`` or ``{'token_ids': [...]}``."""
        v = self.prompt
        if isinstance(v, str):
            return [{"text": v}]
        if all(isinstance(x, int) for x in v):
            return [{"token_ids": list(v)}]
        return [{"text": x} if isinstance(x, str) else {"token_ids": list(x)} for x in v]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ContentPart]
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(_Sampling):
    ENDPOINT: ClassVar[str] = "/v1/chat/completions"
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    add_generation_prompt: StrictBool = True
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_variables(self) -> dict[str, Any]:
        """What the chat template renders: the request's variables over its extra ones."""
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        return {**(self.chat_template_kwargs or {}), "messages": messages,
                "add_generation_prompt": self.add_generation_prompt, "documents": self.documents,
                "bos_token": "<s>", "eos_token": "</s>"}

    def tokens_to_generate(self, default: int = 16) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().tokens_to_generate(default)


for _body in (CompletionBody, ChatBody, EmbeddingBody, StreamOptions):
    surface.check_declared(_body.ENDPOINT, set(_body.model_fields))
