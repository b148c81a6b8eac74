"""vLLM's own benchmark client drives ``orthrus-real serve`` (both endpoints, every request
successful; one engine, and a cluster of replicas behind its gateway), and the vLLM backend
keeps serving when its core raises for one request (the engine thread rebuilds it and re-runs
the others). Run in CI's vLLM stage (see .ci/run)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from orthrus_real.engine.init_model import init_model  # noqa: E402
from orthrus_real.engine.sampling import SamplingParams  # noqa: E402
from orthrus_real.server.engine_thread import EngineThread, RequestFailed  # noqa: E402
from orthrus_real.server.serving import wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAGIC = 400


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("bench") / "tiny", "llama", "tiny", seed=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# one engine, and a dedicated-1:1 cluster behind its gateway (docs/cluster.md)
@pytest.mark.parametrize("cluster", [[], ["--replicas", "2", "--configuration", "dedicated-1:1",
                                          "--threads", "1"]], ids=["engine", "cluster"])
def test_vllm_bench_serve_succeeds_on_completions_and_embeddings(model, tmp_path, cluster):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "orthrus_real.cli", "serve", "--model",
                               str(model), "--port", str(port), "--log-level", "warning",
                               *cluster], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, 120.0, server)
        for backend, endpoint, out_len in [("openai", "/v1/completions", 16),
                                           ("openai-embeddings", "/v1/embeddings", 1)]:
            name = backend + ".json"
            run = subprocess.run(
                [sys.executable, str(ROOT / "scripts" / "vllm_bench_serve.py"), "--backend", backend,
                 "--base-url", url, "--endpoint", endpoint, "--model", model.name,
                 "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", "32",
                 "--random-output-len", str(out_len), "--num-prompts", "32",
                 "--ready-check-timeout-sec", "60", "--disable-tqdm", "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", name],
                capture_output=True, text=True, timeout=300, env={**os.environ})
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            result = json.loads((tmp_path / name).read_text())
            assert result["completed"] == 32 and result.get("failed", 0) == 0, result
    finally:
        server.terminate()
        server.wait(60)


def test_vllm_backend_core_error_fails_one_request_and_reruns_the_rest(tmp_path):
    from orthrus_real.vllm_backend.engine import VllmEngine
    from orthrus_sim.engine import SchedulerConfig

    m64 = init_model(tmp_path / "m64", "llama", "tiny64", seed=3)
    sched = SchedulerConfig(token_budget=64, chunk_size=16, max_num_seqs=8, max_model_len=512)

    def factory():
        engine = VllmEngine(m64, scheduler=sched, kv_cache_tokens=4096)
        real_step = engine.step

        def step():  # vLLM's EngineCore.step raising, as a worker error would
            if any(MAGIC in r.token_ids for r in engine.policy.live()):
                raise RuntimeError("injected core fault")
            return real_step()

        engine.step = step
        return engine

    runner = EngineThread(factory).start()
    results: dict[str, object] = {}
    done = threading.Event()
    expected = 7

    def sink_for(rid):
        def sink(item):
            if isinstance(item, Exception) or item.finished:
                results[rid] = item
                if len(results) == expected:
                    done.set()
        return sink

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    try:
        runner.submit("generation", "bad", dict(token_ids=[MAGIC, 5, 6], params=greedy),
                      sink_for("bad"))
        for i in range(3):
            runner.submit("generation", f"g{i}", dict(token_ids=[5 + i, 9, 10], params=greedy),
                          sink_for(f"g{i}"))
            runner.submit("embedding", f"e{i}", dict(token_ids=[7, 8 + i, 9]), sink_for(f"e{i}"))
        assert done.wait(600)
    finally:
        runner.stop(60)
    assert isinstance(results["bad"], RequestFailed) and "injected core fault" in str(results["bad"])
    for i in range(3):
        assert len(results[f"g{i}"].token_ids) == 6
        assert results[f"e{i}"].embedding and results[f"e{i}"].finish_reason is None
    assert runner.rebuilds >= 1 and runner.failed is None
