"""Sampling parameters and the sampler for the generation slice of a batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
             and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (isinstance(self.temperature, int | float) and self.temperature >= 0,
             "temperature must be a number >= 0"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids must be integers"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` (float32, (S, V))."""
    out = []
    for row, p, gen in zip(logits, params, generators):
        if p.temperature == 0:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, -1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # smallest prefix reaching top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
