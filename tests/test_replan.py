"""The re-planning split (``dedicated-replan``): GPUs change role as the mix moves, each change
costing ``cluster.role_change_s``, and no request is lost on the way."""

from __future__ import annotations

import pytest

from orthrus_sim.experiment.scenario import load_scenario, parse_scenario
from orthrus_sim.routing.replan import nominal_demand
from orthrus_sim.sim.run import simulate

# the phased mix (90 %, 50 %, 10 % generations) with phases long enough for a minute's change
LONG = [f"workload.phases.{i}.requests=12000" for i in range(3)]


def test_replanning_split_follows_the_phases_and_loses_nothing():
    sc = load_scenario("scenarios/phased.yaml", LONG + ["configurations=[dedicated-replan]"])
    assert sc.cluster.role_change_s == 60.0
    frozen = simulate(sc, "dedicated-1:3").metrics
    moving = simulate(sc, "dedicated-replan")
    m = moving.metrics
    changes = m["placement"]["role_changes"]
    done = [c for c in changes if c["role"] in ("embedding", "generation")]
    assert done, "no GPU changed role"
    asked = [c for c in changes if c["role"].startswith("draining")]
    # a change: asked for, drained, then a minute serving nothing before the new role
    assert done[0]["time_s"] - asked[0]["time_s"] >= 60.0
    # the same 36,000 requests, served sooner than by the split frozen at the planner's pick
    assert m["placement"]["plans"][0]["assignment"] != "1:3"
    assert sum(m["completed"].values()) == sum(frozen["completed"].values()) == 36_000
    assert m["sim_end_s"] < frozen["sim_end_s"]
    for kind in ("embedding", "generation"):
        assert m["issued"][kind] == m["completed"][kind] + m["rejected"][kind] \
            + m["unfinished"][kind]
    assert {r["state"] for r in moving.requests} <= {"finished", "rejected", "unfinished"}


def test_a_change_under_way_still_ends_every_request():
    """Cut the run while GPUs drain and pause: their requests end finished or unfinished."""
    sc = load_scenario("scenarios/phased.yaml", ["configurations=[dedicated-replan]",
                                                  "cluster.role_change_s=30",
                                                  "max_sim_time_s=150"])
    result = simulate(sc, "dedicated-replan")
    m = result.metrics
    assert any(c["role"].startswith("draining") for c in m["placement"]["role_changes"])
    for kind in ("embedding", "generation"):
        assert m["issued"][kind] == m["completed"][kind] + m["rejected"][kind] \
            + m["unfinished"][kind]


def test_initial_split_from_the_nominal_demand():
    raw = {"name": "r", "duration_s": 10, "cluster": {"gpus": 4},
           "configurations": ["dedicated-replan"],
           "workload": {"pools": [{"kind": "embedding", "process": "poisson", "rate": 20.0},
                                  {"kind": "generation", "process": "mmpp", "rate": 8.0,
                                   "on_s": 5, "off_s": 5}], "rate_scale": 2.0}}
    d = nominal_demand(parse_scenario(raw))
    assert (d.embedding_rps, d.generation_rps) == pytest.approx((40.0, 8.0))
    assert not d.closed_loop
    result = simulate(parse_scenario(raw), "dedicated-replan")
    roles = [g["role"] for g in result.metrics["utilization"]["per_gpu"]]
    assert roles.count("embedding") >= 1 and roles.count("generation") >= 1
    with pytest.raises(ValueError, match="unknown configuration 'dedicated-replan-2'"):
        parse_scenario(raw | {"configurations": ["dedicated-replan-2"]})


def poisson_pair(gpus: int, configuration: str) -> dict:
    """20 s of 5 embeddings/s and 1 generation/s on ``gpus`` GPUs."""
    return {"name": "r", "duration_s": 20, "cluster": {"gpus": gpus},
            "configurations": [configuration],
            "workload": {"pools": [{"kind": "embedding", "process": "poisson", "rate": 5.0},
                                   {"kind": "generation", "process": "poisson", "rate": 1.0}]}}


def test_a_named_start_is_where_the_split_begins():
    raw = poisson_pair(4, "dedicated-replan-3:1")
    result = simulate(parse_scenario(raw), "dedicated-replan-3:1")
    roles = [g["role"] for g in result.metrics["utilization"]["per_gpu"]]
    assert roles == ["embedding"] * 3 + ["generation"]
    with pytest.raises(ValueError, match="'dedicated-replan-3:2' uses 5 GPUs but cluster.gpus is 4"):
        parse_scenario(raw | {"configurations": ["dedicated-replan-3:2"]})


def test_a_split_that_cannot_serve_both_kinds_is_refused():
    """One GPU, or a start with a side empty, would refuse one kind for the whole run."""
    with pytest.raises(ValueError, match="'dedicated-replan' needs at least 2 GPUs"):
        simulate(parse_scenario(poisson_pair(1, "dedicated-replan")), "dedicated-replan")
    for start in ("4:0", "0:4"):
        name = f"dedicated-replan-{start}"
        with pytest.raises(ValueError, match=f"'{name}' needs at least one embedding and one "
                                             "generation GPU"):
            simulate(parse_scenario(poisson_pair(4, name)), name)
