"""The batched sampler against a row-by-row reference, and the limits top-k / top-p set."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from orthrus_real.engine.sampling import SamplingParams, sample  # noqa: E402


def reference_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One row at a time, as the definition reads."""
    if p.temperature == 0:
        return int(row.argmax())
    row = row / p.temperature
    if p.top_k:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, -1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p * keep)
    return int(torch.multinomial(probs, 1, generator=gen))


row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, 50]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    seed=st.integers(0, 2**31),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(row_params, min_size=1, max_size=12), vocab=st.integers(2, 300),
       data_seed=st.integers(0, 2**16))
def test_batched_sampling_equals_row_by_row_for_greedy_and_seeded_rows(rows, vocab, data_seed):
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(data_seed)) * 3
    gens = [torch.Generator().manual_seed(p.seed) for p in rows]
    ref_gens = [torch.Generator().manual_seed(p.seed) for p in rows]
    got = sample(logits, rows, gens)
    want = [reference_row(logits[i], p, g) for i, (p, g) in enumerate(zip(rows, ref_gens))]
    assert got == want


def test_unseeded_rows_stay_within_top_k_and_top_p():
    torch.manual_seed(0)
    vocab = 40
    logits = torch.linspace(0, 8, vocab).repeat(4, 1)  # token 39 likeliest, then 38, ...
    params = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0), SamplingParams(temperature=2.0)]
    probs = torch.softmax(logits[0], -1).sort(descending=True).values
    nucleus = int((probs.cumsum(0) - probs < 0.5).sum())
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(300):
        for i, tok in enumerate(sample(logits, params, [None] * len(params))):
            seen[i].add(tok)
    assert seen[0] == {37, 38, 39}
    assert seen[1] == set(range(vocab - nucleus, vocab))
    assert seen[2] == {39}
    assert len(seen[3]) > 10  # plain temperature sampling reaches far into the vocabulary


def test_a_seeded_row_does_not_depend_on_its_batch():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    alone = sample(logits[2:3], [p], [torch.Generator().manual_seed(7)])
    others = [SamplingParams(temperature=1.0)] * 6
    others[2] = p
    gens = [None] * 6
    gens[2] = torch.Generator().manual_seed(7)
    assert sample(logits, others, gens)[2] == alone[0]


@pytest.mark.parametrize("params", [
    SamplingParams(top_p=1e-46),  # 0 in float32
    SamplingParams(top_p=1e-40),  # a float32 denormal
    SamplingParams(temperature=1e-40),
    SamplingParams(temperature=1e-6, top_k=5),
    SamplingParams(temperature=2.0, top_p=1e-46, seed=3),
])
def test_every_value_validation_accepts_samples_safely(params):
    """Vanishing temperatures are greedy (below GREEDY_BELOW) and a top_p too small for float32
    keeps the likeliest token: the issue's values made torch.multinomial raise."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 4
    gens = [torch.Generator().manual_seed(3) if params.seed is not None else None] * 3
    got = sample(logits, [params] * 3, gens)
    assert got == logits.argmax(-1).tolist()
