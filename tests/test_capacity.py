"""Capacity search: its answers against direct simulations, and its refusals."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from orthrus_sim.cli import app
from orthrus_sim.experiment.scenario import parse_scenario
from orthrus_sim.questions.capacity import (
    Bracket,
    family_members,
    grid_steps,
    open_loop_load,
    scaled_scenario,
)
from orthrus_sim.questions.sweep import Point, point_runner, run_local
from orthrus_sim.sim.run import simulate

runner = CliRunner()
REQUIRED = 0.95


def tiny(**extra) -> dict:
    raw = {"name": "tiny-capacity", "seed": 2, "duration_s": 12, "warmup_s": 2,
           "calibration": "a100-40gb", "cluster": {"gpus": 2},
           "scheduler": {"token_budget": 1024, "chunk_size": 256},
           "slo": {"ttft_s": 0.5, "tpot_s": 0.05, "latency_s": 0.2},
           "workload": {"pools": [{"kind": "embedding", "process": "poisson", "rate": 20},
                                  {"kind": "generation", "process": "poisson", "rate": 2}],
                        "embedding_input": {"dist": "fixed", "value": 256},
                        "generation_prompt": {"dist": "fixed", "value": 128},
                        "generation_output": {"dist": "fixed", "value": 16}},
           "configurations": ["orthrus", "dedicated-1:1"]}
    raw.update(extra)
    return raw


def passes_directly(raw: dict, configuration: str, gpus: int, emb_rps: float, gen_rps: float) -> bool:
    """Simulate the scenario written out by hand at these rates: every kind's attainment
    reaches REQUIRED."""
    raw = dict(raw, cluster={"gpus": gpus}, configurations=[configuration])
    raw["workload"] = dict(raw["workload"], pools=[
        {"kind": "embedding", "process": "poisson", "rate": emb_rps},
        {"kind": "generation", "process": "poisson", "rate": gen_rps}])
    slo = simulate(parse_scenario(raw), configuration).metrics["slo"]
    return all(slo[k]["attainment"] >= REQUIRED for k in ("embedding", "generation"))


def test_answers_match_direct_simulations(tmp_path):
    """The rate returned meets the SLOs and one step higher does not; the GPUs returned serve
    the demand and one fewer do not (each checked by simulating the scenario directly)."""
    raw = tiny()
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    res = runner.invoke(app, ["capacity", str(path), "--attainment", str(REQUIRED),
                              "--tolerance", "0.1", "--demand", "embedding=60,generation=6",
                              "--max-gpus", "4", "--workers", "1", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "out" / "capacity.json").read_text())
    assert doc["schema"] == "orthrus.capacity/1" and (tmp_path / "out" / "capacity.png").exists()
    assert "highest rate within the SLOs" in res.output
    for r in doc["rate_search"]:
        assert r["bound"] == "found"
        rate, step = r["max_rate_rps"], r["next_rate_rps"]
        assert 0 < rate < step <= rate * 1.1 + 1e-9
        share = 2 / 22  # the mix is kept: 20 embeddings to 2 generations
        assert r["max_rate_rps_by_kind"]["generation"] == pytest.approx(rate * share)
        assert passes_directly(raw, r["configuration"], 2, rate * (1 - share), rate * share)
        assert not passes_directly(raw, r["configuration"], 2, step * (1 - share), step * share)
    families = {f["family"]: f for f in doc["gpu_search"]["families"]}
    assert set(families) == {"orthrus", "dedicated"}
    for fam, f in families.items():
        g = f["gpus_needed"]
        assert g is not None and passes_directly(raw, f["configuration"], g, 60, 6)
        assert (f["configuration"] == "orthrus") == (fam == "orthrus")
        if g > 1:
            assert not any(passes_directly(raw, cfg, g - 1, 60, 6)
                           for cfg in family_members(fam, g - 1, {"embedding": 60, "generation": 6}))


def test_scaling_keeps_the_mix_and_the_rest_of_the_scenario():
    sc = parse_scenario(tiny(workload={"arrival": {"process": "gamma", "rate": 10, "cv": 2.0},
                                       "generation_share": 0.3}))
    load = open_loop_load(sc)
    assert load.rates == pytest.approx({"embedding": 7.0, "generation": 3.0})
    from orthrus_sim.experiment.scenario import scenario_dump

    data = scaled_scenario(scenario_dump(sc), load, {"embedding": 2.5, "generation": 2.5},
                           "orthrus", 3)
    again = parse_scenario(data)
    (pool,) = again.workload.pools
    assert (pool.process, pool.rate, pool.cv, pool.kind) == ("gamma", 25.0, 2.0, "mixed")
    assert again.cluster.gpus == 3 and again.configurations == ["orthrus"]
    assert again.slo == sc.slo and again.workload.generation_share == 0.3
    with pytest.raises(ValueError, match="mixed pool keeps its mix"):
        scaled_scenario(scenario_dump(sc), load, {"embedding": 1.0, "generation": 2.0}, "orthrus", 1)


@pytest.mark.parametrize("extra, words", [
    ({"slo": None}, "no slo section"),
    ({"slo": {"latency_s": 0.2}}, "generation requests but slo gives no bound"),
    ({"workload": {"arrival": {"process": "closed-loop", "clients": 4}}}, "pool 0 is 'closed-loop'"),
    ({"workload": {"arrival": {"process": "poisson", "rate": 5}, "phases": [
        {"duration_s": 5, "generation_share": 0.1}, {"duration_s": 7, "generation_share": 0.9}]}},
     "stationary mix"),
])
def test_refuses_what_it_cannot_search(tmp_path, extra, words):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tiny(**extra)))
    res = runner.invoke(app, ["capacity", str(path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and words in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args, words", [
    (["--demand", "embedding=5,gen=2"], "expected embedding=R,generation=R"),
    (["--demand", "embedding=lots"], "'lots' is not a number"),
    (["--attainment", "1.5"], "--attainment must be in (0, 1]"),
    (["--max-gpus", "-1"], "--max-gpus must be >= 0"),
])
def test_bad_options_are_named(tmp_path, args, words):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(tiny(workload={
        "pools": [{"kind": "embedding", "process": "poisson", "rate": 5}]}, slo={"latency_s": 1})))
    res = runner.invoke(app, ["capacity", str(path), "--out", str(tmp_path / "o"), *args])
    assert res.exit_code == 2 and words in res.output, res.output
    res = runner.invoke(app, ["capacity", str(path), "--out", str(tmp_path / "o"),
                              "--demand", "generation=3"])
    assert res.exit_code == 2 and "sends no generation requests" in res.output


def test_point_runner_keeps_one_pool_for_several_rounds():
    """The backend a search runs its rounds on gives what a plain local run gives."""
    sc = parse_scenario(tiny(duration_s=4))
    from orthrus_sim.experiment.scenario import scenario_dump

    load = open_loop_load(sc)
    points = [Point(f"p{i}", {"i": str(i)},
                    scaled_scenario(scenario_dump(sc), load, {"embedding": f, "generation": f},
                                    "orthrus", 1)) for i, f in enumerate((0.5, 1.0, 1.5))]

    def numbers(outcomes):
        out = {}
        for o in outcomes:
            m = dict(o.doc["runs"][0]["metrics"])
            m.pop("sim_wall_s")
            out[o.point.name] = json.dumps(m, sort_keys=True)
        return out

    expected = numbers(run_local(points, 1))
    with point_runner(2) as run:
        assert numbers(run(points[:2])) == {k: expected[k] for k in ("p0", "p1")}
        assert numbers(run(points[2:])) == {"p2": expected["p2"]}


@settings(max_examples=200, deadline=None)
@given(threshold=st.floats(2.0 ** -9, 2.0 ** 9), tolerance=st.sampled_from([0.02, 0.05, 0.1, 0.3]),
       workers=st.integers(1, 6))
def test_rate_grid_answer_does_not_depend_on_how_the_bracket_is_split(threshold, tolerance, workers):
    """With attainment falling as the rate rises (pass below a threshold), the answer is the
    highest grid rate at or under the threshold, the next grid rate fails and is at most
    ``tolerance`` higher, whatever the number of points tried per round: two configurations
    with the same capacity get the same answer."""
    steps = grid_steps(tolerance)
    b = Bracket("c", steps)
    rounds = 0
    while not b.done():
        rounds += 1
        wanted = b.next(workers)
        assert wanted and not set(wanted) & set(b.tried)  # progress, nothing tried twice
        for i in wanted:
            b.tried[i] = b.factor(i) <= threshold
    expect = math.floor(math.log2(threshold) * steps)
    while b.factor(expect + 1) <= threshold:  # the floats' edges of the floor
        expect += 1
    while b.factor(expect) > threshold:
        expect -= 1
    assert b.lo == expect and b.hi == expect + 1
    assert b.factor(b.lo) <= threshold < b.factor(b.hi) <= b.factor(b.lo) * (1 + tolerance) + 1e-12
    assert rounds <= 40
