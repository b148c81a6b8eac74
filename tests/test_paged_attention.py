"""In-place paged attention against the gathering path, and the static step against the
dynamic one (orthrus_real/engine/paged_attention.py, orthrus_real/engine/static_decode.py). All on the CPU:
the static path runs there without capture; the compiled kernel and the capture are GPU-only."""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from orthrus_real.engine import paged_attention as pa  # noqa: E402
from orthrus_real.engine.attention import build_metadata, paged_attention  # noqa: E402
from orthrus_real.engine.sampling import SamplingParams  # noqa: E402
from orthrus_real.engine.static_decode import default_buckets  # noqa: E402
from orthrus_real.engine.torch_engine import Engine  # noqa: E402
from orthrus_sim.engine import Request, RequestKind, SchedulerConfig  # noqa: E402
from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind  # noqa: E402

from .test_real_engine import MIXED_POLICIES, prompt_ids  # noqa: E402

CPU = torch.device("cpu")
DEVICE = os.environ.get("ORTHRUS_TEST_DEVICE") or "cpu"


def random_step(draw, block_size: int):
    """A batch of fresh chunks, chunks with context and decodes (kinds sorted as the core
    sorts them), tables drawn from a shuffled pool bigger than what they use (so some blocks
    belong to no one, and tables are in no order)."""
    specs = draw(st.lists(st.tuples(st.sampled_from(["fresh", "context", "decode"]),
                                    st.integers(0, 40), st.integers(1, 20)),
                          min_size=1, max_size=7))
    order = {"fresh": 0, "context": 0, "decode": 1}
    specs.sort(key=lambda s: order[s[0]])
    need = sum(-(-(ctx + n) // block_size) + 1 for _, ctx, n in specs)
    pool = list(range(need + draw(st.integers(0, 6))))
    random.Random(draw(st.integers(0, 10**6))).shuffle(pool)
    items, tables = [], {}
    for i, (kind, ctx, n) in enumerate(specs):
        start, n = {"fresh": (0, n), "context": (ctx + 1, n), "decode": (ctx + 1, 1)}[kind]
        item_kind = ItemKind.DECODE if kind == "decode" else ItemKind.PREFILL_CHUNK
        req = Request(f"r{i}", RequestKind.GENERATION, 0.0, start + n, max_output_tokens=4)
        # a table may hold more blocks than the item reaches (a decode's next block, say)
        blocks = -(-(start + n) // block_size) + draw(st.integers(0, 1))
        tables[req.request_id] = [pool.pop() for _ in range(blocks)]
        items.append(BatchItem(req, item_kind, start, n))
    batch = BatchUnit(4096, items=items, total_tokens=sum(it.num_tokens for it in items))
    return batch, tables, len(pool) + sum(map(len, tables.values()))


@st.composite
def steps(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    heads, kv_heads = draw(st.sampled_from([(4, 4), (4, 2), (6, 1)]))
    return (block_size, heads, kv_heads, *random_step(draw, block_size),
            draw(st.integers(0, 24)))


@settings(max_examples=40, deadline=None)
@given(steps())
def test_inplace_attention_equals_the_gathering_path(case):
    block_size, heads, kv_heads, batch, tables, num_blocks, padding = case
    gen = torch.Generator().manual_seed(num_blocks)
    dim, t = 8, batch.total_tokens
    cache = torch.randn((num_blocks + 1) * block_size, 2, kv_heads, dim, generator=gen)
    q = torch.randn(t, heads, dim, generator=gen)
    k = torch.randn(t, kv_heads, dim, generator=gen)
    v = torch.randn(t, kv_heads, dim, generator=gen)
    ref_cache = cache.clone()
    ref = paged_attention(q, k, v, ref_cache, build_metadata(batch, tables, block_size, CPU), 0.3)
    # the step's own size
    meta = pa.build(batch, tables, block_size, num_blocks + 1, CPU)
    got_cache = cache.clone()
    got = pa.inplace_attention(q, k, v, got_cache, meta, 0.3)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache, ref_cache, atol=0, rtol=0)
    # eager FlexAttention (the mask function the CUDA kernel runs) over the written cache
    flex = pa.flex_paged(q, got_cache, meta, 0.3, compiled=False)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)
    # padded to a static size: the real rows unchanged, padding rows 0, only scratch written
    rows = t + padding
    static = pa.empty_metadata(rows, num_blocks + 1, block_size, CPU)
    pa.build(batch, tables, block_size, num_blocks + 1, CPU, static)
    pad = (torch.randn(padding, heads, dim, generator=gen),
           torch.randn(padding, kv_heads, dim, generator=gen),
           torch.randn(padding, kv_heads, dim, generator=gen))
    pad_cache = cache.clone()
    out = pa.inplace_attention(torch.cat((q, pad[0])), torch.cat((k, pad[1])),
                               torch.cat((v, pad[2])), pad_cache, static, 0.3)
    torch.testing.assert_close(out[:t], ref, atol=1e-5, rtol=1e-5)
    assert out[t:].abs().max().item() == 0 if padding else True
    real = num_blocks * block_size
    torch.testing.assert_close(pad_cache[:real], ref_cache[:real], atol=0, rtol=0)


@settings(max_examples=30, deadline=None)
@given(steps())
def test_block_mask_lists_exactly_the_blocks_with_visible_slots(case):
    # what the compiled kernel relies on: every (query block, cache block) pair that holds a
    # visible slot is listed once, and nothing else is
    block_size, _, _, batch, tables, num_blocks, _ = case
    meta = pa.build(batch, tables, block_size, num_blocks + 1, CPU)
    t, slots = batch.total_tokens, (num_blocks + 1) * block_size
    visible = meta.mask_mod()
    qi = torch.arange(t)[:, None].expand(t, slots)
    ki = torch.arange(slots)[None, :].expand(t, slots)
    dense = torch.vmap(torch.vmap(lambda a, b: visible(0, 0, a, b)))(qi, ki)
    for i, n in enumerate(meta.kv_num_blocks.view(-1).tolist()):
        listed = meta.kv_indices[0, 0, i, :n].tolist()
        assert len(set(listed)) == n
        rows = dense[i * pa.Q_BLOCK:(i + 1) * pa.Q_BLOCK].view(-1, num_blocks + 1, block_size)
        needed = rows.any(0).any(-1).nonzero().view(-1).tolist()
        assert sorted(listed) == needed


# ----- the static step in the engine ---------------------------------------------------------
VARIANTS = (("gather", False), ("paged", False), ("paged", True))  # dynamic x2, then static


def engine(path, attention, static, **kw):
    kw.setdefault("device", DEVICE)
    kw.setdefault("dtype", "float32")
    kw.setdefault("static_buckets", (4, 8, 16))
    return Engine(path, attention=attention, static_step=static, **kw)


def generate(eng, specs):
    for rid, ids, n in specs:
        eng.add_generation(rid, token_ids=ids, params=SamplingParams(max_tokens=n, temperature=0,
                                                                     ignore_eos=True))


def drive(eng, first, later, embeds=(), abort_at=None, later_at=12):
    """Run ``first`` streams and ``embeds``; after ``later_at`` steps add ``later``; abort
    ``abort_at`` (rid, step) if given. Returns ({rid: tokens}, {rid: embedding}, rows per
    step)."""
    generate(eng, first)
    for rid, ids in embeds:
        eng.add_embedding(rid, token_ids=ids)
    tokens, vectors, rows = {}, {}, []
    step = 0
    while eng.has_work:
        if step == later_at:
            generate(eng, later)
        if abort_at and step == abort_at[1]:
            eng.abort(abort_at[0])
        before = eng.iterations
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
                if out.embedding is not None:
                    vectors[out.request_id] = out.embedding
        if eng.iterations > before:
            rows.append(eng.stats[-1].total_tokens)
        step += 1
    assert eng.policy.blocks.num_used == 0
    return tokens, vectors, rows


def streams(n, seed=40):
    return [(f"g{i}", prompt_ids(5 + 3 * i, seed=seed + i), 16 + i % 4) for i in range(n)]


def assert_same(runs, what):
    (tok0, vec0, _), *rest = runs
    for tok, vec, _ in rest:
        assert tok == tok0, what
        for rid in vec0:
            torch.testing.assert_close(torch.tensor(vec[rid]), torch.tensor(vec0[rid]),
                                       atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("policy", MIXED_POLICIES)
def test_static_step_is_token_identical_under_every_mixed_policy(tiny_models, policy):
    path = tiny_models["llama"]
    # 7 then 9 streams: steps of 7 and 8 rows (bucket 8), 9-16 (bucket 16, just over 8); mixed
    # steps over the largest bucket (16) run dynamically, and so do adapter rows
    specs = streams(9)
    embeds = [(f"e{i}", prompt_ids(9 + 11 * i, seed=60 + i)) for i in range(3)]
    runs = []
    for attention, static in VARIANTS:
        eng = engine(path, attention, static, adapter_dir=path / "adapter", policy=policy,
                     scheduler=SchedulerConfig(token_budget=24, chunk_size=8, block_size=4),
                     kv_cache_tokens=512)
        runs.append(drive(eng, specs[:7], specs[7:], embeds))
        if static:
            sizes = runs[-1][2]
            assert {7, 8} <= set(sizes) and any(8 < n <= 16 for n in sizes), sizes
            assert any(n > 16 for n in sizes), sizes
            assert eng.static.fallbacks and sum(eng.static.fallbacks.values()) < len(runs[-1][2])
    assert len(runs[0][0]) == 12
    assert_same(runs, policy)


def test_static_step_embeddings_preemption_and_abort(tiny_models):
    path = tiny_models["mistral"]
    # no adapter: embedding chunks run static too; a cache of 20 blocks of 4 forces preemption
    specs = streams(6, seed=80)
    embeds = [(f"e{i}", prompt_ids(6 + 13 * i, seed=90 + i)) for i in range(3)]
    runs, engines = [], []
    for attention, static in VARIANTS:
        eng = engine(path, attention, static, policy="ibs", kv_cache_tokens=80,
                     scheduler=SchedulerConfig(token_budget=16, chunk_size=8, block_size=4))
        runs.append(drive(eng, specs[:5], specs[5:], embeds, abort_at=("g1", 6)))
        engines.append(eng)
    assert engines[2].policy.preemptions["generation"] > 0
    assert not engines[2].static.fallbacks  # every step fitted a bucket
    assert "g1" not in runs[0][0] and len(runs[0][1]) == 3
    assert_same(runs, "preemption")


def test_engine_options_name_the_problem(tiny_models):
    path = tiny_models["llama"]
    with pytest.raises(ValueError, match="--attention must be one of gather, paged"):
        Engine(path, device="cpu", attention="flash")
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        Engine(path, device="cpu", attention="paged", cuda_graphs=True)
    with pytest.raises(ValueError, match="needs --attention paged"):
        Engine(path, device="cpu", static_step=True)
    with pytest.raises(ValueError, match="static buckets"):
        Engine(path, device="cpu", attention="paged", static_step=True, static_buckets=(0,))
    eng = Engine(path, device="cpu", attention="paged", static_step=True)
    assert eng.describe()["static_step"].startswith("eager (no capture), buckets 8, 16")
    assert default_buckets(48) == (8, 16, 32, 48) and default_buckets(4096)[-1] == 256


def test_cpu_fp32_shortcuts_equal_the_plain_ops():
    # the gathering path's fp32 CPU decode (fused attention over the strided gathered
    # contexts, padding masked) and the column-split projection for few rows give what the
    # plain operations give
    from orthrus_real.engine.attention import _decodes, _decodes_fp32_cpu
    from orthrus_real.engine.cpu_gemm import NARROW_ROWS, SPLIT_COLS, mkl_linear, onednn_linear

    gen = torch.Generator().manual_seed(3)
    for kvh, g in ((4, 3), (2, 1), (1, 6)):
        qd = torch.randn(5, kvh, g, 16, generator=gen)
        kv = torch.randn(5, 37, 2, kvh, 16, generator=gen)
        bias = torch.zeros(5, 1, 1, 37)
        bias[1, ..., 30:] = float("-inf")
        keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # strided
        torch.testing.assert_close(_decodes_fp32_cpu(qd, keys, values, bias, 0.25),
                                   _decodes(qd, keys, values, bias, 0.25), atol=1e-5, rtol=1e-5)
    w = torch.randn(2 * SPLIT_COLS + 100, 24, generator=gen)
    b = torch.randn(w.shape[0], generator=gen)
    for rows in (1, NARROW_ROWS, NARROW_ROWS + 1):
        x = torch.randn(rows, 24, generator=gen)
        for linear in (mkl_linear, onednn_linear):
            torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b),
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w),
                                       atol=1e-5, rtol=1e-5)
    strided = torch.randn(7, 48, generator=gen)[:, ::2]  # a view, as a fused output's slice is
    torch.testing.assert_close(onednn_linear(strided, w), torch.nn.functional.linear(strided, w),
                               atol=1e-5, rtol=1e-5)
    assert onednn_linear(torch.zeros(0, 24), w).shape == (0, w.shape[0])


def test_the_cpu_engine_keeps_large_buffers_in_the_heap(tiny_models, monkeypatch):
    # glibc maps every allocation above 32 MB afresh (page faults at every step); the CPU
    # engine raises the thresholds once per process, and ORTHRUS_CPU_HEAP=0 leaves them
    import sys as _sys

    from orthrus_real.engine import device as dev

    eng = Engine(tiny_models["llama"], device="cpu")
    if _sys.platform.startswith("linux"):
        assert eng.describe()["cpu_heap"].startswith("large buffers kept in the heap")
    monkeypatch.setattr(dev, "_heap_tuned", None)
    monkeypatch.setenv("ORTHRUS_CPU_HEAP", "0")
    assert dev.keep_large_cpu_buffers() == "glibc defaults (ORTHRUS_CPU_HEAP=0)"
    assert dev.keep_large_cpu_buffers() == "glibc defaults (ORTHRUS_CPU_HEAP=0)"  # once


# ----- decode contexts kept between steps (the gathering path on a CPU) -----------------------
def test_kept_contexts_append_only_for_the_same_decodes_one_token_further():
    from orthrus_real.engine.attention import KeptContexts

    kept = KeptContexts(2, limit_tokens=64)
    assert kept.plan(("a", "b"), [5, 9], 4) == (False, 20)  # longest 9 -> 3 blocks + 2
    kept.commit()
    assert kept.plan(("a", "b"), [6, 10], 4) == (True, 20)
    kept.commit()
    assert kept.plan(("b", "a"), [11, 7], 4) == (False, 20)  # another order: gathered again
    assert kept.plan(("a", "b"), [7, 12], 4)[0] is False  # b two tokens further
    assert kept.plan(("a", "b", "c"), [7, 11, 3], 4)[0] is False  # a new decode
    assert kept.plan(("a", "b"), [7, 21], 4) == (False, 32)  # past the width: wider
    assert kept.plan(("a", "b", "c", "d"), [7, 30, 1, 1], 4) == (False, 0)  # 4 x 40 > 64
    kept.commit()  # nothing kept: the buffers are dropped, the next step gathers
    assert kept.width == 0 and kept.buffers == [None, None]
    assert kept.plan(("a", "b", "c", "d"), [8, 31, 2, 2], 4)[0] is False
    kept.plan(("a", "b"), [8, 12], 4)
    kept.reset()  # a pass that raised: nothing it planned is current
    assert (kept.ids, kept.width, kept.appended, kept.gathered) == ((), 0, 1, 1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_kept_contexts_attend_as_a_fresh_gather_step_after_step(block_size):
    """Decodes one token further each step, one leaving at step 3, a chunk beside them at step
    4: the kept contexts' output equals a fresh gather's, and only the expected steps append."""
    from orthrus_real.engine.attention import KeptContexts

    gen = torch.Generator().manual_seed(block_size)
    heads, kv_heads, dim, steps = 4, 2, 8, 6
    contexts = [3, 17, 9, 30]
    pool = list(range(200))
    random.Random(block_size).shuffle(pool)
    tables = {f"d{i}": [pool.pop() for _ in range(-(-(c + steps + 1) // block_size))]
              for i, c in enumerate(contexts)}
    tables["c"] = [pool.pop() for _ in range(-(-40 // block_size))]
    cache = torch.randn(200 * block_size, 2, kv_heads, dim, generator=gen)
    ref_cache, kept = cache.clone(), KeptContexts(1, limit_tokens=10**6)
    appends = []
    for step in range(steps):
        live = [i for i in range(4) if not (step >= 3 and i == 1)]
        items = []
        if step == 4:  # a prompt chunk with context beside the decodes
            req = Request("c", RequestKind.GENERATION, 0.0, 30, max_output_tokens=4)
            items.append(BatchItem(req, ItemKind.PREFILL_CHUNK, 10, 12))
        for i in live:
            req = Request(f"d{i}", RequestKind.GENERATION, 0.0, contexts[i], max_output_tokens=99)
            items.append(BatchItem(req, ItemKind.DECODE, contexts[i] + step, 1))
        batch = BatchUnit(4096, items=items, total_tokens=sum(it.num_tokens for it in items))
        t = batch.total_tokens
        q = torch.randn(t, heads, dim, generator=gen)
        k = torch.randn(t, kv_heads, dim, generator=gen)
        v = torch.randn(t, kv_heads, dim, generator=gen)
        ref = paged_attention(q, k, v, ref_cache, build_metadata(batch, tables, block_size, CPU), 0.3)
        meta = build_metadata(batch, tables, block_size, CPU, kept=kept)
        got = paged_attention(q, k, v, cache, meta, 0.3, layer=0)
        kept.commit()
        appends.append(meta.decode_append)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    # gathered at 0, appended at 1-2, gathered at 3 (one left), appended at 4-5 (a chunk
    # beside the same decodes does not matter)
    assert appends == [False, True, True, False, True, True]


@pytest.mark.parametrize("policy", MIXED_POLICIES)
def test_kept_decode_contexts_are_token_identical_under_every_mixed_policy(tiny_models, policy):
    path = tiny_models["llama"]
    specs = streams(9)
    embeds = [(f"e{i}", prompt_ids(9 + 11 * i, seed=60 + i)) for i in range(3)]
    runs, engines = [], []
    for keep in (False, True):
        eng = engine(path, "gather", False, adapter_dir=path / "adapter", policy=policy,
                     keep_decode_contexts=keep, kv_cache_tokens=512,
                     scheduler=SchedulerConfig(token_budget=24, chunk_size=8, block_size=4))
        runs.append(drive(eng, specs[:7], specs[7:], embeds))
        engines.append(eng)
    assert engines[0].kept is None and engines[0].describe()["decode_contexts"] == "gathered every step"
    kept = engines[1].kept
    assert kept.appended > 10 and kept.gathered >= 2, (kept.appended, kept.gathered)
    assert engines[1].describe()["decode_contexts"] == "kept between steps"
    assert kept.buffers == [None] * len(kept.buffers) and kept.width == 0  # idle: released
    assert_same(runs, policy)


def fails_once(num_layers: int, at_pass: int = 10):
    """``paged_attention`` raising once, in the last layer of the ``at_pass``-th pass that has
    appended to kept contexts in every layer before it."""
    seen = [0]

    def attend(q, k, v, cache, meta, scale, layer=0):
        if meta.decode_append and layer == num_layers - 1:
            seen[0] += 1
            if seen[0] == at_pass:
                raise RuntimeError("a pass that fails once, after appending in its other layers")
        return paged_attention(q, k, v, cache, meta, scale, layer)

    attend.seen = seen
    return attend


def test_kept_decode_contexts_through_preemption_abort_and_a_failed_pass(tiny_models, monkeypatch):
    """The failed pass is retried in halves by the engine's isolation; the kept contexts it
    half-appended are dropped, so every token is still the plain gather's."""
    from orthrus_real.engine import model as model_module

    path = tiny_models["mistral"]
    specs = streams(6, seed=80)
    embeds = [(f"e{i}", prompt_ids(6 + 13 * i, seed=90 + i)) for i in range(3)]
    runs, engines = [], []
    for keep in (False, True):
        eng = engine(path, "gather", False, policy="ibs", kv_cache_tokens=80,
                     keep_decode_contexts=keep,
                     scheduler=SchedulerConfig(token_budget=16, chunk_size=8, block_size=4))
        if keep:
            eng.kept.limit_tokens = 10**6  # kept although wider than this tiny cache
            failing = fails_once(eng.cfg.num_layers)
            monkeypatch.setattr(model_module, "paged_attention", failing)
        runs.append(drive(eng, specs[:5], specs[5:], embeds, abort_at=("g1", 6)))
        engines.append(eng)
    assert engines[1].policy.preemptions["generation"] > 0 and engines[1].kept.appended > 10
    assert failing.seen[0] > 10  # it did fail once, and appended again after
    assert "g1" not in runs[0][0] and len(runs[0][1]) == 3
    assert_same(runs, "preemption")
    with pytest.raises(ValueError, match="needs --attention gather"):
        Engine(path, device="cpu", attention="paged", keep_decode_contexts=True)
