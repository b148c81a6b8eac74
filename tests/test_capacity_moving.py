"""Capacity over a load that moves: a trace scaled as a whole, judged over the window and its
worst 5 minutes."""

from __future__ import annotations

import json

import pytest
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


def test_a_run_stops_once_a_kind_can_no_longer_reach_its_attainment(tmp_path):
    from orthrus_sim.sim.run import simulate

    raw = tiny_trace(tmp_path) | {"configurations": ["dedicated-1:1"]}
    raw["slo"]["latency_s"] = 0.001  # no embedding meets it
    full = simulate(parse_scenario(raw, base_dir=tmp_path), "dedicated-1:1").metrics
    assert full["slo"]["embedding"]["attainment"] < 0.99 and "stopped_early" not in full
    stopped = simulate(parse_scenario(raw | {"stop_below_attainment": 0.99}, base_dir=tmp_path),
                       "dedicated-1:1").metrics
    stop = stopped["stopped_early"]
    # 2,400 embeddings: the 25th miss (more than 1 % of them) decides it
    assert stop["kind"] == "embedding" and stop["most_requests"] == 2400 and stop["missed"] == 25
    assert stop["time_s"] < 10 < full["sim_end_s"] and stopped["sim_end_s"] == stop["time_s"]
    assert not meets(stopped, open_loop_load(parse_scenario(raw, base_dir=tmp_path)), 0.5)
    # a run that meets its SLOs runs to its end and is the run without the stop
    raw["slo"]["latency_s"] = 60.0
    raw["slo"]["ttft_s"] = raw["slo"]["tpot_s"] = 60.0
    plain = simulate(parse_scenario(raw, base_dir=tmp_path), "dedicated-1:1").metrics
    kept = simulate(parse_scenario(raw | {"stop_below_attainment": 0.99}, base_dir=tmp_path),
                    "dedicated-1:1").metrics
    for m in (plain, kept):
        m.pop("sim_wall_s")
    assert kept == plain


def test_the_most_requests_a_workload_sends():
    from orthrus_sim.experiment.workload import Workload
    from orthrus_sim.sim.run import simulate

    def most(pools):
        sc = parse_scenario({"name": "m", "duration_s": 10, "seed": 3,
                             "workload": {"pools": pools}})
        return Workload(sc, lambda: 0.0).most_requests()

    burst = {"kind": "embedding", "process": "burst", "count": 7}
    assert most([burst, dict(burst, count=3)]) == {"embedding": 10, "generation": 0}
    assert most([{"kind": "mixed", "process": "burst", "count": 4}]) == {"embedding": 4,
                                                                          "generation": 4}
    closed = {"kind": "generation", "process": "closed-loop", "clients": 2}
    assert most([closed, burst]) == {"embedding": 7, "generation": None}
    # an open loop: exactly what the run sends (its source run dry, the same draws)
    pools = [{"kind": "generation", "process": "poisson", "rate": 3.0},
             {"kind": "mixed", "process": "mmpp", "rate": 9.0, "on_s": 2.0, "off_s": 3.0},
             {"kind": "embedding", "process": "diurnal", "rate": 4.0, "period_s": 6.0}]
    sc = parse_scenario({"name": "m", "duration_s": 10, "seed": 3, "workload": {"pools": pools}})
    sent = simulate(sc, "orthrus").metrics["issued"]
    assert most(pools) == sent and sent["generation"] > 30 and sent["embedding"] > 40
    with pytest.raises(ValueError, match="stop_below_attainment stops a run by its SLO "
                                         "attainment: give the slo section"):
        parse_scenario({"name": "m", "stop_below_attainment": 0.9,
                        "workload": {"pools": [burst]}})


def test_stopping_failing_runs_early_changes_no_answer(tmp_path):
    from orthrus_sim.questions.capacity import run_capacity

    sc = parse_scenario(tiny_trace(tmp_path), base_dir=tmp_path)
    docs = [run_capacity(sc, tmp_path / f"out-{full}", tolerance=0.4, max_gpus=2, scale=2.0,
                         max_parallel=1, full_runs=full) for full in (False, True)]
    early, full = docs
    assert [(r["configuration"], r["max_scale"], r["next_rate_rps"])
            for r in early["rate_search"]] == [(r["configuration"], r["max_scale"],
                                                 r["next_rate_rps"]) for r in full["rate_search"]]
    assert [(f["family"], f["gpus_needed"]) for f in early["gpu_search"]["families"]] \
        == [(f["family"], f["gpus_needed"]) for f in full["gpu_search"]["families"]]
    runs = [x for r in early["rate_search"] for x in r["runs"]]
    stopped = [x for x in runs if x["stopped_early"]]
    assert stopped and all(not x["passed"] and x["attainment"] == {"embedding": None,
                                                                   "generation": None}
                           for x in stopped)
    assert not any(x["stopped_early"] for r in full["rate_search"] for x in r["runs"])


def test_an_open_loop_run_by_duration_stops_early_or_is_the_run_without_the_stop():
    from orthrus_sim.sim.run import simulate

    raw = {"name": "o", "seed": 2, "duration_s": 30, "warmup_s": 5, "cluster": {"gpus": 2},
           "calibration": "a100-40gb", "slo": {"ttft_s": 60.0, "tpot_s": 1.0, "latency_s": 60.0},
           "workload": {"pools": [
               {"kind": "generation", "process": "mmpp", "rate": 12.0, "on_s": 3.0, "off_s": 4.0},
               {"kind": "embedding", "process": "poisson", "rate": 20.0}]},
           "configurations": ["dedicated-1:1"]}
    plain = simulate(parse_scenario(raw), "dedicated-1:1")
    kept = simulate(parse_scenario(raw | {"stop_below_attainment": 0.99}), "dedicated-1:1")
    assert kept.timeline == plain.timeline and kept.requests == plain.requests
    for m in (plain.metrics, kept.metrics):
        m.pop("sim_wall_s")
    assert kept.metrics == plain.metrics and "stopped_early" not in kept.metrics
    raw["slo"]["latency_s"] = 0.001  # no embedding meets it: stopped long before 30 s
    stopped = simulate(parse_scenario(raw | {"stop_below_attainment": 0.99}), "dedicated-1:1")
    stop = stopped.metrics["stopped_early"]
    assert stop["kind"] == "embedding" and stop["most_requests"] == plain.metrics["issued"][
        "embedding"] and stop["time_s"] < 10


def test_the_most_requests_bound_what_pools_sharing_num_requests_send():
    from orthrus_sim.experiment.workload import Workload
    from orthrus_sim.sim.run import simulate

    sc = parse_scenario({"name": "n", "seed": 4, "num_requests": 50, "workload": {"pools": [
        {"kind": "generation", "process": "poisson", "rate": 5.0},
        {"kind": "embedding", "process": "poisson", "rate": 5.0}]}})
    most = Workload(sc, lambda: 0.0).most_requests()
    sent = simulate(sc, "orthrus").metrics["issued"]
    assert most == {"embedding": 50, "generation": 50}  # each pool alone could send them all
    assert all(most[k] >= sent[k] for k in sent) and sum(sent.values()) == 50


def test_a_measured_run_refuses_a_simulated_stop(tmp_path):
    from orthrus_real.cluster.machine_plan import real_scenario

    sc = parse_scenario(tiny_trace(tmp_path) | {"stop_below_attainment": 0.99}, base_dir=tmp_path)
    with pytest.raises(ValueError, match="a measured run is not stopped"):
        real_scenario(sc, str(tmp_path), None, None, 4096, gpus=2)
