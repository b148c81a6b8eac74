"""orthrus-real bench against a live loopback server: the simulator's results schema, and the
very same requests as the simulator for the same scenario and seed.

Every run here is bounded by request counts, not by a wall-clock window, so a slow or busy
machine changes how long it takes, not what it checks.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("httpx")

from orthrus_real.measure.bench import (  # noqa: E402
    LiveDriver,
    bench,
    stream_summary,  # noqa: E402
    write_results,
)
from orthrus_sim.experiment.scenario import parse_scenario  # noqa: E402
from orthrus_sim.sim.run import simulate  # noqa: E402
from tests.helpers import slo_from_rows  # noqa: E402
from tests.test_server import start_server  # noqa: E402


@pytest.fixture(scope="module")
def live(tiny_models):
    url, _ = start_server(tiny_models["llama"], max_queued=512)
    return url


def mix(**extra) -> dict:
    raw = {"name": "live", "seed": 3, "num_requests": 40, "configurations": ["orthrus"],
           "workload": {"arrival": {"process": "closed-loop", "clients": 6}, "generation_share": 0.5,
                        "embedding_input": {"dist": "uniform", "low": 8, "high": 100},
                        "generation_prompt": {"dist": "fixed", "value": 16},
                        "generation_output": {"dist": "fixed", "value": 8}}}
    raw.update(extra)
    return raw


def test_closed_loop_mix_writes_the_simulators_schema(live, tmp_path):
    slo = {"ttft_s": 0.05, "tpot_s": 0.01, "e2e_s": 0.5, "latency_s": 0.05}
    scenario = parse_scenario(mix(slo=slo))
    doc, rows = asyncio.run(bench(live, scenario))
    measured = doc["runs"][0]["metrics"]
    simulated = simulate(scenario, "orthrus").metrics
    assert doc["schema"] == "orthrus.results/1" and doc["scenario_sha256"] and doc["version"]
    for key in ("throughput_rps", "latency_s", "admission_wait_s", "utilization", "budget_fill",
                "completed", "unfinished", "rejected", "issued", "iterations", "preemptions",
                "window_s", "warnings", "slo"):
        assert key in measured and key in simulated, key
    assert set(measured["latency_s"]) == set(simulated["latency_s"])
    for m in (measured, simulated):
        assert sum(m["completed"].values()) == 40
        assert m["completed"]["embedding"] > 0 and m["completed"]["generation"] > 0
    assert measured["latency_s"]["ttft"]["p50"] <= measured["latency_s"]["generation"]["p50"]
    for kind in ("embedding", "generation"):
        m = measured
        assert m["issued"][kind] == m["completed"][kind] + m["unfinished"][kind] + m["rejected"][kind]
        # from the server's /metrics histogram: every request was admitted once
        assert m["admission_wait_s"][kind]["count"] == m["completed"][kind]
    assert 0 < measured["utilization"]["busy"] <= 1.05
    assert measured["iterations"] > 0 and measured["utilization"]["mfu"] > 0
    assert measured["preemptions"] == {"embedding": 0, "generation": 0}
    # SLO attainment and goodput from the same rule as the simulator's: check it on the rows
    for kind, (met, counted) in slo_from_rows(rows, slo).items():
        s = measured["slo"][kind]
        assert (s["met"], s["met"] + s["missed"]) == (met, counted)
        assert s["goodput_rps"] <= measured["throughput_rps"][kind]
    # what vLLM's client reports too: output tokens/s and inter-token latency percentiles
    gens = measured["completed"]["generation"]
    assert measured["output_tokens_per_s"] > 0 and measured["itl_s"]["count"] == gens * 7
    assert 0 < measured["itl_s"]["p50"] <= measured["itl_s"]["p99"]
    assert "output tokens/s:" in stream_summary(measured) and "p99" in stream_summary(measured)
    path = write_results(doc, rows, tmp_path)
    assert json.loads(path.read_text())["runs"][0]["configuration"] == "measured"
    assert (tmp_path / "requests_measured.csv").read_text().count("\n") == 41
    assert (tmp_path / "latency_cdf.png").exists()


@pytest.mark.parametrize("workload", [
    {"arrival": {"process": "closed-loop", "clients": 4, "think_time_s": 0.01},
     "generation_share": 0.5},
    {"pools": [{"kind": "embedding", "process": "closed-loop", "clients": 2},
               {"kind": "generation", "process": "poisson", "rate": 60.0}]},
    {"arrival": {"process": "burst"}, "burst": [{"kind": "generation", "count": 5},
                                                {"kind": "embedding", "count": 7}]},
], ids=["closed-loop", "pools", "burst"])
def test_simulator_and_bench_send_the_same_requests(live, workload):
    """The same scenario and seed: the same requests in the simulator and against a server
    (ids, kinds, lengths, token ids, intended send times); only when each is sent may differ."""
    workload = {"embedding_input": {"dist": "uniform", "low": 8, "high": 60},
                "generation_prompt": {"dist": "uniform", "low": 4, "high": 30},
                "generation_output": {"dist": "fixed", "value": 3}, **workload}
    scenario = parse_scenario(mix(num_requests=24, workload=workload))
    simulated = simulate(scenario, "orthrus", keep_specs=True).specs

    async def measured():
        import httpx

        from orthrus_real.measure.bench import HttpTransport

        async with httpx.AsyncClient(base_url=live, timeout=60) as client:
            driver = LiveDriver(HttpTransport(client, "llama"), scenario, keep_specs=True)
            await driver.run()
            return driver.workload.specs

    live_specs = asyncio.run(measured())

    def streams(specs):
        out: dict[str, list] = {}
        for s in specs:
            out.setdefault(s.client, []).append(
                (s.request_id, s.kind, s.input_len, s.max_output_tokens,
                 tuple(s.tokens.ids(500)), s.intended_at))
        return out

    expected = 12 if "burst" in json.dumps(workload) else 24  # 5 + 7 burst arrivals
    assert len(simulated) == len(live_specs) == expected
    sim, real = streams(simulated), streams(live_specs)
    # a client's n-th request is the same in both runs; how many each closed-loop client sent
    # under the shared num_requests cap depends on timing
    for client in set(sim) | set(real):
        a, b = sim.get(client, []), real.get(client, [])
        n = min(len(a), len(b))
        assert a[:n] == b[:n], client
    if "burst" in json.dumps(workload):
        assert sim == real


def test_iter_retgen_workflows(live):
    raw = {"name": "live-iter", "seed": 1, "num_requests": 3, "configurations": ["orthrus"],
           "workload": {"kind": "iter-retgen", "arrival": {"process": "closed-loop", "clients": 2},
                        "iter_retgen": {"iterations": 2, "corpus_size": 16, "retrieval": "vector",
                                        "docs_per_query": {"dist": "uniform", "low": 1, "high": 3},
                                        "doc_tokens": {"dist": "fixed", "value": 30},
                                        "question_tokens": {"dist": "fixed", "value": 10},
                                        "output_tokens": {"dist": "fixed", "value": 6}}}}
    doc, _ = asyncio.run(bench(live, parse_scenario(raw)))
    m = doc["runs"][0]["metrics"]
    assert m["completed"] == {"embedding": 6, "generation": 6, "workflow": 3}
    assert m["retrieval_s"]["count"] == 6  # a real vector search over the embedded corpus
    assert m["latency_s"]["workflow"]["count"] == 3


def test_burst_and_rejections_are_reported(live):
    raw = {"name": "burst", "seed": 0, "configurations": ["orthrus"],
           "workload": {"arrival": {"process": "burst"},
                        "burst": [{"kind": "generation", "count": 4}, {"kind": "embedding", "count": 4}],
                        "embedding_input": {"dist": "fixed", "value": 5000},
                        "generation_prompt": {"dist": "fixed", "value": 8},
                        "generation_output": {"dist": "fixed", "value": 4}}}
    doc, _ = asyncio.run(bench(live, parse_scenario(raw)))
    m = doc["runs"][0]["metrics"]
    assert m["completed"]["generation"] == 4
    assert m["rejected"]["embedding"] == 4  # 5,000 tokens > the tiny model's 4,096
    assert any("only 4 generation requests" in w for w in m["warnings"])


def test_bench_only_one_kind_repeated_and_pinned(live, tmp_path):
    import os

    from typer.testing import CliRunner

    from orthrus_real.cli import app

    raw = mix(num_requests=12, workload={
        "pools": [{"kind": "embedding", "process": "closed-loop", "clients": 3},
                  {"kind": "generation", "process": "closed-loop", "clients": 3}],
        "embedding_input": {"dist": "fixed", "value": 16},
        "generation_prompt": {"dist": "fixed", "value": 16},
        "generation_output": {"dist": "fixed", "value": 4}})
    path = tmp_path / "s.json"
    path.write_text(json.dumps(raw))
    cpu = str(min(os.sched_getaffinity(0)))
    before = os.sched_getaffinity(0)
    try:
        res = CliRunner().invoke(app, ["bench", str(path), "--url", live, "--only", "embedding",
                                       "--repeat", "2", "--client-cpus", cpu, "--label",
                                       "dedicated-1:1", "--out", str(tmp_path / "b"),
                                       "--set", "workload.generation_share=0.3"])
        assert os.sched_getaffinity(0) == {int(cpu)}
    finally:
        os.sched_setaffinity(0, before)
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "b" / "results.json").read_text())
    assert [r["configuration"] for r in doc["runs"]] == ["dedicated-1:1"] * 2
    for run in doc["runs"]:
        assert run["metrics"]["completed"] == {"embedding": 12, "generation": 0}
    # the runs carry what they were measured under, and a fit reads it back as its overrides
    assert [r["scenario_overrides"] for r in doc["runs"]] == [["workload.generation_share=0.3"]] * 2
    from orthrus_sim.experiment.measured import load_measured

    runs = load_measured([tmp_path / "b" / "results.json"], ["throughput_rps.*"],
                         at=[["cluster.gpus=2"]])
    assert [r.overrides for r in runs] == [("workload.generation_share=0.3", "cluster.gpus=2")] * 2
    spread = doc["repeats"]["throughput_rps.embedding"]
    assert len(spread["values"]) == 2 and spread["cv"] is not None
    assert "run-to-run CV" in res.output
    res = CliRunner().invoke(app, ["bench", str(path), "--url", live, "--only", "vision"])
    assert res.exit_code != 0 and "--only must be one of" in res.output


@pytest.mark.parametrize("body, expected", [(b"", None), (b'{"status": "ok"}', 1),
                                            (b'{"replicas": [{}, {}]}', 2), (b"[1]", None)])
def test_served_replicas_reads_any_servers_health(body, expected):
    """A stock server's /health (vLLM: 200, no body) is not an error: bench then knows no
    replica count and warns of none; an Orthrus engine is one replica, a cluster lists them."""
    import asyncio

    import httpx

    from orthrus_real.measure.bench import served_replicas

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await served_replicas(client)

    assert asyncio.run(go()) == expected


def test_a_stock_vllm_servers_engine_steps_come_from_its_own_histogram():
    # stock vLLM exposes no orthrus_iterations_total, but observes vllm:iteration_tokens_total
    # once per engine step: its count over the window is the steps the server ran
    from orthrus_real.measure.bench import engine_metrics, engine_steps, parse_prometheus

    def text(steps: int, tokens: int, extra: str = "") -> str:
        return (f'vllm:iteration_tokens_total_bucket{{engine="0",le="+Inf",model_name="m"}} {steps}\n'
                f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {steps}\n'
                f'vllm:iteration_tokens_total_sum{{engine="0",model_name="m"}} {tokens}\n' + extra)

    before, after = parse_prometheus(text(40, 900)), parse_prometheus(text(290, 4400))
    assert engine_steps(before, after) == 250
    measured = engine_metrics(before, after, 10.0, None)
    assert measured["iterations"] == 250
    assert measured["utilization"]["per_gpu"][0]["iterations"] == 250
    # an Orthrus engine's own counter is the one taken where both are exposed
    before = parse_prometheus(text(40, 900, "orthrus_iterations_total 7\n"))
    after = parse_prometheus(text(290, 4400, "orthrus_iterations_total 107\n"))
    assert engine_steps(before, after) == 100
    assert engine_steps({}, {}) == 0  # a server that exposes neither
