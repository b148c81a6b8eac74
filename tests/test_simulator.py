"""Simulator: worked examples per configuration, queueing theory, conservation, determinism."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from orthrus_sim.cli import app
from orthrus_sim.costmodel import get_model
from orthrus_sim.experiment.scenario import parse_scenario
from orthrus_sim.sim.run import simulate

A, B = 0.01, 0.0001  # the test cost: A seconds per iteration plus B per token


class LinearCost:
    lora = None

    def __init__(self, model, lora):
        self.model = model

    def shape_time(self, shape):
        return A + B * shape.tokens

    def shape_work(self, shape, steps=1):
        return 0.0, 0.0

    def decode_step_times(self, shape, steps):
        return [self.shape_time(shape)] * steps


def burst_scenario(configuration: str, gpus: int, **extra) -> dict:
    raw = {
        "name": "worked", "seed": 0, "cluster": {"gpus": gpus},
        "scheduler": {"token_budget": 1024, "chunk_size": 512, "num_blocks": 1000},
        "workload": {"arrival": {"process": "burst"},
                     "burst": [{"kind": "generation", "count": 1},
                               {"kind": "embedding", "count": 1}],
                     "embedding_input": {"dist": "fixed", "value": 128},
                     "generation_prompt": {"dist": "fixed", "value": 128},
                     "generation_output": {"dist": "fixed", "value": 4}},
        "configurations": [configuration],
    }
    raw.update(extra)
    return raw


def finish_times(configuration: str, gpus: int) -> dict[str, float]:
    scenario = parse_scenario(burst_scenario(configuration, gpus))
    result = simulate(scenario, configuration, cost_factory=LinearCost)
    assert all(r["state"] == "finished" for r in result.requests)
    return {r["kind"]: r["finished_s"] for r in result.requests} | {
        "ttft": next(r["first_token_s"] for r in result.requests if r["kind"] == "generation")}


EMB_ALONE = A + B * 128  # one 128-token pass
BOTH = A + B * 256  # embedding chunk and prompt in one pass
DECODE = A + B * 1


@pytest.mark.parametrize("configuration", ["orthrus", "unified-hetero"])
def test_worked_example_mixed_batch(configuration):
    t = finish_times(configuration, 1)
    assert t["embedding"] == pytest.approx(BOTH)
    assert t["ttft"] == pytest.approx(BOTH)
    assert t["generation"] == pytest.approx(BOTH + 3 * DECODE)


def test_worked_example_unified_homo_alternates():
    t = finish_times("unified-homo", 1)
    # both ready at t=0: the tie goes by arrival order, and the generation was added first
    assert t["ttft"] == pytest.approx(EMB_ALONE)  # its 128-token prompt costs what a 128-token input does
    assert t["embedding"] == pytest.approx(2 * EMB_ALONE)  # then the side that waited longest
    assert t["generation"] == pytest.approx(2 * EMB_ALONE + 3 * DECODE)


def test_unified_homo_request_arriving_mid_iteration_enters_at_its_end(tmp_path):
    """A request that arrives while an iteration runs enters the policy when it ends, as the
    real engines take new requests in between steps: an embedding arriving during a decode
    step is then ready no earlier than the decodes, and Unified-Homo runs one more decode step
    before it (fit validation, issue 22: entering at arrival, the simulated Homo alternated
    embedding and decode iterations where the real one ran two decode steps per embedding
    iteration, +38 % embedding throughput at the 1:9 mix)."""
    arrives = EMB_ALONE + DECODE / 2  # during the first decode step
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in (
        {"arrival_time": 0, "kind": "generation", "input_tokens": 128, "output_tokens": 4},
        {"arrival_time": arrives, "kind": "embedding", "input_tokens": 128})))
    raw = burst_scenario("unified-homo", 1)
    raw["workload"] = {"kind": "trace", "trace": str(trace)}
    result = simulate(parse_scenario(raw), "unified-homo", cost_factory=LinearCost)
    t = {r["kind"]: r for r in result.requests}
    # prompt, decode 1 (the embedding arrives), decode 2, the embedding, decode 3
    assert t["embedding"]["finished_s"] == pytest.approx(2 * EMB_ALONE + 2 * DECODE)
    assert t["embedding"]["arrival_s"] == pytest.approx(arrives)  # latency from its arrival
    assert t["generation"]["finished_s"] == pytest.approx(2 * EMB_ALONE + 3 * DECODE)


def test_worked_example_dedicated():
    t = finish_times("dedicated-1:1", 2)
    assert t["embedding"] == pytest.approx(EMB_ALONE)
    assert t["generation"] == pytest.approx(EMB_ALONE + 3 * DECODE)


def test_worked_example_disaggregated():
    t = finish_times("disagg-pd-1:1", 2)
    transfer = 128 * get_model("mistral-7b-v0.1").kv_bytes_per_token / 600e9
    assert t["embedding"] == pytest.approx(BOTH)
    assert t["ttft"] == pytest.approx(BOTH)
    assert t["generation"] == pytest.approx(BOTH + transfer + 3 * DECODE)


def test_dedicated_without_embedding_replicas_rejects_with_reason():
    scenario = parse_scenario(burst_scenario("dedicated-0:1", 1))
    result = simulate(scenario, "dedicated-0:1", cost_factory=LinearCost)
    emb = next(r for r in result.requests if r["kind"] == "embedding")
    assert emb["state"] == "rejected" and "no replica serving embedding" in emb["reject_reason"]
    assert result.metrics["rejected"]["embedding"] == 1


def test_single_replica_matches_md1_queueing():
    """Poisson arrivals, deterministic service, one request per iteration (the budget holds
    exactly one): M/D/1."""
    rate, tokens = 30.0, 128
    service = A + B * tokens
    rho = rate * service
    raw = {
        "name": "md1", "seed": 3, "num_requests": 20000, "warmup_s": 20.0,
        "scheduler": {"token_budget": tokens, "chunk_size": tokens, "num_blocks": 1000},
        "workload": {"generation_share": 0.0, "arrival": {"process": "poisson", "rate": rate},
                     "embedding_input": {"dist": "fixed", "value": tokens}},
        "configurations": ["unified:embedding-only"],
    }
    result = simulate(parse_scenario(raw), "unified:embedding-only", cost_factory=LinearCost)
    expected = service + rho * service / (2 * (1 - rho))  # Pollaczek-Khinchine, D service
    measured = result.metrics["latency_s"]["embedding"]["mean"]
    assert measured == pytest.approx(expected, rel=0.05)
    assert result.metrics["utilization"]["busy"] == pytest.approx(rho, rel=0.03)


def mixed_raw(**extra) -> dict:
    raw = {
        "name": "mixed", "seed": 11, "duration_s": 20, "calibration": "a100-40gb",
        "cluster": {"gpus": 2},
        "workload": {"arrival": {"process": "closed-loop", "clients": 48}, "generation_share": 0.4,
                     "embedding_input": {"dist": "uniform", "low": 16, "high": 1500},
                     "generation_prompt": {"dist": "lognormal", "median": 200, "sigma": 0.8,
                                           "max": 3000},
                     "generation_output": {"dist": "uniform", "low": 1, "high": 300}},
        "configurations": ["dedicated-1:1", "disagg-pd-1:1", "unified-homo", "unified-hetero", "orthrus"],
    }
    raw.update(extra)
    return raw


@pytest.mark.parametrize("configuration", ["dedicated-1:1", "disagg-pd-1:1", "unified-homo",
                                           "unified-hetero", "orthrus"])
def test_conservation(configuration):
    result = simulate(parse_scenario(mixed_raw()), configuration)
    m = result.metrics
    for kind in ("embedding", "generation"):
        assert m["issued"][kind] == m["completed"][kind] + m["unfinished"][kind] + m["rejected"][kind]
    assert m["completed"]["embedding"] > 0 and m["completed"]["generation"] > 0
    assert len(result.requests) == sum(m["issued"].values())


def test_same_seed_same_results():
    scenario = parse_scenario(mixed_raw())
    a = simulate(scenario, "orthrus").metrics
    b = simulate(scenario, "orthrus").metrics
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = simulate(parse_scenario(mixed_raw(seed=12)), "orthrus").metrics
    assert c["completed"] != a["completed"] or c["latency_s"] != a["latency_s"]


ALL_CONFIGURATIONS = ["dedicated-1:1", "disagg-pd-1:1", "unified-homo", "unified-hetero", "orthrus"]


@pytest.mark.parametrize("configuration", ALL_CONFIGURATIONS)
def test_decode_runs_equal_stepping_one_iteration_at_a_time(configuration):
    """Every configuration, so every policy (clock-free or not: Unified-Homo's choice depends
    on waiting time), gives with the fast path the very timestamps of stepping."""
    scenario = parse_scenario(mixed_raw(duration_s=15))
    fast = simulate(scenario, configuration, fast_forward=True)
    slow = simulate(scenario, configuration, fast_forward=False)
    assert fast.metrics["iterations"] == slow.metrics["iterations"]
    assert fast.metrics["completed"] == slow.metrics["completed"]
    assert len(fast.requests) == len(slow.requests)
    for f, s in zip(fast.requests, slow.requests):
        assert f["request_id"] == s["request_id"] and f["state"] == s["state"]
        for key in ("finished_s", "first_token_s"):
            if f[key] is None:
                assert s[key] is None
            else:
                assert math.isclose(f[key], s[key], rel_tol=1e-9, abs_tol=1e-9)
    assert sum(g["decode_runs"] for g in fast.metrics["utilization"]["per_gpu"]) > 0
    assert sum(g["decode_runs"] for g in slow.metrics["utilization"]["per_gpu"]) == 0


def test_unified_homo_fast_path_equals_stepping_on_an_open_loop_mix():
    """The issue's case: a Poisson mix where embeddings arrive while decodes run (before the
    fix, 253 of 395 finish times differed)."""
    raw = {"name": "homo", "seed": 3, "duration_s": 8, "calibration": "a100-40gb",
           "workload": {"pools": [{"kind": "embedding", "process": "poisson", "rate": 20},
                                  {"kind": "generation", "process": "poisson", "rate": 4}],
                        "embedding_input": {"dist": "uniform", "low": 16, "high": 600},
                        "generation_output": {"dist": "uniform", "low": 16, "high": 200}},
           "configurations": ["unified-homo"]}
    scenario = parse_scenario(raw)
    fast = simulate(scenario, "unified-homo")
    slow = simulate(scenario, "unified-homo", fast_forward=False)
    assert [(r["request_id"], r["finished_s"]) for r in fast.requests] == [
        (r["request_id"], r["finished_s"]) for r in slow.requests]
    assert fast.metrics["iterations"] == slow.metrics["iterations"]


@pytest.mark.parametrize("configuration", ["dedicated-0:1", "orthrus"])
def test_decode_runs_through_finishes_equal_stepping(configuration, monkeypatch):
    """Open loop, light load: nothing waits, so runs go on through finishes, phase by phase
    (each request leaving at its own step, ``fill`` skipped), and after a prompt's iteration
    straight into a run; every timestamp and counter equals stepping."""
    from orthrus_sim.sim import replica

    went_on = []
    run_on = replica.run_on

    def recording(policy):
        out = run_on(policy)
        went_on.append(out)
        return out

    monkeypatch.setattr(replica, "run_on", recording)
    raw = {
        "name": "phases", "seed": 5, "calibration": "a100-40gb", "num_requests": 120,
        "embedding": {"lora_rank": None},
        "workload": {"pools": [{"kind": "generation", "process": "poisson", "rate": 3.0}],
                     "generation_prompt": {"dist": "uniform", "low": 16, "high": 600},
                     "generation_output": {"dist": "uniform", "low": 1, "high": 400}},
        "configurations": [configuration],
    }
    scenario = parse_scenario(raw)
    fast = simulate(scenario, configuration, fast_forward=True)
    assert sum(1 for steps in went_on if steps > 1) > 50  # runs went on, fill skipped
    slow = simulate(scenario, configuration, fast_forward=False)
    assert fast.metrics["iterations"] == slow.metrics["iterations"]
    assert fast.metrics["completed"] == slow.metrics["completed"] == {"embedding": 0, "generation": 120}
    for f, s in zip(fast.requests, slow.requests, strict=True):
        assert (f["request_id"], f["finished_s"], f["first_token_s"]) == (
            s["request_id"], s["finished_s"], s["first_token_s"])
    for f, s in zip(fast.metrics["utilization"]["per_gpu"], slow.metrics["utilization"]["per_gpu"]):
        assert f["iterations"] == s["iterations"] and math.isclose(f["busy"], s["busy"], rel_tol=1e-9)
        assert math.isclose(f["mfu"], s["mfu"], rel_tol=1e-9)


def test_arrivals_cut_decode_runs_without_interrupts_and_equal_stepping(monkeypatch):
    """An arrival during a run's segment moves the replica's wait to the end of the step in
    flight (``Replica._cut_run``) instead of interrupting it: no SimPy interrupt is raised,
    each cut saves the interruption and the timeout it would start, and every timestamp still
    equals stepping."""
    import simpy

    from orthrus_sim.sim import replica

    cuts = []
    cut_run = replica.Replica._cut_run

    def recording(self):
        cut_run(self)
        cuts.append(self._cut_steps)

    def no_interrupt(self, cause=None):
        raise AssertionError("a decode run was interrupted")

    monkeypatch.setattr(replica.Replica, "_cut_run", recording)
    monkeypatch.setattr(simpy.events.Process, "interrupt", no_interrupt)
    raw = {"name": "cuts", "seed": 8, "calibration": "a100-40gb", "num_requests": 150,
           "embedding": {"lora_rank": None},
           "workload": {"pools": [{"kind": "generation", "process": "poisson", "rate": 6.0}],
                        "generation_prompt": {"dist": "uniform", "low": 16, "high": 300},
                        "generation_output": {"dist": "uniform", "low": 50, "high": 400}},
           "configurations": ["dedicated-0:1"]}
    scenario = parse_scenario(raw)
    fast = simulate(scenario, "dedicated-0:1")
    assert sum(1 for steps in cuts if steps) > 50  # arrivals cut runs mid-segment
    slow = simulate(scenario, "dedicated-0:1", fast_forward=False)
    assert [(r["request_id"], r["first_token_s"], r["finished_s"]) for r in fast.requests] == [
        (r["request_id"], r["first_token_s"], r["finished_s"]) for r in slow.requests]
    assert fast.metrics["iterations"] == slow.metrics["iterations"]


def test_scenario_errors_name_the_field():
    with pytest.raises(ValueError, match=r"workload\.arrival: .*needs 'rate'"):
        parse_scenario({"name": "x", "duration_s": 1, "workload": {"arrival": {"process": "poisson"}}})
    with pytest.raises(ValueError, match=r"scheduler\.token_budget must be a positive integer"):
        parse_scenario({"name": "x", "duration_s": 1, "scheduler": {"token_budget": 0}})
    with pytest.raises(ValueError, match="hardware: unknown name 'tpu'"):
        parse_scenario({"name": "x", "duration_s": 1, "hardware": "tpu"})
    with pytest.raises(ValueError, match="give duration_s or num_requests"):
        parse_scenario({"name": "x"})
    with pytest.raises(ValueError, match=r"workload\.colour: Extra inputs"):
        parse_scenario({"name": "x", "duration_s": 1, "workload": {"colour": "red"}})
    with pytest.raises(ValueError, match="bidirectional"):
        parse_scenario({"name": "x", "duration_s": 1, "embedding": {"bidirectional": True}})
    with pytest.raises(ValueError, match="cannot import module"):
        parse_scenario({"name": "x", "duration_s": 1, "configurations": ["unified:nope.mod:Cls"]})
    limit = get_model(parse_scenario({"name": "x", "duration_s": 1}).model).max_position_embeddings
    with pytest.raises(ValueError, match=rf"scheduler\.max_model_len \({limit + 1}\) exceeds"):
        parse_scenario({"name": "x", "duration_s": 1, "scheduler": {"max_model_len": limit + 1}})
    assert parse_scenario({"name": "x", "duration_s": 1, "scheduler": {"max_model_len": limit}})


def test_overrides_parse_yaml_values():
    s = parse_scenario(mixed_raw(), overrides=["configurations=[orthrus, unified-homo]",
                                               "scheduler.chunk_size=null", "cluster.gpus=2"])
    assert s.configurations == ["orthrus", "unified-homo"] and s.scheduler.chunk_size is None


def test_cli_run_validate_and_errors(tmp_path):
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(mixed_raw(duration_s=5, configurations=["orthrus", "unified-homo"])))
    runner = CliRunner()
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code == 0, res.output
    assert "is valid" in res.output
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(path), "--out", str(out), "--workers", "1"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == "orthrus.results/1"
    assert [r["configuration"] for r in doc["runs"]] == ["orthrus", "unified-homo"]
    for f in ("requests_orthrus.csv", "timeline_orthrus.csv", "throughput.png", "latency_cdf.png",
              "timeline.png"):
        assert (out / f).stat().st_size > 0
    res = runner.invoke(app, ["run", str(path), "--set", "scheduler.chunk_size=99999"])
    assert res.exit_code == 2 and "chunk_size" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["sweep", str(path), "--grid", "scheduler.chunk_size=256,512",
                              "--out", str(tmp_path / "sw"), "--workers", "1",
                              "--set", "configurations=[orthrus]"])
    assert res.exit_code == 0, res.output
    sweep = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert len(sweep["points"]) == 2


def test_long_decode_runs_priced_in_segments_equal_stepping():
    """Runs over several pricing segments (600-token outputs, nothing arriving) give the
    very results of stepping one iteration at a time."""
    from orthrus_sim.sim.replica import FIRST_RUN_SEGMENT

    raw = burst_scenario("orthrus", 1)
    raw["workload"]["burst"] = [{"kind": "generation", "count": 6}]
    raw["workload"]["generation_output"] = {"dist": "uniform", "low": 300, "high": 600}
    raw["calibration"] = "a100-40gb"
    scenario = parse_scenario(raw)
    fast = simulate(scenario, "orthrus")
    slow = simulate(scenario, "orthrus", fast_forward=False)
    assert max(r["output_tokens"] for r in fast.requests) > 8 * FIRST_RUN_SEGMENT  # 4 segments
    assert fast.metrics["iterations"] == slow.metrics["iterations"]
    assert [r["finished_s"] for r in fast.requests] == [r["finished_s"] for r in slow.requests]
    assert fast.metrics["utilization"]["per_gpu"][0]["decode_runs"] > 0


def test_replica_stats_copy_and_minus_cover_every_field():
    """The monitor copies and subtracts the counters field by field (positional, for speed):
    a field added to ``ReplicaStats`` and left out of ``copy`` or ``minus`` fails here."""
    from dataclasses import fields

    from orthrus_sim.sim.replica import ReplicaStats

    names = [f.name for f in fields(ReplicaStats)]
    later = ReplicaStats(*[10 * (i + 1) for i in range(len(names))])
    earlier = ReplicaStats(*[i + 1 for i in range(len(names))])
    copy = later.copy()
    assert copy == later and copy is not later
    diff = later.minus(earlier)
    assert [getattr(diff, n) for n in names] == [9 * (i + 1) for i in range(len(names))]


@settings(max_examples=300, deadline=None)
@given(now=st.floats(0.0, 1e5), ahead=st.floats(0.0, 10.0))
def test_delay_lands_the_clock_on_the_target_or_just_short_of_it(now, ahead):
    """``_delay_to``: SimPy's clock (``now + delay``) lands exactly on the target when a delay
    can, else on the last float short of it (the fast path returns only exact landings)."""
    from orthrus_sim.sim.replica import _delay_to

    target = now + ahead
    delay = _delay_to(now, target)
    assert now + delay <= target
    assert now + delay == target or now + math.nextafter(delay, math.inf) > target
