"""OpenAI-compatible request bodies (validated; a bad or unknown field is named in a 400 error).

Every parameter of OpenAI's API is either supported or refused by name: an unknown field is an
error (a typo must not be ignored), and a known one this server does not implement (``logprobs``,
``dimensions``, penalties, tools, ...) is refused when it is given a value that would change the
result. Fields that only label a request (``user``, ``metadata``, ``store``) are accepted.

vLLM's own clients (``vllm bench serve``, its OpenAI extensions) always send some of vLLM's extra
parameters: their neutral values are accepted (``repetition_penalty`` 1, ``min_p`` 0, other
values refused as unsupported), and ``truncate_prompt_tokens`` (keep the last k tokens; -1: the
model's maximum length) and ``add_special_tokens`` are implemented as vLLM defines them.
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
)

TokenList = list[StrictInt]


class ParameterError(ValueError):
    """A request parameter that cannot be served as given; ``param`` names it."""

    code = "invalid_parameter"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Unsupported(ParameterError):
    """A known OpenAI parameter this server does not implement."""

    code = "unsupported_parameter"

    def __init__(self, param: str) -> None:
        super().__init__(param, f"{param} is not supported by this server")


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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None

    # parameter -> value(s) that leave the result unchanged (anything else is refused)
    NEUTRAL: ClassVar[dict[str, tuple]] = {}

    def check_supported(self) -> None:
        check_text(self)
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                raise Unsupported(name)


class _Truncating(_Body):
    """vLLM's ``truncate_prompt_tokens`` and ``add_special_tokens`` (its clients send them)."""

    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    add_special_tokens: StrictBool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.truncate_prompt_tokens == 0:
            raise ParameterError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the "
                                 "model's maximum length) or a number of tokens >= 1")

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The last ``truncate_prompt_tokens`` tokens of ``ids`` (vLLM's meaning)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = max_model_len
        if k > max_model_len:
            raise ParameterError("truncate_prompt_tokens", f"truncate_prompt_tokens ({k}) is more "
                                 f"than the model's maximum length {max_model_len}")
        return ids[-k:]


class EmbeddingBody(_Truncating):
    input: StrictStr | list[StrictStr] | TokenList | list[TokenList]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    pooling: Literal["mean", "weighted-mean", "cls", "last"] | None = None
    normalize: StrictBool | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {"dimensions": ()}

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
    include_usage: StrictBool = False


class _Sampling(_Truncating):
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)  # what torch takes
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's; its clients send 1.0
    min_p: float | None = None  # vLLM's
    return_token_ids: StrictBool | None = None  # vLLM's: each choice's token ids in its answer
    # the output tokens this generation already has (a gateway moving it off a replica that went
    # down): prefilled with the prompt, counted in max_tokens, and only what follows is answered
    resume_token_ids: TokenList | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "n": (1,), "logprobs": (False, None), "logit_bias": ({},),
        "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
        "repetition_penalty": (1, 1.0), "min_p": (0, 0.0)}

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
        return dict(max_tokens=self.tokens_to_generate(), temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=stop,
                    ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(_Sampling):
    prompt: StrictStr | list[StrictStr] | TokenList | list[TokenList]
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {**_Sampling.NEUTRAL, "echo": (False,), "best_of": (1,),
                                           "suffix": ("",)}

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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_Sampling.NEUTRAL, "top_logprobs": (0,), "tools": ([],),
        "response_format": ({"type": "text"},), "tool_choice": ("none",),
        "parallel_tool_calls": (False, True)}

    def tokens_to_generate(self, default: int = 16) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().tokens_to_generate(default)
