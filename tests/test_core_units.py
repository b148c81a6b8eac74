"""Worked examples and bad-input checks for the scheduling core."""

from __future__ import annotations

import numpy as np
import pytest

from orthrus_sim.engine import (
    BlockManager,
    IncrementalPooler,
    ItemKind,
    Request,
    RequestKind,
    RequestState,
    SchedulerConfig,
    make_policy,
    resolve_policy,
)
from tests.helpers import drive, make_requests


def test_ibs_worked_example_interleaves_by_remaining_work():
    # Qe holds 3 x 128 = 384 tokens, Qg holds 1 x 128: IBS gives embeddings 3 turns per 1.
    policy = make_policy("ibs", SchedulerConfig(token_budget=512, chunk_size=128))
    reqs = make_requests([("embedding", 0, 128, 0)] * 3 + [("generation", 0, 128, 4)])
    for r in reqs:
        policy.add(r)
    batch = policy.schedule(0.0)
    assert [it.kind for it in batch.items] == [ItemKind.EMBED_CHUNK] * 3 + [ItemKind.PREFILL_CHUNK]
    assert batch.total_tokens == 512
    assert batch.token_slice(ItemKind.EMBED_CHUNK) == slice(0, 384)
    assert batch.token_slice(ItemKind.PREFILL_CHUNK) == slice(384, 512)
    assert batch.item_slice(ItemKind.DECODE) == slice(4, 4)


def test_chunk_that_does_not_fit_is_not_split():
    policy = make_policy("ibs", SchedulerConfig(token_budget=100, chunk_size=64))
    for r in make_requests([("embedding", 0, 64, 0), ("embedding", 0, 64, 0)]):
        policy.add(r)
    batch = policy.schedule(0.0)
    assert batch.total_tokens == 64  # 36 tokens stay unused rather than splitting the 2nd chunk


def test_head_of_line_unified_hetero_blocks_embeddings_orthrus_does_not():
    spec = [("generation", 0, 256, 8)] * 40 + [("embedding", 0, 128, 0)] * 40
    first_embed = {}
    for name in ("unified-hetero", "ibs"):
        policy = make_policy(name, SchedulerConfig(token_budget=1024, chunk_size=256))
        batches = drive(policy, make_requests(spec))
        first_embed[name] = next(i for i, b in enumerate(batches)
                                 if b.tokens_of(ItemKind.EMBED_CHUNK))
    assert first_embed["ibs"] == 0
    assert first_embed["unified-hetero"] >= 9  # waits behind all 40 prompts (10 batches)


def test_unified_homo_never_mixes():
    policy = make_policy("unified-homo", SchedulerConfig(token_budget=512, chunk_size=128))
    spec = [("generation", 0, 100, 5), ("embedding", 0, 300, 0), ("generation", 1, 50, 3),
            ("embedding", 2, 40, 0)]
    batches = drive(policy, make_requests(spec))
    for b in batches:
        kinds = {it.kind is ItemKind.EMBED_CHUNK for it in b.items}
        assert len(kinds) == 1
    assert any(it.kind is ItemKind.EMBED_CHUNK for b in batches for it in b.items)


@pytest.mark.parametrize("embedding_kv, blocks", [("read", 4), ("all", 5)])
def test_embedding_holds_blocks_until_last_chunk(embedding_kv, blocks):
    """80 tokens in chunks of 32, 32, 16: the blocks of the first two chunks (64 tokens, 4
    blocks) are taken at the first chunk and held to the end, the last chunk's own keys and
    values are not stored; with ``embedding_kv: all`` the whole input is (5 blocks)."""
    policy = make_policy("ibs", SchedulerConfig(token_budget=64, chunk_size=32, block_size=16,
                                                embedding_kv=embedding_kv))
    (req,) = make_requests([("embedding", 0, 80, 0)])
    policy.add(req)
    held, writes = [], []
    while policy.has_work:
        batch = policy.schedule()
        held.append(policy.blocks.held(req.request_id))
        writes.append(policy.writes_kv(batch.items[0]))
        policy.complete(batch, 1.0)
    assert held == [blocks] * 3
    assert writes == [True, True, embedding_kv == "all"]
    assert policy.blocks.num_used == 0 and req.chunks_done == 3


def test_one_chunk_embedding_needs_no_blocks():
    """A one-chunk (or atomic) embedding is admitted with every block taken, holds none and
    writes none; with ``embedding_kv: all`` it waits for blocks as before."""
    for chunk in (32, None):
        cfg = SchedulerConfig(token_budget=64, chunk_size=chunk, block_size=16, num_blocks=3)
        policy = make_policy("ibs", cfg)
        gen, emb = make_requests([("generation", 0, 40, 8), ("embedding", 0, 30, 0)])
        policy.add(gen)
        policy.complete(policy.schedule(), 1.0)  # the prompt takes every block
        assert policy.blocks.num_free == 0
        policy.add(emb, 1.0)
        batch = policy.schedule(1.0)
        (item,) = [it for it in batch.items if it.request is emb]
        assert not policy.writes_kv(item) and policy.blocks.held(emb.request_id) == 0
        policy.complete(batch, 2.0)
        assert emb.state is RequestState.FINISHED
    policy = make_policy("ibs", SchedulerConfig(token_budget=64, chunk_size=32, block_size=16,
                                                num_blocks=3, embedding_kv="all"))
    gen, emb = make_requests([("generation", 0, 40, 8), ("embedding", 0, 30, 0)])
    policy.add(gen)
    policy.complete(policy.schedule(), 1.0)
    policy.add(emb, 1.0)
    batch = policy.schedule(1.0)
    assert all(it.request is not emb for it in batch.items)


def test_max_num_embeds_caps_embeddings_holding_blocks():
    # budget for all three, but only two embedding slots: the third waits for a slot
    policy = make_policy("ibs", SchedulerConfig(token_budget=512, chunk_size=64,
                                                    max_num_embeds=2))
    for r in make_requests([("embedding", 0, 128, 0)] * 3):
        policy.add(r)
    batch = policy.schedule(0.0)
    assert [it.request.request_id for it in batch.items] == ["r0", "r1"]
    policy.complete(batch, 0.1)
    batch = policy.schedule(0.1)  # r0, r1 finish their second chunks; r2 still has no slot
    assert [it.request.request_id for it in batch.items] == ["r0", "r1"]
    policy.complete(batch, 0.2)
    assert [it.request.request_id for it in policy.schedule(0.2).items] == ["r2"]


@pytest.mark.parametrize("policy_name", ["ibs", "generation", "unified-hetero"])
def test_a_running_cap_keeps_generations_waiting_until_it_rises(policy_name):
    """A router's cap on a decoding replica (``cap_running``): no more than the cap run, the
    rest wait in arrival order, a lifted cap admits them; embeddings are not counted."""
    policy = make_policy(policy_name, SchedulerConfig(token_budget=512, chunk_size=64))
    policy.cap_running(2)
    for r in make_requests([("generation", 0, 16, 4)] * 4):
        policy.add(r)
    batch = policy.schedule(0.0)
    assert [it.request.request_id for it in batch.items] == ["r0", "r1"]
    assert policy.snapshot().generations_running == 2
    policy.complete(batch, 0.1)
    policy.cap_running(None)
    batch = policy.schedule(0.1)
    assert {"r2", "r3"} <= {it.request.request_id for it in batch.items}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="running cap"):
            policy.cap_running(bad)


def test_decode_growth_preempts_newest_and_recomputes():
    # 6 blocks of 4 tokens: two 8-token prompts fill 4 blocks; decodes grow until one must go.
    policy = make_policy("generation", SchedulerConfig(token_budget=64, chunk_size=None,
                                                       block_size=4, num_blocks=6))
    reqs = make_requests([("generation", 0, 8, 10), ("generation", 0, 8, 10)])
    drive(policy, reqs)
    assert policy.preemptions["generation"] >= 1
    assert reqs[1].num_preemptions >= 1 and reqs[0].num_preemptions == 0  # newest goes
    assert all(r.state is RequestState.FINISHED and r.num_generated == 10 for r in reqs)
    assert policy.blocks.num_used == 0


def test_abort_frees_blocks_everywhere():
    policy = make_policy("ibs", SchedulerConfig(token_budget=64, chunk_size=32))
    reqs = make_requests([("embedding", 0, 100, 0), ("generation", 0, 40, 50),
                          ("generation", 0, 40, 50)])
    for r in reqs:
        policy.add(r)
    policy.complete(policy.schedule(), 1.0)
    assert policy.blocks.num_used > 0
    for r in reqs:
        assert policy.abort(r.request_id) is r
        assert r.state is RequestState.ABORTED
    assert policy.blocks.num_used == 0 and not policy.has_work
    assert policy.abort("nope") is None


def test_prefill_only_hands_off_after_first_token_and_decode_only_finishes():
    prefill = make_policy("prefill-only", SchedulerConfig(token_budget=256, chunk_size=128))
    decode = make_policy("decode-only", SchedulerConfig(token_budget=256, chunk_size=None))
    (req,) = make_requests([("generation", 0, 200, 5)])
    prefill.add(req)
    left = []
    while not left:
        left = prefill.complete(prefill.schedule(), 1.0)
    assert left == [req] and req.state is RequestState.WAITING
    assert req.num_computed == 200 and req.num_generated == 1 and prefill.blocks.num_used == 0
    decode.add(req, 2.0)
    batches = drive(decode, [])
    assert all(it.kind is ItemKind.DECODE for b in batches for it in b.items)
    assert req.state is RequestState.FINISHED and req.num_generated == 5


def test_rejections_carry_a_reason():
    policy = make_policy("generation", SchedulerConfig(num_blocks=4, block_size=16,
                                                       max_model_len=100))
    (emb, long, huge) = make_requests([("embedding", 0, 10, 0), ("generation", 0, 90, 20),
                                       ("generation", 0, 50, 40)])
    assert not policy.add(emb) and "does not serve embedding" in emb.reject_reason
    assert not policy.add(long) and "maximum length" in long.reject_reason
    assert not policy.add(huge) and "KV blocks" in huge.reject_reason
    atomic = make_policy("embedding-only", SchedulerConfig(token_budget=64, chunk_size=None))
    (big,) = make_requests([("embedding", 0, 65, 0)])
    assert not atomic.add(big) and "token budget" in big.reject_reason


@pytest.mark.parametrize("kwargs, field", [
    (dict(input_len=0), "input_len"),
    (dict(input_len=-3), "input_len"),
    (dict(kind="generation", max_output_tokens=0), "max_output_tokens"),
    (dict(pooling="median"), "pooling head"),
    (dict(kind="audio"), "kind"),
    (dict(kind=None), "kind"),
    (dict(arrival_time=float("nan")), "arrival_time"),
    (dict(arrival_time=float("inf")), "arrival_time"),
    (dict(arrival_time="1.0"), "arrival_time"),
    (dict(arrival_time=None), "arrival_time"),
    (dict(arrival_time=-1.0), "arrival_time"),
    (dict(arrival_time=True), "arrival_time"),
    (dict(input_len=True), "input_len"),
    (dict(input_len=4.0), "input_len"),
    (dict(kind="generation", max_output_tokens=True), "max_output_tokens"),
    (dict(kind="generation", max_output_tokens=4, expected_output_tokens="many"),
     "expected_output_tokens"),
    (dict(kind="generation", max_output_tokens=4, expected_output_tokens=-1),
     "expected_output_tokens"),
    (dict(max_output_tokens=3), "max_output_tokens"),
    (dict(request_id=7), "request_id"),
    (dict(request_id=""), "request_id"),
])
def test_bad_request_names_the_field(kwargs, field):
    base = dict(request_id="x", kind="embedding", arrival_time=0.0, input_len=4)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        Request(**base)


@pytest.mark.parametrize("kwargs, field", [
    (dict(token_budget=0), "token_budget"),
    (dict(token_budget=64, chunk_size=128), "chunk_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(waiting_work="all"), "waiting_work"),
    (dict(max_num_embeds=0), "max_num_embeds"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_bad_policy_paths():
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        resolve_policy("fifo")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        resolve_policy("no_such_mod:Policy")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        resolve_policy("orthrus_sim.engine:Nope")
    with pytest.raises(ValueError, match="not a subclass"):
        resolve_policy("orthrus_sim.engine:Request")


def test_user_policy_by_import_path():
    cls = resolve_policy("tests.example_policy:ShortestEmbeddingFirst")
    policy = cls(SchedulerConfig(token_budget=128, chunk_size=128))
    reqs = make_requests([("embedding", 0, 100, 0), ("embedding", 0, 10, 0)])
    for r in reqs:
        policy.add(r)
    batch = policy.schedule()
    assert batch.items[0].request is reqs[1]


def test_pooler_on_bf16_like_input_accumulates_in_fp32():
    h = np.ones((1000, 4), dtype=np.float16) * np.float16(0.1)
    p = IncrementalPooler("mean")
    for lo in range(0, 1000, 7):
        p.update(h[lo:lo + 7])
    assert p.result().dtype == np.float32
    np.testing.assert_allclose(p.result(), 0.0999755859375, rtol=1e-6)


def test_pooler_bad_inputs():
    with pytest.raises(ValueError, match="unknown head"):
        IncrementalPooler("max")
    with pytest.raises(ValueError, match="needs a function"):
        IncrementalPooler("buffer")
    with pytest.raises(ValueError, match="no hidden states"):
        IncrementalPooler("mean").result()


def test_block_manager_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, -1)


def test_request_kind_enum_roundtrip():
    r = Request("a", "generation", 0.0, 3, max_output_tokens=2)
    assert r.kind is RequestKind.GENERATION and r.remaining_work(True) == 4


def test_request_kind_and_final_states_are_plain_fields():
    """The hot path reads ``is_embedding`` and ``state.is_final`` as fields (no properties):
    they must still say what the kind and the state are, however the kind was given."""
    for kind, embedding in [("embedding", True), ("generation", False),
                            (RequestKind.EMBEDDING, True), (RequestKind.GENERATION, False)]:
        r = Request("a", kind, 0.0, 3, max_output_tokens=0 if embedding else 2)
        assert r.is_embedding is embedding and (r.kind is RequestKind.EMBEDDING) is embedding
    final = {s for s in RequestState if s.is_final}
    assert final == {RequestState.FINISHED, RequestState.ABORTED, RequestState.REJECTED}


def test_request_accepts_numpy_numbers():
    r = Request("a", "generation", np.float64(1.5), np.int64(3), max_output_tokens=np.int32(2))
    assert (r.arrival_time, r.input_len, r.max_output_tokens) == (1.5, 3, 2)
    assert type(r.input_len) is int


@pytest.mark.parametrize("end", ["finish", "abort", "reject"])
def test_add_refuses_a_request_that_already_ended(end):
    """Defect: a finished embedding yielded a 0-token item every iteration (has_work stayed
    true), an aborted one a 10-token item with no blocks, a finished generation made every
    schedule() raise."""
    policy = make_policy("ibs", SchedulerConfig(token_budget=64, chunk_size=32))
    (req,) = make_requests([("embedding", 0, 10, 0)])
    if end == "finish":
        policy.add(req)
        policy.complete(policy.schedule(), 1.0)
        assert req.state is RequestState.FINISHED
    elif end == "abort":
        policy.add(req)
        policy.abort(req.request_id)
    else:
        req.reject("no")
    with pytest.raises(ValueError, match="only a waiting request can be added"):
        make_policy("ibs").add(req)
    assert not policy.has_work and not policy.schedule()


def test_embedding_queue_follows_arrival_order_not_add_order():
    """Defect: the embedding queue followed add order; a request added late with an early
    arrival was served after later ones (the generation queue was already sorted)."""
    policy = make_policy("ibs", SchedulerConfig(token_budget=64, chunk_size=64))
    reqs = make_requests([("embedding", t, 64, 0) for t in (1.0, 2.0, 10.0, 0.5, 0.8)])
    for r in reqs:
        policy.add(r, 10.0)
    assert [r.arrival_time for r in policy.embeddings()] == [0.5, 0.8, 1.0, 2.0, 10.0]
    first = policy.schedule(10.0)
    assert first.items[0].request.arrival_time == 0.5


def test_pooler_copies_what_it_keeps():
    """Defect: CLS/last/buffer kept references to the caller's array; a caller that reuses its
    buffer changed an embedding already pooled ([4, 5] instead of [0, 1])."""
    h = np.arange(8.0).reshape(4, 2)
    for head, expected in (("cls", [0, 1]), ("last", [6, 7])):
        buf = h[0:2].copy()
        pooler = IncrementalPooler(head)
        pooler.update(buf)
        buf[:] = h[2:4]
        pooler.update(buf)
        if head == "cls":
            buf[:] = -1  # the caller reuses its buffer after the last chunk too
        np.testing.assert_array_equal(pooler.result(), expected)
    buf = h[0:2].copy()
    pooler = IncrementalPooler("buffer", fn=lambda m: m.sum(0))
    pooler.update(buf)
    buf[:] = 100
    pooler.update(h[2:4])
    np.testing.assert_array_equal(pooler.result(), h.sum(0))


def test_pooler_does_not_keep_a_torch_batch_alive():
    torch = pytest.importorskip("torch")
    batch = torch.arange(12.0).reshape(6, 2)
    pooler = IncrementalPooler("last")
    pooler.update(batch[1:3])
    kept = pooler.result()
    assert kept.untyped_storage().nbytes() == 2 * 4  # its own row, not the 6-row batch
    batch[2] = -1
    assert kept.tolist() == [4.0, 5.0]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_l2_normalisation_does_not_overflow_or_divide_zero(dtype):
    """Defect: fp16 [300, 400] normalised to [0, 0] (the square overflows) and a zero row
    gave NaN."""
    from orthrus_sim.engine import l2_normalize

    np.testing.assert_allclose(l2_normalize(np.array([300, 400], dtype=dtype)), [0.6, 0.8],
                               rtol=1e-6)
    zero = l2_normalize(np.zeros(3, dtype=dtype))
    assert not np.isnan(zero).any() and (zero == 0).all()
    for head in ("cls", "last"):
        pooler = IncrementalPooler(head, normalize=True)
        pooler.update(np.array([[300, 400]], dtype=dtype))
        np.testing.assert_allclose(pooler.result(), [0.6, 0.8], rtol=1e-6)


@pytest.mark.parametrize("state", ["waiting", "running"])
def test_re_adding_a_live_request_names_the_duplicate_id(state):
    policy = make_policy("ibs", SchedulerConfig(token_budget=64, chunk_size=32))
    (req,) = make_requests([("generation", 0, 10, 5)])
    policy.add(req)
    if state == "running":
        policy.complete(policy.schedule(), 1.0)
        assert req.state is RequestState.RUNNING
    with pytest.raises(ValueError, match=rf"request id '{req.request_id}' is already here \({state}\)"):
        policy.add(req)
    other = Request(req.request_id, RequestKind.EMBEDDING, 2.0, 8)  # a new request, same id
    with pytest.raises(ValueError, match="ids must be unique"):
        policy.add(other)


def test_unified_homo_gets_no_decode_run_while_an_embedding_waits():
    """The issue's reproduction: Unified-Homo picks its side by waiting time, so a run of
    decodes announced while an embedding waits would be wrong (the next schedule picks the
    embedding)."""
    from orthrus_sim.engine.decode_run import decode_run_length

    def steps(clock_free: bool):
        policy = make_policy("unified-homo", SchedulerConfig(token_budget=64, chunk_size=64))
        policy.clock_free = clock_free
        policy.use_cohort()
        policy.add(Request("g", RequestKind.GENERATION, 0.0, 8, max_output_tokens=10), 0.0)
        policy.complete(policy.schedule(0.0), 1.0)
        policy.add(Request("e1", RequestKind.EMBEDDING, 0.5, 64), 0.5)
        policy.complete(policy.schedule(1.0), 2.0)
        policy.add(Request("e2", RequestKind.EMBEDDING, 1.5, 64), 1.5)
        batch = policy.schedule(2.0)
        run = decode_run_length(policy, batch)
        policy.complete(batch, 3.0)
        return run, policy.schedule(3.0)

    run, after = steps(clock_free=False)
    assert run == 0 and any(it.kind is ItemKind.EMBED_CHUNK for it in after.items)
    run, _ = steps(clock_free=True)  # as before the fix: a 9-step run the next batch breaks
    assert run == 9
