"""The PyTorch engine against Hugging Face transformers, and its scheduling-independence."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from orthrus_real.engine.init_model import init_model  # noqa: E402
from orthrus_real.engine.model_files import read_adapter, read_config  # noqa: E402
from orthrus_real.engine.sampling import SamplingParams  # noqa: E402
from orthrus_real.engine.torch_engine import Engine, RequestRejected  # noqa: E402
from orthrus_sim.engine import POLICIES, Request, RequestKind, SchedulerConfig, pool  # noqa: E402

# The engine tests run on one device: CUDA where this torch has it (or ORTHRUS_TEST_DEVICE),
# else the CPU; in fp32 on both, with tolerances for each (GPU kernels sum in other orders).
DEVICE = os.environ.get("ORTHRUS_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
TOL = {"atol": 2e-5, "rtol": 1e-4} if DEVICE == "cpu" else {"atol": 2e-4, "rtol": 2e-3}


def engine_on(*args, **kwargs) -> Engine:
    kwargs.setdefault("device", DEVICE)
    kwargs.setdefault("dtype", "float32")
    return Engine(*args, **kwargs)


FAMILIES = ("llama", "mistral", "qwen2")
MIXED_POLICIES = ("ibs", "unified-hetero", "unified-homo")


def hf_model(path, merge_adapter=False):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    model.to(DEVICE)
    if merge_adapter:
        cfg = read_config(path)
        adapter = read_adapter(path / "adapter", cfg.num_layers)
        for (layer, module), (a, b) in adapter.weights.items():
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            lin = getattr(getattr(model.model.layers[layer], group), module)
            lin.weight.data += (b.float() @ a.float()).to(DEVICE) * adapter.scaling
    return model


def prompt_ids(n, seed=0, vocab=500):
    return [int(t) for t in np.random.default_rng(seed).integers(4, vocab, size=n)]


def engine_hidden(engine, ids, kind):
    """Final hidden states of one whole-prompt item (and the logits of every row)."""
    req = Request("probe", kind, 0.0, len(ids), max_output_tokens=1 if kind is RequestKind.GENERATION else 0,
                  token_ids=ids)
    from orthrus_real.engine.base import _State

    req.payload = _State(tokens=list(ids))
    engine.policy.add(req)
    batch = engine.policy.schedule()
    hidden = engine.forward(batch)
    engine.policy.abort("probe")
    return hidden


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_models, family):
    path = tiny_models[family]
    engine = engine_on(path, scheduler=SchedulerConfig(token_budget=512, chunk_size=512))
    ids = prompt_ids(37)
    ours = engine.model.logits(engine_hidden(engine, ids, RequestKind.GENERATION))
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids], device=DEVICE)).logits[0]
    torch.testing.assert_close(ours, ref, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_rows_match_transformers_with_merged_adapter(tiny_models, family):
    path = tiny_models[family]
    engine = engine_on(path, adapter_dir=path / "adapter",
                    scheduler=SchedulerConfig(token_budget=512, chunk_size=512))
    ids = prompt_ids(29, seed=1)
    ours = engine_hidden(engine, ids, RequestKind.EMBEDDING)
    with torch.no_grad():
        x = torch.tensor([ids], device=DEVICE)
        ref = hf_model(path, merge_adapter=True).model(x).last_hidden_state[0]
        plain = hf_model(path).model(x).last_hidden_state[0]
    torch.testing.assert_close(ours, ref, **TOL)
    assert (ours - plain).abs().max() > 1e-2  # the adapter really changes the output
    # generation rows of the same engine do not get the adapter
    gen = engine_hidden(engine, ids, RequestKind.GENERATION)
    torch.testing.assert_close(gen, plain, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_embedding_only_engine_serves_the_merged_model(tiny_models, family):
    """A Dedicated split's embedding server folds the adapter into its weights (the merged
    embedding model the simulator's plan prices): the same hidden states as the runtime
    adapter and as transformers with the adapter merged, and no adapter work per row."""
    path = tiny_models[family]
    sched = SchedulerConfig(token_budget=512, chunk_size=None)
    merged = engine_on(path, adapter_dir=path / "adapter", policy="embedding-only", scheduler=sched)
    runtime = engine_on(path, adapter_dir=path / "adapter", policy="ibs", scheduler=sched)
    assert merged.adapter_merged and merged.model.adapter is None and not merged.adapter_per_row
    assert runtime.adapter_per_row and "merged into the weights" in merged.describe()["embedding_adapter"]
    ids = prompt_ids(29, seed=1)
    ours = engine_hidden(merged, ids, RequestKind.EMBEDDING)
    torch.testing.assert_close(ours, engine_hidden(runtime, ids, RequestKind.EMBEDDING), **TOL)
    with torch.no_grad():
        ref = hf_model(path, merge_adapter=True).model(torch.tensor([ids], device=DEVICE))
    torch.testing.assert_close(ours, ref.last_hidden_state[0], **TOL)
    for eng in (merged, runtime):
        eng.add_embedding("e", token_ids=ids)
        eng.run_until_idle()
    assert merged.stats[-1].lora_rows == 0 < runtime.stats[-1].lora_rows


def greedy(engine, rid, ids, n=12):
    engine.add_generation(rid, token_ids=ids, params=SamplingParams(max_tokens=n, temperature=0,
                                                                    ignore_eos=True))


def test_greedy_output_independent_of_batching(tiny_models):
    path = tiny_models["llama"]
    target = prompt_ids(40, seed=5)
    alone = engine_on(path)
    greedy(alone, "t", target)
    expected = alone.run_until_idle()["t"].token_ids
    assert len(expected) == 12
    for policy in MIXED_POLICIES:
        eng = engine_on(path, adapter_dir=path / "adapter", policy=policy,
                     scheduler=SchedulerConfig(token_budget=48, chunk_size=16))
        for i in range(3):
            eng.add_embedding(f"e{i}", token_ids=prompt_ids(30 + 7 * i, seed=10 + i))
            greedy(eng, f"g{i}", prompt_ids(20 + 5 * i, seed=20 + i), n=6 + i)
        greedy(eng, "t", target)
        eng.add_embedding("late", token_ids=prompt_ids(50, seed=99))
        out = eng.run_until_idle()
        assert out["t"].token_ids == expected, policy
        assert eng.policy.blocks.num_used == 0


@pytest.mark.parametrize("head", ["mean", "weighted-mean", "cls", "last"])
def test_chunked_embeddings_equal_single_pass(tiny_models, head):
    path = tiny_models["qwen2"]
    ids = [prompt_ids(n, seed=n) for n in (1, 15, 64, 97)]
    with torch.no_grad():
        ref_model = hf_model(path, merge_adapter=True)
        refs = [pool(ref_model.model(torch.tensor([x], device=DEVICE)).last_hidden_state[0].cpu().numpy(),
                     head, True) for x in ids]
    for chunk in (4, 16, 128):
        for policy in ("ibs", "unified-hetero", "unified-homo"):
            eng = engine_on(path, adapter_dir=path / "adapter", policy=policy,
                         scheduler=SchedulerConfig(token_budget=128, chunk_size=chunk))
            for i, x in enumerate(ids):
                eng.add_embedding(f"e{i}", token_ids=x, pooling=head, normalize=True)
                greedy(eng, f"g{i}", prompt_ids(9, seed=i), n=3)
            out = eng.run_until_idle()
            for i, ref in enumerate(refs):
                np.testing.assert_allclose(out[f"e{i}"].embedding, ref, **TOL,
                                           err_msg=f"{head} chunk={chunk} {policy}")


def test_preemption_recomputes_and_abort_frees_blocks(tiny_models):
    path = tiny_models["mistral"]
    free = engine_on(path)
    for i in range(4):
        greedy(free, f"g{i}", prompt_ids(30, seed=i), n=40)
    expected = {k: v.token_ids for k, v in free.run_until_idle().items()}
    tight = engine_on(path, scheduler=SchedulerConfig(block_size=8, chunk_size=16), kv_cache_tokens=160)
    for i in range(4):
        greedy(tight, f"g{i}", prompt_ids(30, seed=i), n=40)
    got = {k: v.token_ids for k, v in tight.run_until_idle().items()}
    assert tight.policy.preemptions["generation"] > 0
    assert got == expected
    assert tight.policy.blocks.num_used == 0
    greedy(tight, "x", prompt_ids(30), n=40)
    tight.add_embedding("y", token_ids=prompt_ids(60))
    tight.step()
    assert tight.policy.blocks.num_used > 0
    assert tight.abort("x").finish_reason == "abort"
    assert tight.abort("y") is not None
    assert tight.policy.blocks.num_used == 0 and not tight.has_work


def test_sampling_seed_stop_and_limits(tiny_models):
    path = tiny_models["llama"]
    eng = engine_on(path)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=7,
                            ignore_eos=True)
    eng.add_generation("a", token_ids=prompt_ids(10), params=params)
    eng.add_generation("b", token_ids=prompt_ids(10), params=params)
    out = eng.run_until_idle()
    assert out["a"].token_ids == out["b"].token_ids and out["a"].finish_reason == "length"
    first = out["a"].token_ids[2]
    eng.add_generation("c", token_ids=prompt_ids(10), params=SamplingParams(
        max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=7, stop_token_ids=[first]))
    c = eng.run_until_idle()["c"]
    assert c.finish_reason == "stop" and c.token_ids[-1] == first and len(c.token_ids) <= 3
    text = out["a"].text
    if len(text) > 3:
        stop = text[1:3]
        eng.add_generation("d", token_ids=prompt_ids(10), params=SamplingParams(
            max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=7, stop=[stop]))
        d = eng.run_until_idle()["d"]
        assert d.finish_reason == "stop" and stop not in d.text
    for bad, field in ((dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                       (dict(top_p=0), "top_p")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_k=50,
                                                                  top_p=0.9, seed=11)])
def test_a_resumed_generation_continues_as_if_never_moved(tiny_models, sampling):
    """What a gateway does when a replica dies mid-stream: a second engine gets the prompt and
    the tokens already sent (``resume_ids``) and answers only the rest; greedy and seeded sampling
    give the same tokens and text as the run that was never interrupted, usage counts them all."""
    path = tiny_models["llama"]
    params = SamplingParams(max_tokens=14, ignore_eos=True, **sampling)
    whole = engine_on(path)
    whole.add_generation("w", token_ids=prompt_ids(12, seed=3), params=params)
    ref = whole.run_until_idle()["w"]
    for k in (1, 6, 13):
        eng = engine_on(path, scheduler=SchedulerConfig(token_budget=64, chunk_size=8))
        eng.add_generation("r", token_ids=prompt_ids(12, seed=3), params=params,
                           resume_ids=ref.token_ids[:k])
        outs = []
        while eng.has_work:
            outs += [o for o in eng.step() if o.request_id == "r"]
        assert sum((o.new_token_ids for o in outs), []) == ref.token_ids[k:], k
        assert outs[-1].token_ids == ref.token_ids and outs[-1].text == ref.text
        assert outs[-1].prompt_tokens == 12 and outs[-1].finish_reason == "length"
        prefix = eng.tokenizer.decode(ref.token_ids[:k], skip_special_tokens=True).rstrip("\ufffd")
        assert prefix + "".join(o.new_text for o in outs) == ref.text
        assert eng.policy.blocks.num_used == 0
    with pytest.raises(ValueError, match="resume_token_ids holds 14 tokens"):
        whole.add_generation("x", token_ids=prompt_ids(12), params=params,
                             resume_ids=ref.token_ids)
    with pytest.raises(ValueError, match=r"resume_token_ids: token ids must be integers"):
        whole.add_generation("y", token_ids=prompt_ids(12), params=params, resume_ids=[-1])


def test_refusals_name_the_problem(tiny_models, tmp_path):
    path = tiny_models["llama"]
    eng = engine_on(path)
    with pytest.raises(RequestRejected, match="maximum length"):
        eng.add_embedding("long", token_ids=[5] * 5000)
    with pytest.raises(RequestRejected, match="max_tokens"):
        eng.add_generation("long", token_ids=[5] * 4000, params=SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="empty"):
        eng.add_embedding("empty", token_ids=[])
    with pytest.raises(ValueError, match="token ids must be integers"):
        eng.add_embedding("neg", token_ids=[-1])
    bad = init_model(tmp_path / "bert", "llama", "tiny")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="bidirectional"):
        engine_on(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTJForCausalLM"]}))
    with pytest.raises(ValueError, match="unknown architecture 'GPTJForCausalLM'"):
        engine_on(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        engine_on(bad)
    with pytest.raises(ValueError, match="does not exist"):
        engine_on(tmp_path / "nowhere")
    init_model(bad, "llama", "tiny")  # restore tokenizer and weights
    for f in bad.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        engine_on(bad)


def test_sharded_weights_load_the_same(tmp_path):
    one = init_model(tmp_path / "one", "qwen2", "tiny", seed=3)
    three = init_model(tmp_path / "three", "qwen2", "tiny", seed=3, shards=3)
    assert (three / "model.safetensors.index.json").exists()
    outs = []
    for path in (one, three):
        eng = engine_on(path)
        greedy(eng, "g", prompt_ids(12), n=5)
        outs.append(eng.run_until_idle()["g"].token_ids)
    assert outs[0] == outs[1]


def test_every_policy_name_runs_in_the_engine(tiny_models):
    for name, cls in POLICIES.items():
        if name in ("prefill-only", "decode-only"):
            continue
        eng = engine_on(tiny_models["llama"], policy=name)
        if RequestKind.EMBEDDING in cls.serves:
            eng.add_embedding("e", token_ids=prompt_ids(20))
        if RequestKind.GENERATION in cls.serves:
            greedy(eng, "g", prompt_ids(20), n=3)
        assert all(o.finished for o in eng.run_until_idle().values())



def test_a_fresh_chunk_after_a_chunk_with_context_is_attended_on_its_own():
    # a's second chunk (16 tokens, 16 cached) and b's first (16 fresh tokens) side by side: only
    # fresh chunks of equal length may share one attention call
    from orthrus_real.engine.attention import build_metadata
    from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind

    a = Request("a", RequestKind.EMBEDDING, 0.0, 48)
    b = Request("b", RequestKind.EMBEDDING, 0.0, 16)
    c = Request("c", RequestKind.EMBEDDING, 0.0, 16)
    batch = BatchUnit(64)
    batch.items = [BatchItem(a, ItemKind.EMBED_CHUNK, 16, 16), BatchItem(b, ItemKind.EMBED_CHUNK, 0, 16),
                   BatchItem(c, ItemKind.EMBED_CHUNK, 0, 16)]
    meta = build_metadata(batch, {"a": [0, 1, 2], "b": [3], "c": [4]}, 16, torch.device(DEVICE))
    plans = [(p.rows, p.count, p.slots is not None) for p in meta.chunks]
    assert plans == [(slice(0, 16), 1, True), (slice(16, 48), 2, False)]
    assert meta.chunks[0].slots.tolist() == list(range(32))
    assert meta.slot_mapping.tolist() == list(range(16, 32)) + list(range(48, 80))


def test_embeddings_are_bit_identical_whether_last_chunks_store_kv_or_not(tiny_models):
    """``embedding_kv: read`` (an embedding's last chunk attends to its own keys and values
    without storing them) gives the very embeddings and tokens of ``all`` (every chunk stores)."""
    path = tiny_models["qwen2"]
    outs = {}
    for mode in ("read", "all"):
        eng = engine_on(path, adapter_dir=path / "adapter", policy="ibs",
                        scheduler=SchedulerConfig(token_budget=64, chunk_size=16,
                                                  embedding_kv=mode))
        for i, n in enumerate((1, 15, 16, 40, 97)):
            eng.add_embedding(f"e{i}", token_ids=prompt_ids(n, seed=n), pooling="mean")
            greedy(eng, f"g{i}", prompt_ids(9 + i, seed=i), n=4)
        outs[mode] = eng.run_until_idle()
        assert eng.policy.blocks.num_used == 0
    for rid, out in outs["all"].items():
        got = outs["read"][rid]
        if rid.startswith("e"):
            assert np.array_equal(got.embedding, out.embedding), rid
        else:
            assert got.token_ids == out.token_ids, rid


def test_a_one_chunk_embedding_never_touches_the_kv_cache(tiny_models):
    """One-chunk and atomic embeddings hold no KV block while they run and write no cache slot
    (the cache tensors stay zero), and pool as before."""
    path = tiny_models["llama"]
    ids = [prompt_ids(n, seed=n) for n in (1, 12, 16)]
    for chunk in (16, None):
        eng = engine_on(path, adapter_dir=path / "adapter",
                        scheduler=SchedulerConfig(token_budget=64, chunk_size=chunk))
        used = []
        forward = eng.forward

        def watched(batch, forward=forward, eng=eng, used=used):
            used.append(eng.policy.blocks.num_used)
            return forward(batch)

        eng.forward = watched
        for i, x in enumerate(ids):
            eng.add_embedding(f"e{i}", token_ids=x)
        out = eng.run_until_idle()
        assert used and all(u == 0 for u in used)
        assert all(not c.any() for c in eng.caches), "a one-chunk embedding wrote the cache"
        ref = engine_on(path, adapter_dir=path / "adapter",
                        scheduler=SchedulerConfig(token_budget=64, chunk_size=chunk,
                                                  embedding_kv="all"))
        for i, x in enumerate(ids):
            ref.add_embedding(f"e{i}", token_ids=x)
        expected = ref.run_until_idle()
        assert any(c.any() for c in ref.caches)
        for i in range(len(ids)):
            assert np.array_equal(out[f"e{i}"].embedding, expected[f"e{i}"].embedding)


def test_an_unstored_last_chunk_reads_its_context_and_writes_nothing():
    from orthrus_real.engine.attention import build_metadata
    from orthrus_sim.engine.batch import BatchItem, BatchUnit, ItemKind

    a = Request("a", RequestKind.EMBEDDING, 0.0, 40)  # last chunk: 24 tokens after 16 cached
    b = Request("b", RequestKind.EMBEDDING, 0.0, 48)  # a middle chunk: stored
    batch = BatchUnit(64)
    batch.items = [BatchItem(a, ItemKind.EMBED_CHUNK, 16, 24), BatchItem(b, ItemKind.EMBED_CHUNK, 16, 16)]
    meta = build_metadata(batch, {"a": [5], "b": [0, 1]}, 16, torch.device(DEVICE),
                          lambda it: it.end < it.request.input_len)
    assert [c.stored for c in meta.chunks] == [False, True]
    assert meta.chunks[0].slots.tolist() == list(range(80, 96))  # its context only
    assert meta.chunks[0].mask.shape == (24, 40)
    assert meta.slot_mapping.tolist() == list(range(16, 32))  # b's chunk alone
    assert meta.write_rows.tolist() == list(range(24, 40))
    assert meta.positions.tolist() == list(range(16, 40)) + list(range(16, 32))
