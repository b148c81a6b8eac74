"""orthrus-real bench against a live loopback server: the simulator's results schema."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("httpx")

from orthrus_real.bench import bench  # noqa: E402
from orthrus_sim.scenario import parse_scenario  # noqa: E402
from orthrus_sim.sim.run import simulate  # noqa: E402
from tests.test_server import start_server  # noqa: E402


@pytest.fixture(scope="module")
def live(tiny_models):
    url, _ = start_server(tiny_models["llama"], max_queued=512)
    return url


def test_closed_loop_mix_writes_the_simulators_schema(live):
    raw = {"name": "live", "seed": 3, "duration_s": 3, "configurations": ["orthrus"],
           "workload": {"arrival": {"process": "closed-loop", "clients": 6}, "generation_share": 0.5,
                        "embedding_input": {"dist": "uniform", "low": 8, "high": 100},
                        "generation_prompt": {"dist": "fixed", "value": 16},
                        "generation_output": {"dist": "fixed", "value": 8}}}
    scenario = parse_scenario(raw)
    doc = asyncio.run(bench(live, scenario))
    measured = doc["runs"][0]["metrics"]
    simulated = simulate(scenario, "orthrus").metrics
    assert doc["schema"] == "orthrus.results/1"
    for key in ("throughput_rps", "latency_s", "utilization", "budget_fill", "completed",
                "unfinished", "rejected", "issued", "iterations", "window_s"):
        assert key in measured and key in simulated
    assert set(measured["latency_s"]) == set(simulated["latency_s"])
    assert measured["completed"]["embedding"] > 0 and measured["completed"]["generation"] > 0
    assert measured["latency_s"]["ttft"]["p50"] <= measured["latency_s"]["generation"]["p50"]
    for kind in ("embedding", "generation"):
        m = measured
        assert m["issued"][kind] == m["completed"][kind] + m["unfinished"][kind] + m["rejected"][kind]
    assert 0 < measured["utilization"]["busy"] <= 1.05


def test_iter_retgen_workflows_with_real_retrieval(live):
    raw = {"name": "live-iter", "seed": 1, "num_requests": 3, "configurations": ["orthrus"],
           "workload": {"kind": "iter-retgen", "arrival": {"process": "closed-loop", "clients": 2},
                        "iter_retgen": {"iterations": 2,
                                        "docs_per_query": {"dist": "uniform", "low": 1, "high": 3},
                                        "doc_tokens": {"dist": "fixed", "value": 30},
                                        "question_tokens": {"dist": "fixed", "value": 10},
                                        "output_tokens": {"dist": "fixed", "value": 6}}}}
    doc = asyncio.run(bench(live, parse_scenario(raw)))
    m = doc["runs"][0]["metrics"]
    assert m["completed"] == {"embedding": 6, "generation": 6, "workflow": 3}
    assert m["retrieval_s"]["count"] == 6
    assert m["latency_s"]["workflow"]["count"] == 3


def test_burst_and_rejections_are_reported(live):
    raw = {"name": "burst", "seed": 0, "configurations": ["orthrus"],
           "workload": {"arrival": {"process": "burst"},
                        "burst": [{"kind": "generation", "count": 4}, {"kind": "embedding", "count": 4}],
                        "embedding_input": {"dist": "fixed", "value": 5000},
                        "generation_prompt": {"dist": "fixed", "value": 8},
                        "generation_output": {"dist": "fixed", "value": 4}}}
    m = asyncio.run(bench(live, parse_scenario(raw)))["runs"][0]["metrics"]
    assert m["completed"]["generation"] == 4
    assert m["rejected"]["embedding"] == 4  # 5,000 tokens > the tiny model's 4,096
