"""OpenAI-compatible request bodies (validated; a bad field is named in a 400 error)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use
    model: StrictStr | None = None


TokenList = list[StrictInt]


class EmbeddingBody(_Body):
    input: StrictStr | list[StrictStr] | TokenList | list[TokenList]
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["mean", "weighted-mean", "cls", "last"] | None = None
    normalize: StrictBool | None = None

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


class _Sampling(_Body):
    max_tokens: StrictInt = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    n: StrictInt = Field(default=1, ge=1, le=1)
    ignore_eos: StrictBool = False

    def sampling_kwargs(self) -> dict:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)


class CompletionBody(_Sampling):
    prompt: StrictStr | TokenList

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    role: StrictStr
    content: StrictStr


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
