"""Capacity over a load that moves: a trace scaled as a whole, judged over the window and its
worst 5 minutes."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from orthrus_sim.cli import app
from orthrus_sim.experiment.scenario import parse_scenario
from orthrus_sim.experiment.slo import worst_stretch
from orthrus_sim.questions.capacity import (
    family,
    family_members,
    meets,
    open_loop_load,
    scaled_scenario,
)

runner = CliRunner()


def tiny_trace(tmp_path) -> dict:
    """Ten minutes: a calm stretch, then three minutes at five times the rate."""
    rows, t = [], 0.0
    while t < 600:
        rows.append(f"{t:.3f},{200 + int(t) % 300},{8 + int(t) % 5}")
        t += 0.1 if 300 <= t < 480 else 0.5
    (tmp_path / "gen.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                                      + "\n".join(rows) + "\n")
    (tmp_path / "emb.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "\n".join(
        f"{0.25 * i:.3f},{100 + i % 400},1" for i in range(2400)) + "\n")
    return {"name": "tiny-moving", "seed": 1, "calibration": "a100-40gb", "cluster": {"gpus": 2},
            "scheduler": {"token_budget": 1024, "chunk_size": 256},
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1, "latency_s": 0.5},
            "workload": {"pools": [
                {"kind": "generation", "process": "trace", "trace": "gen.csv"},
                {"kind": "embedding", "process": "trace", "trace": "emb.csv"}]},
            "configurations": ["dedicated-1:1", "dedicated-replan"]}


def test_worst_stretch_slides_by_the_minute():
    minutes = {0: [60, 60], 1: [60, 60], 2: [60, 60], 3: [60, 60], 4: [60, 60], 5: [0, 60],
               6: [60, 60]}
    worst = worst_stretch(minutes, 10.0)
    assert worst == {"attainment": 240 / 300, "start_s": 70.0, "counted": 300}
    assert worst_stretch({0: [1, 2]}, 0.0)["attainment"] == 0.5
    assert worst_stretch({}, 0.0) is None


def test_moving_load_is_scaled_as_a_whole_and_judged_on_its_worst_stretch(tmp_path):
    raw = tiny_trace(tmp_path)
    sc = parse_scenario(raw, base_dir=tmp_path)
    load = open_loop_load(sc)
    assert load.moving and family("dedicated-replan") == "dedicated-replan"
    starts = family("dedicated-replan-1:2")  # a re-planning split from every start
    assert family_members(starts, 3, load.rates) == ["dedicated-replan-1:2", "dedicated-replan-2:1"]
    assert abs(load.rates["embedding"] - 4.0) < 0.01  # 2,400 over 599.75 s
    data = scaled_scenario(sc.model_dump(mode="json"), load,
                           {"embedding": 1.5, "generation": 1.5}, "orthrus", 3)
    assert data["workload"]["rate_scale"] == 1.5 and data["cluster"]["gpus"] == 3
    # a scale times each kind's rate and divided back may differ in the last bit: one scale
    data = scaled_scenario(sc.model_dump(mode="json"), load,
                           {"embedding": 1.5, "generation": 1.4999999999999998}, "orthrus", 3)
    assert data["workload"]["rate_scale"] == 1.5
    whole = {"slo": {"embedding": {"attainment": 1.0, "worst_stretch": {"attainment": 1.0}},
                     "generation": {"attainment": 0.995, "worst_stretch": {"attainment": 0.9}}},
             "arrived_in_window": {}}
    assert meets(whole, load, 0.99) and not meets(whole, load, 0.99, 0.95)


def test_capacity_command_on_a_tiny_trace(tmp_path):
    raw = tiny_trace(tmp_path)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["capacity", str(path), "--tolerance", "0.25", "--scale", "2",
                              "--max-gpus", "3", "--max-parallel", "1",
                              "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "out" / "capacity.json").read_text())
    assert doc["moving_load"] and doc["required_stretch_attainment"] == 0.95
    by = {r["configuration"]: r for r in doc["rate_search"]}
    assert set(by) == {"dedicated-1:1", "dedicated-replan"}
    for r in by.values():
        assert r["bound"] == "found" and r["max_scale"] > 0
        run = next(x for x in r["runs"] if abs(x["offered_rps"] - r["max_rate_rps"]) < 1e-9)
        assert run["passed"] and min(run["worst_stretch"].values()) >= 0.95
    fams = {f["family"]: f for f in doc["gpu_search"]["families"]}
    assert set(fams) == {"dedicated", "dedicated-replan"}
    assert "rate search, round 1" in res.output and "GPU search, round 1" in res.output
