"""Sampling parameters and the sampler for the generation slice of a batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Below this temperature a row is sampled greedily (vLLM's threshold too): dividing float32
# logits by a vanishing temperature gives inf or nan, which torch.multinomial refuses.
GREEDY_BELOW = 1e-5


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
    """One token per row of ``logits`` ((S, V), on any device), sampled where the logits are:
    the batch's greedy, temperature, top-k and top-p as a few tensor operations, and one
    transfer of the sampled ids to the host. A seeded row draws from its own generator (on the
    logits' device), so its tokens do not depend on what it is batched with.

    Safe for every value ``SamplingParams`` accepts: a temperature under ``GREEDY_BELOW`` is
    greedy, and top-p always keeps the most likely token (a top_p too small for float32, such
    as 1e-46, keeps just that one, its limit)."""
    out = logits.argmax(-1)
    random = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if not random:
        return out.tolist()
    device = logits.device
    rows = torch.tensor(random, device=device)
    chosen = [params[i] for i in random]
    x = logits[rows].float() / torch.tensor([p.temperature for p in chosen], device=device)[:, None]
    vocab = x.shape[1]
    ks = [min(p.top_k, vocab) for p in chosen]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values  # (R, kmax), descending
        k = torch.tensor([k or 1 for k in ks], device=device)
        cut = kth.gather(1, (k - 1)[:, None])
        cut = torch.where(torch.tensor(ks, device=device)[:, None] > 0, cut, float("-inf"))
        x = x.masked_fill(x < cut, float("-inf"))
    probs = torch.softmax(x, -1)
    top_p = [p.top_p for p in chosen]
    if any(v < 1.0 for v in top_p):
        sorted_p, idx = probs.sort(-1, descending=True)
        limit = torch.tensor(top_p, device=device)[:, None]
        keep = (sorted_p.cumsum(-1) - sorted_p < limit) | (limit >= 1.0)  # smallest prefix reaching top_p
        keep[:, 0] = True  # the most likely token, whatever top_p rounds to in float32
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p * keep)
    drawn = torch.empty(len(random), dtype=torch.long, device=device)
    unseeded = [j for j, i in enumerate(random) if generators[i] is None]
    if unseeded:
        sel = torch.tensor(unseeded, device=device)
        drawn[sel] = torch.multinomial(probs[sel], 1).squeeze(1)
    for j, i in enumerate(random):
        if generators[i] is not None:
            drawn[j] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    out[rows] = drawn
    return out.tolist()
