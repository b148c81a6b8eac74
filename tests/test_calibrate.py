"""Calibrate + validate smoke test on the tiny model (CI-sized)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from orthrus_real.cli import app  # noqa: E402
from orthrus_sim.costmodel import load_calibration  # noqa: E402
from orthrus_sim.experiment.scenario import parse_scenario  # noqa: E402
from orthrus_sim.sim.run import simulate  # noqa: E402


@pytest.fixture(scope="module")
def calibration(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "tiny.json"
    model = tiny_models["llama"]
    res = CliRunner().invoke(app, ["calibrate", "--model", str(model), "--embedding-adapter",
                                   str(model / "adapter"), "--out", str(out), "--quick",
                                   "--repeats", "1", "--load-seconds", "2"])
    assert res.exit_code == 0, res.output
    return out


def test_calibrate_cpus_are_checked_before_anything_runs(tiny_models, tmp_path):
    model = tiny_models["llama"]
    res = CliRunner().invoke(app, ["calibrate", "--model", str(model), "--out",
                                   str(tmp_path / "c.json"), "--cpus", "999"])
    assert res.exit_code != 0 and "--cpus '999': this machine has CPUs" in res.output
    assert not (tmp_path / "c.json").exists()


def test_calibrate_writes_a_file_the_simulator_accepts(calibration, tiny_models):
    cal = load_calibration(calibration)
    assert cal.hardware == "cpu-2core" and cal.fit_error.points > 20
    assert cal.fit_error.iteration_mape is not None
    assert any(k.startswith("holdout_mape_") for k in cal.fit_error.detail)
    rows = calibration.with_suffix(".csv").read_text().splitlines()
    assert rows[0].startswith("category,point,seconds") and len(rows) == cal.fit_error.points + 1
    scenario = parse_scenario({
        "name": "cpu", "seed": 0, "duration_s": 2, "hardware": "cpu-2core",
        "model": str(tiny_models["llama"]), "calibration": str(calibration),
        "workload": {"arrival": {"process": "closed-loop", "clients": 4}}})
    m = simulate(scenario, "orthrus").metrics
    assert m["completed"]["embedding"] + m["completed"]["generation"] > 0


def test_validate_runs_both_sides(calibration, tiny_models, tmp_path):
    import yaml

    model = tiny_models["llama"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "smoke", "seed": 0, "num_requests": 24,
        "configurations": ["orthrus"],
        "scheduler": {"token_budget": 512, "chunk_size": 128},
        "workload": {"arrival": {"process": "closed-loop", "clients": 4}, "generation_share": 0.5,
                     "embedding_input": {"dist": "fixed", "value": 64},
                     "generation_prompt": {"dist": "fixed", "value": 16},
                     "generation_output": {"dist": "fixed", "value": 8}}}))
    out = tmp_path / "val"
    from orthrus_sim.costmodel import save_calibration

    cal = load_calibration(calibration)  # as if measured elsewhere: validate warns in one line
    elsewhere = tmp_path / "elsewhere.json"
    save_calibration(cal.model_copy(update={"environment": cal.environment.model_copy(
        update={"machine": "Another CPU"})}), elsewhere)
    res = CliRunner().invoke(app, ["validate", str(path), "--model", str(model), "--embedding-adapter",
                                   str(model / "adapter"), "--calibration", str(elsewhere),
                                   "--out", str(out), "--kv-cache-tokens", "8192"])
    assert res.exit_code == 0, res.output
    assert "warning: calibration elsewhere.json was measured on another machine" in \
        " ".join(res.output.split())
    rows = json.loads((out / "comparison.json").read_text())
    tput = next(r for r in rows if r["metric"] == "throughput_rps.combined")
    assert tput["simulated"] > 0 and tput["measured"] > 0 and tput["relative_error"] is not None
    for side in ("simulated", "measured"):
        doc = json.loads((out / side / "results.json").read_text())
        assert doc["schema"] == "orthrus.results/1"
        assert doc["scenario"]["hardware"] == "cpu-2core"


def test_validate_refuses_disagg_pd(calibration, tiny_models, tmp_path):
    """Dedicated splits run on a cluster of replicas (tests/test_cluster.py); Disagg-PD would
    need KV transfer between engines."""
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "duration_s": 1, "configurations": ["disagg-pd-1:1"],
                                    "cluster": {"gpus": 2}}))
    res = CliRunner().invoke(app, ["validate", str(path), "--model", str(tiny_models["llama"]),
                                   "--calibration", str(calibration)])
    assert res.exit_code == 2 and "KV transfer between engines is not built" in res.output


def test_calibration_records_its_machine_and_validate_bench_warn_elsewhere(calibration, tiny_models,
                                                                           tmp_path):
    from orthrus_real.engine.device import environment_check
    from orthrus_sim.costmodel import save_calibration
    from orthrus_sim.costmodel.machine import this_machine

    cal = load_calibration(calibration)
    here = this_machine()
    env = cal.environment
    assert env.machine == here["machine"] and env.cpu_flags == here["cpu_flags"]
    assert env.dtype in ("float32", "bfloat16") and env.engine == "torch"
    assert env.engine_version.startswith("torch ")
    model = str(tiny_models["llama"])
    assert environment_check(str(calibration), model) is None  # the same machine, the same dtype
    other = tmp_path / "other.json"
    save_calibration(cal.model_copy(update={"environment": env.model_copy(update={
        "machine": "Some Other CPU", "dtype": "float16"})}), other)
    line = environment_check(str(other), model)
    assert line and "Some Other CPU" in line and "dtype float16 there" in line
    # the engine's threads: a two-core profile does not price a one-core engine
    assert environment_check(str(calibration), model, threads=env.threads) is None
    line = environment_check(str(calibration), model, threads=(env.threads or 1) + 1)
    assert line and f"{env.threads} engine thread(s) there, {(env.threads or 1) + 1} here" in line
    # validate and bench say it in one line
    res = CliRunner().invoke(app, ["validate", str(tmp_path / "missing.yaml"), "--model", model,
                                   "--calibration", str(other)])
    assert res.exit_code != 0  # the scenario is checked first
    res = CliRunner().invoke(app, ["bench", "quickstart", "--url", "http://127.0.0.1:9",
                                   "--calibration", str(other), "--set", "duration_s=2",
                                   "--set", "warmup_s=0", "--out", str(tmp_path / "b")])
    assert "warning:" in res.output and "Some Other CPU" in res.output
    assert res.exit_code == 1  # nothing listens there


def test_profiled_rows_are_categorised_by_what_the_batch_carried():
    from orthrus_real.measure.calibrate import _category
    from orthrus_sim.costmodel.shape import BatchShape
    from orthrus_sim.engine.batch import ItemKind

    def shape(*items) -> BatchShape:
        s = BatchShape()
        for kind, n, ctx in items:
            s.add_item(kind, n, ctx)
        return s

    emb = (ItemKind.EMBED_CHUNK, 128, 0)
    pre = (ItemKind.PREFILL_CHUNK, 64, 0)
    dec = (ItemKind.DECODE, 1, 200)
    assert _category(shape(emb, emb), "embedding") == "embedding"
    assert _category(shape(dec, dec), "decode") == "decode"
    assert _category(shape(pre, dec), "prefill") == "mixed"
    assert _category(shape(emb, dec), "embedding") == "mixed"
    assert _category(shape(pre), "mixed") == "prefill"  # a mixed point that ran no decodes
    assert _category(shape(emb, pre), "prefill") == "prefill"
    assert _category(shape(dec), "load") == "load"


def test_calibrate_colocated_checks_its_arguments_before_anything_runs(tiny_models, tmp_path):
    model, out = str(tiny_models["llama"]), tmp_path / "c.json"
    for extra, says in ((["--colocated", "0"], "--colocated must be >= 1"),
                        (["--colocated", "2", "--devices", "cpu:0,cpu:1", "--cpus", "0"],
                         "give --devices (one per engine) or --cpus"),
                        (["--colocated", "3", "--devices", "cpu:0,cpu:1"],
                         "names 2 devices for --replicas 3")):
        res = CliRunner().invoke(app, ["calibrate", "--model", model, "--out", str(out), *extra])
        assert res.exit_code != 0 and says in " ".join(res.output.split()), res.output
    assert not out.exists()


def _serving(model_dir) -> list[int]:
    """Pids of ``orthrus-real serve`` processes of this model (a neighbour left behind)."""
    from pathlib import Path

    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and str(model_dir).encode() in cmd:
            pids.append(int(proc.name))
    return pids


# slow stage: a calibration beside a serving neighbour (half a minute); its arguments are checked in
# the fast stage
@pytest.mark.slow
def test_calibrate_colocated_profiles_beside_a_serving_neighbour(tiny_models, tmp_path):
    """``--colocated 2``: a second engine of the same arrangement serves a mixed load through
    the whole grid (it ran iterations meanwhile), then the serving load runs on a cluster of
    both behind the gateway and every replica's iterations are rows of the fit; the calibration
    records all of it, and no engine or gateway is left afterwards."""
    import csv

    model, out = tiny_models["llama"], tmp_path / "co.json"
    res = CliRunner().invoke(app, ["calibrate", "--model", str(model), "--out", str(out),
                                   "--quick", "--repeats", "1", "--load-seconds", "3",
                                   "--colocated", "2", "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "starting 1 neighbour engine(s) on cpu, each under a mixed load" in res.output
    cal = load_calibration(out)
    env = cal.environment
    assert env.colocated == 2 and env.neighbour_devices == ["cpu"] and env.threads == 1
    assert len(env.neighbour_iterations) == 1 and env.neighbour_iterations[0] > 10
    # both replicas of the served load iterated, and each of their iterations is a row
    assert len(env.served_iterations) == 2 and min(env.served_iterations) > 10
    with out.with_suffix(".csv").open() as fh:
        categories = [row["category"] for row in csv.DictReader(fh)]
    assert categories.count("load") == sum(env.served_iterations)
    assert categories.count("decode") > 0  # the grid's rows are there too
    assert "measured beside 1 other engine(s)" in cal.source.description
    assert "the serving load run by a cluster of 2 replicas" in cal.source.description
    assert _serving(model) == []
    # a cluster of two CPU replicas predicted with it: no warning; with a lone profile: one
    from orthrus_real.engine.device import environment_check

    assert environment_check(str(out), str(model), threads=1, colocated=2) is None
    alone = out.with_name("alone.json")
    from orthrus_sim.costmodel import save_calibration

    save_calibration(cal.model_copy(update={"environment": env.model_copy(
        update={"colocated": None})}), alone)
    line = environment_check(str(alone), str(model), threads=1, colocated=2)
    assert line and "measured with 1 engine(s) on its machine and 2 will share this one" in line
    assert "calibrate --colocated 2" in line


def test_a_neighbour_that_stops_fails_the_colocated_profile(tmp_path):
    """A neighbour whose engine exited, or whose load stopped, did not load the machine
    through the profile: the calibration says so instead of recording it as co-located."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from orthrus_real.measure.colocated import Neighbours, neighbour_load
    from orthrus_sim.experiment.scenario import parse_scenario

    sc = parse_scenario(neighbour_load(1))
    assert sc.workload.generation_share == 0.5 and sc.workload.arrival.process == "closed-loop"
    near = Neighbours.__new__(Neighbours)
    near.replicas = [SimpleNamespace(index=1, exited=lambda: 3, spec=SimpleNamespace(device="cpu:1"))]
    near.loads = []
    with pytest.raises(RuntimeError, match=r"neighbour replica 1 \(on cpu:1\) exited with code 3"):
        near.check()
    log = tmp_path / "load.log"
    with log.open("wb") as fh:
        load = subprocess.Popen([sys.executable, "-c", "import sys; print('starting'); "
                                 "sys.exit('no route to the neighbour')"], stdout=fh,
                                stderr=subprocess.STDOUT)
    load.wait()
    near.replicas = [SimpleNamespace(index=1, exited=lambda: None)]
    near.loads = [(load, log)]
    with pytest.raises(RuntimeError, match=r"the load on neighbour replica 1 stopped \(exit 1\)"
                                           r".*: no route to the neighbour$"):
        near.check()
