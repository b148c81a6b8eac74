"""The library of the engine's fp32 projections on a CPU (orthrus_real/engine/cpu_gemm.py): the
setting, the once-per-process probe, the routing by rows, and the engine's output either way."""

import pytest
import torch

from orthrus_real.engine import cpu_gemm
from orthrus_real.engine.cpu_gemm import NARROW_ROWS, CpuGemm, choose_cpu_gemm, resolve_setting
from orthrus_real.engine.sampling import SamplingParams
from orthrus_real.engine.torch_engine import Engine


def test_a_named_library_is_taken_as_asked_and_a_wrong_name_is_named(monkeypatch):
    monkeypatch.delenv("ORTHRUS_CPU_GEMM", raising=False)
    assert choose_cpu_gemm("mkl", 64, 256) == CpuGemm("mkl", "mkl", "as asked")
    assert choose_cpu_gemm("onednn", 64, 256) == CpuGemm("onednn", "onednn", "as asked")
    with pytest.raises(ValueError, match="--cpu-gemm must be one of auto, mkl, onednn, got 'blas'"):
        resolve_setting("blas")
    assert resolve_setting(None) == "auto"
    monkeypatch.setenv("ORTHRUS_CPU_GEMM", "mkl")
    assert choose_cpu_gemm(resolve_setting(None), 64, 256).few == "mkl"
    assert resolve_setting("onednn") == "onednn"  # the option over the variable
    monkeypatch.setenv("ORTHRUS_CPU_GEMM", "fast")
    with pytest.raises(ValueError, match="ORTHRUS_CPU_GEMM must be one of auto, mkl, onednn"):
        resolve_setting(None)


def test_auto_measures_once_per_shape_and_thread_count(monkeypatch):
    monkeypatch.delenv("ORTHRUS_CPU_GEMM", raising=False)
    monkeypatch.setattr(cpu_gemm, "_probed", {})
    calls = []

    def fake_probe(k, n):
        calls.append((k, n))
        return "onednn", "mkl", "measured: fake"

    monkeypatch.setattr(cpu_gemm, "probe", fake_probe)
    first = choose_cpu_gemm("auto", 64, 256)
    again = choose_cpu_gemm("auto", 100, 300)  # a tiny model's shape: probed at the floor size
    assert calls == [(512, 2048)] and first == again == CpuGemm("onednn", "mkl", "measured: fake")
    choose_cpu_gemm("auto", 8192, 65536)  # a large one: capped so that the probe stays short
    assert calls[-1] == (4096, 4096)
    threads = torch.get_num_threads()
    try:  # another thread count is another measurement (what a GEMM costs depends on it)
        torch.set_num_threads(1 if threads > 1 else 2)
        choose_cpu_gemm("auto", 64, 256)
        assert len(calls) == 3 and calls[-1] == (512, 2048)
    finally:
        torch.set_num_threads(threads)


def test_the_probe_takes_onednn_only_past_the_margin(monkeypatch):
    # times fed to the probe: oneDNN 10 % faster for few rows, 2 % for many (under the margin)
    ticks = iter([0.0, 1.0, 1.0, 1.9] * 5 + [0.0, 1.0, 1.0, 1.98] * 5)

    def timed(_x, _w):
        return None

    monkeypatch.setattr(cpu_gemm, "LIBRARIES", {"mkl": timed, "onednn": timed})
    few, many, why = cpu_gemm.probe(16, 32, clock=lambda: next(ticks))
    assert (few, many) == ("onednn", "mkl")
    assert "64x16x32: mkl 1000.00 ms, onednn 900.00 ms" in why
    assert "512x16x32: mkl 1000.00 ms, onednn 980.00 ms" in why


def test_projections_route_by_rows_and_dtype(monkeypatch):
    seen = []
    monkeypatch.setattr(cpu_gemm, "LIBRARIES", {
        "mkl": lambda x, w, b=None, split=True: seen.append(("mkl", x.shape[0])) or x @ w.t(),
        "onednn": lambda x, w, b=None, split=True: seen.append(("onednn", x.shape[0])) or x @ w.t()})
    gemm = CpuGemm("onednn", "mkl", "test")
    w = torch.randn(8, 4)
    gemm.linear(torch.randn(NARROW_ROWS, 4), w)
    gemm.linear(torch.randn(NARROW_ROWS + 1, 4), w)
    gemm.linear(torch.randn(3, 4, dtype=torch.bfloat16), w.bfloat16())  # bf16: F.linear
    assert seen == [("onednn", NARROW_ROWS), ("mkl", NARROW_ROWS + 1)]
    assert "onednn for <= 256 rows, mkl above (test)" in gemm.describe()


def test_mkl_splits_only_where_asked(monkeypatch):
    # MKL's column split (few rows, a wide weight) is for the projections it was measured on;
    # O and down pass split=False and get one plain F.linear, as before this choice existed
    calls = []
    w = torch.randn(2 * cpu_gemm.SPLIT_COLS, 8)
    x = torch.randn(4, 8)
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda *a: calls.append(a[1].shape[0]) or real(*a))
    cpu_gemm.mkl_linear(x, w)
    assert calls == [cpu_gemm.SPLIT_COLS, cpu_gemm.SPLIT_COLS]
    calls.clear()
    cpu_gemm.mkl_linear(x, w, split=False)
    assert calls == [2 * cpu_gemm.SPLIT_COLS]


@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_every_projection_of_the_engine_goes_through_the_chosen_library(tiny_models, monkeypatch,
                                                                        library):
    # 4 projections a layer (QKV, O, gate/up, down) per forward pass, plus the LM head on the
    # rows that sample; the qwen2 model's QKV bias goes along
    calls = {"mkl": 0, "onednn": 0}

    def counted(name):
        real = cpu_gemm.LIBRARIES[name]

        def run(x, w, b=None, split=True):
            calls[name] += 1
            return real(x, w, b, split)
        return run

    eng = Engine(tiny_models["qwen2"], device="cpu", dtype="float32", cpu_gemm=library)
    monkeypatch.setattr(cpu_gemm, "LIBRARIES", {n: counted(n) for n in ("mkl", "onednn")})
    eng.add_generation("g", token_ids=list(range(5, 30)),
                       params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.run_until_idle()
    other = "onednn" if library == "mkl" else "mkl"
    layers = eng.cfg.num_layers
    assert calls[other] == 0
    assert calls[library] == eng.iterations * (4 * layers + 1)


def test_the_engine_gives_the_same_tokens_and_embeddings_with_either_library(tiny_models):
    outputs = {}
    for library in ("mkl", "onednn"):
        eng = Engine(tiny_models["llama"], device="cpu", dtype="float32", cpu_gemm=library)
        assert eng.describe()["cpu_gemm"].startswith(f"fp32 projections: {library} for")
        for i in range(3):
            eng.add_generation(f"g{i}", token_ids=list(range(5 + i, 40 + 3 * i)),
                               params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            eng.add_embedding(f"e{i}", token_ids=list(range(7, 60 + 20 * i)), pooling="mean")
        outputs[library] = eng.run_until_idle()
    mkl, onednn = outputs["mkl"], outputs["onednn"]
    for i in range(3):
        assert mkl[f"g{i}"].token_ids == onednn[f"g{i}"].token_ids
        torch.testing.assert_close(torch.tensor(onednn[f"e{i}"].embedding),
                                   torch.tensor(mkl[f"e{i}"].embedding), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="--cpu-gemm must be one of"):
        Engine(tiny_models["llama"], device="cpu", cpu_gemm="openblas")
    with pytest.raises(ValueError, match="--cpu-gemm must be one of"):  # bf16: named all the same
        Engine(tiny_models["llama"], device="cpu", dtype="bfloat16", cpu_gemm="openblas")
    bf16 = Engine(tiny_models["llama"], device="cpu", dtype="bfloat16", cpu_gemm="onednn")
    assert bf16.gemm is None and "cpu_gemm" not in bf16.describe()  # F.linear, as before


def test_a_wrong_environment_setting_is_named_by_every_engine(tiny_models, monkeypatch):
    monkeypatch.setenv("ORTHRUS_CPU_GEMM", "fastest")
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(ValueError, match="ORTHRUS_CPU_GEMM must be one of auto, mkl, onednn"):
            Engine(tiny_models["llama"], device="cpu", dtype=dtype)


def test_a_calibration_records_the_library(tiny_models):
    from orthrus_real.engine.device import engine_environment

    eng = Engine(tiny_models["llama"], device="cpu", dtype="float32", cpu_gemm="onednn")
    assert engine_environment(eng, "torch")["engine_version"].endswith(
        ", fp32 projections onednn/onednn")
