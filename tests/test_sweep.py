"""Sweeps: one task per point on local processes or Ray, the same numbers either way, resumed
from what ``--out`` holds, failed points reported while the others go on."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from orthrus_sim.cli import app
from orthrus_sim.questions import sweep as sweep_mod
from orthrus_sim.questions.sweep import Point, plan_sweep, point_runner, run_local, run_ray, run_sweep

runner = CliRunner()


def small() -> dict:
    return {"name": "small", "seed": 1, "duration_s": 2, "cluster": {"gpus": 1},
            "calibration": "a100-40gb",
            "workload": {"pools": [{"kind": "embedding", "process": "poisson", "rate": 20},
                                   {"kind": "generation", "process": "poisson", "rate": 2}],
                         "generation_output": {"dist": "fixed", "value": 16}},
            "configurations": ["orthrus", "unified-homo"]}


GRID = ["seed=1,2", "scheduler.chunk_size=128,512"]


def numbers(doc: dict) -> list:
    """Every point's metrics, less the wall time (the one figure that may differ)."""
    out = []
    for p in doc["points"]:
        for run in p["runs"]:
            m = dict(run["metrics"])
            m.pop("sim_wall_s")
            out.append((p["overrides"], run["configuration"], json.dumps(m, sort_keys=True)))
    return out


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance of 2 CPUs for the module (run_ray uses it, and leaves it up)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_ray_sweep_gives_the_numbers_of_a_local_one(local_ray, tmp_path):
    local = run_sweep(small(), [], GRID, tmp_path / "local", max_parallel=1)
    on_ray = run_sweep(small(), [], GRID, tmp_path / "ray", max_parallel=2, ray="local")
    assert len(local["points"]) == 4 and not local["failed"] and not on_ray["failed"]
    assert numbers(on_ray) == numbers(local)
    for p in on_ray["points"]:  # each point's results.json, as `orthrus-sim run` writes it
        doc = json.loads((tmp_path / "ray" / "points" / p["name"] / "results.json").read_text())
        assert doc["schema"] == "orthrus.results/1" and doc["overrides"] == p["overrides"]
        assert [r["configuration"] for r in doc["runs"]] == ["orthrus", "unified-homo"]


def test_ray_reports_a_failed_point_and_runs_the_others(local_ray):
    _, _, points = plan_sweep(small(), [], ["seed=1,2"])
    broken = Point("point-bad", {"seed": "x"}, {**points[0].scenario, "seed": "not a number"})
    outcomes = {o.point.name: o for o in run_ray([broken, *points], 2, "local")}
    assert set(outcomes) == {"point-bad", "point-0000", "point-0001"}
    assert "seed" in outcomes["point-bad"].error and outcomes["point-bad"].doc is None
    assert all(outcomes[p.name].doc["runs"] for p in points)


def test_point_runner_on_ray_runs_rounds_in_one_session(local_ray):
    """What a search runs round after round (orthrus_sim.questions.capacity) on one Ray session gives
    the numbers of a local run."""
    _, _, points = plan_sweep(small(), [], GRID)

    def numbers(outcomes):
        return sorted(numbers_of_doc(o.point.name, o.doc) for o in outcomes)

    expected = numbers(run_local(points, 1))
    with point_runner(2, "local") as run:
        got = numbers(run(points[:2])) + numbers(run(points[2:]))
    assert sorted(got) == expected


def numbers_of_doc(name: str, doc: dict) -> tuple:
    runs = []
    for run in doc["runs"]:
        m = dict(run["metrics"])
        m.pop("sim_wall_s")
        runs.append((run["configuration"], json.dumps(m, sort_keys=True)))
    return name, runs


def test_an_interrupted_sweep_resumes_and_runs_only_what_is_missing(tmp_path, monkeypatch):
    out = tmp_path / "sw"
    first = run_sweep(small(), [], GRID, out, max_parallel=1)
    (out / "points" / "point-0002" / "results.json").unlink()  # as if stopped before it ended
    ran = []
    real = sweep_mod.run_point

    def counting(point):
        ran.append(point.name)
        return real(point)

    monkeypatch.setattr(sweep_mod, "run_point", counting)
    again = run_sweep(small(), [], GRID, out, max_parallel=1)
    assert ran == ["point-0002"]
    assert numbers(again) == numbers(first)
    with pytest.raises(ValueError, match="holds results of a different sweep"):
        run_sweep(small(), ["duration_s=3"], GRID, out, max_parallel=1)


def test_a_failed_point_is_reported_the_others_go_on_and_a_rerun_retries_it(tmp_path, monkeypatch):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(small()))
    real = sweep_mod.run_point

    def flaky(point):
        if point.overrides == {"seed": "2"}:
            raise RuntimeError("worker lost")
        return real(point)

    monkeypatch.setattr(sweep_mod, "run_point", flaky)
    out = tmp_path / "sw"
    args = ["sweep", str(path), "--grid", "seed=1,2,3", "--out", str(out), "--max-parallel", "1"]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    assert "RuntimeError: worker lost" in res.output and "1 of 3 points failed" in res.output
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["failed"] == [{"name": "point-0001", "overrides": {"seed": "2"},
                              "error": "RuntimeError: worker lost"}]
    assert [bool(p["runs"]) for p in doc["points"]] == [True, False, True]
    monkeypatch.setattr(sweep_mod, "run_point", real)
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "2 of 3 points already in" in res.output
    doc = json.loads((out / "sweep.json").read_text())
    assert not doc["failed"] and all(p["runs"] for p in doc["points"])
    assert not (out / "points" / "point-0001" / "error.json").exists()


def test_sweep_flags_are_checked(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(small()))
    res = runner.invoke(app, ["sweep", str(path), "--grid", "seed=1", "--ray", "cluster"])
    assert res.exit_code == 2 and "--ray must be auto or local" in res.output
    res = runner.invoke(app, ["sweep", str(path), "--grid", "seed=1", "--max-parallel", "-1"])
    assert res.exit_code == 2 and "--max-parallel must be >= 0" in res.output
