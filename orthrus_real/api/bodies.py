"""OpenAI-compatible request bodies (validated; a bad or unknown field is named in a 400 error).

Every parameter of OpenAI's API is either supported or refused by name: an unknown field is an
error (a typo must not be ignored), and a known one this server does not implement (``logprobs``,
``dimensions``, penalties, tools, ...) is refused when it is given a value that would change the
result. Fields that only label a request (``user``, ``metadata``, ``store``) are accepted.
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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None

    # parameter -> value(s) that leave the result unchanged (anything else is refused)
    NEUTRAL: ClassVar[dict[str, tuple]] = {}

    def check_supported(self) -> None:
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                raise Unsupported(name)


class EmbeddingBody(_Body):
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


class _Sampling(_Body):
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "n": (1,), "logprobs": (False, None), "logit_bias": ({},),
        "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0)}

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed with stream: true")

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
