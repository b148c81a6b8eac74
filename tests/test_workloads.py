"""Every shipped scenario validates; trace replay, gamma arrivals, empirical lengths, phases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orthrus_sim.scenario import load_scenario, parse_scenario
from orthrus_sim.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_scenario_file_validates(path):
    sc = load_scenario(path)
    assert sc.configurations


def base(**workload) -> dict:
    return {"name": "w", "seed": 5, "cluster": {"gpus": 1}, "configurations": ["orthrus"],
            "workload": workload}


def test_trace_replay_issues_exactly_the_trace(tmp_path):
    rows = [{"arrival_time": 0.1 * i, "kind": "generation" if i % 3 else "embedding",
             "input_tokens": 50 + i, "output_tokens": 5 + i % 4} for i in range(30)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    result = simulate(parse_scenario(base(kind="trace", trace=str(trace))), "orthrus")
    assert [r["arrival_s"] for r in result.requests] == pytest.approx([r["arrival_time"] for r in rows])
    assert [r["input_tokens"] for r in result.requests] == [r["input_tokens"] for r in rows]
    gens = [r for r in result.requests if r["kind"] == "generation"]
    assert [g["output_tokens"] for g in gens] == [r["output_tokens"] for r in rows
                                                   if r["kind"] == "generation"]
    csv_trace = tmp_path / "t.csv"
    csv_trace.write_text("arrival_time,kind,input_tokens,output_tokens\n0,video,5,1\n")
    with pytest.raises(ValueError, match="row 1: kind must be embedding or generation"):
        simulate(parse_scenario(base(kind="trace", trace=str(csv_trace))), "orthrus")


def test_gamma_arrivals_match_rate_and_burstiness():
    raw = base(arrival={"process": "gamma", "rate": 20.0, "cv": 3.0}, generation_share=0.0)
    raw["num_requests"] = 4000
    result = simulate(parse_scenario(raw), "orthrus")
    arrivals = np.array(sorted(r["arrival_s"] for r in result.requests))
    gaps = np.diff(arrivals)
    assert 1 / gaps.mean() == pytest.approx(20.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.2)


def test_empirical_lengths_come_from_the_file(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("17\n33\n65\n")
    raw = base(arrival={"process": "closed-loop", "clients": 4}, generation_share=0.0,
               embedding_input={"dist": "empirical", "path": str(f)})
    raw["num_requests"] = 200
    result = simulate(parse_scenario(raw), "orthrus")
    assert {r["input_tokens"] for r in result.requests} == {17, 33, 65}
    with pytest.raises(ValueError, match="does not exist"):
        parse_scenario(base(embedding_input={"dist": "empirical", "path": str(tmp_path / "no")}))


def test_count_phases_change_the_mix():
    raw = base(arrival={"process": "closed-loop", "clients": 8},
               phases=[{"requests": 300, "generation_share": 0.0},
                       {"requests": 300, "generation_share": 1.0}],
               generation_output={"dist": "fixed", "value": 4})
    result = simulate(parse_scenario(raw), "orthrus")
    phases = result.metrics["phases"]
    assert [p["issued"] for p in phases] == [300, 300]
    kinds = [{r["kind"] for r in result.requests if r["phase"] == i} for i in (0, 1)]
    assert kinds == [{"embedding"}, {"generation"}]
    assert all(p["completion_s"] > 0 for p in phases)


def test_least_work_router_balances_better_than_round_robin_under_skew():
    raw = base(arrival={"process": "poisson", "rate": 40.0}, generation_share=1.0,
               generation_prompt={"dist": "lognormal", "median": 200, "sigma": 1.2, "max": 4000},
               generation_output={"dist": "lognormal", "median": 100, "sigma": 1.2, "max": 2000})
    raw.update(duration_s=60, cluster={"gpus": 4})
    p99 = {}
    for router in ("round-robin", "least-work"):
        raw["cluster"]["router"] = router
        p99[router] = simulate(parse_scenario(raw), "orthrus").metrics["latency_s"]["generation"]["p99"]
    assert p99["least-work"] <= p99["round-robin"] * 1.05
