"""orthrus-sim fit: cost factors recovered from a simulated ground truth, a hand-written minimal
measured file, undetermined parameters, and the calibration-provenance warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orthrus_sim.cli import app
from orthrus_sim.costmodel import load_calibration, save_calibration
from orthrus_sim.costmodel.calibration import CostFactorsModel, EnvironmentModel
from orthrus_sim.costmodel.factors import CostFactors, FactoredCostModel
from orthrus_sim.costmodel.machine import environment_warning, this_machine
from orthrus_sim.experiment.measured import load_measured, only_kind
from orthrus_sim.experiment.scenario import parse_scenario
from orthrus_sim.questions.fit import fit
from orthrus_sim.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
PRIOR = ROOT / "calibration" / "cpu-2core-small.json"


def scenario_raw(calibration: Path = PRIOR, gen_clients: int = 4) -> dict:
    return {
        "name": "fit-test", "seed": 3, "duration_s": 12, "warmup_s": 3,
        "hardware": "cpu-2core", "model": "orthrus-small", "calibration": str(calibration),
        "cluster": {"gpus": 2},
        "scheduler": {"token_budget": 2048, "chunk_size": 512, "max_num_seqs": 64},
        "workload": {
            "pools": [{"kind": "embedding", "process": "closed-loop", "clients": 4},
                      {"kind": "generation", "process": "closed-loop", "clients": gen_clients}],
            "embedding_input": {"dist": "uniform", "low": 64, "high": 256},
            "generation_prompt": {"dist": "fixed", "value": 128},
            "generation_output": {"dist": "uniform", "low": 16, "high": 64}},
        "configurations": ["dedicated-1:1"],
    }


def with_factors(tmp_path: Path, **factors) -> Path:
    cal = load_calibration(PRIOR)
    path = tmp_path / "truth.json"
    save_calibration(cal.model_copy(update={"factors": CostFactorsModel(**factors)}), path)
    return path


def test_neutral_factors_leave_the_cost_model_alone():
    from orthrus_sim.costmodel import CostModel, LoRASpec, get_hardware, get_model
    from orthrus_sim.costmodel.shape import BatchShape

    base = CostModel(get_hardware("cpu-2core"), get_model("orthrus-small"), lora=LoRASpec(16))
    wrapped = FactoredCostModel(base, CostFactors())
    shape = BatchShape.from_items([(0, 200, 0), (1, 128, 0, True)]
                                  + [(2, 1, 100)] * 8)
    assert wrapped.shape_time(shape) == pytest.approx(base.shape_time(shape), rel=1e-9)
    serial = FactoredCostModel(base, CostFactors(overlap=0.0)).shape_time(shape)
    assert serial > base.shape_time(shape)  # no co-batching gain: the parts add up
    decode = BatchShape.from_items([(2, 1, 100)] * 8)
    assert FactoredCostModel(base, CostFactors(decode_scale=2.0)).shape_time(decode) == \
        pytest.approx(2 * base.shape_time(decode))
    with pytest.raises(ValueError, match="embedding_scale"):
        CostFactors(embedding_scale=0.0)


def test_overheads_occupy_the_server_not_the_device(tmp_path):
    base = simulate(parse_scenario(scenario_raw()), "dedicated-1:1").metrics
    slow = with_factors(tmp_path, embedding_overhead_s=0.2)
    m = simulate(parse_scenario(scenario_raw(slow)), "dedicated-1:1").metrics
    # one request at a time through a 0.2 s front end: at most 5 embeddings/s
    assert m["throughput_rps"]["embedding"] <= 5.0 + 0.2 < base["throughput_rps"]["embedding"]
    # the generation replica is untouched (up to the order of same-instant events at its front end)
    assert m["throughput_rps"]["generation"] == pytest.approx(base["throughput_rps"]["generation"],
                                                              rel=0.05)


# slow stage: a five-parameter fit at length; the fast stage recovers smaller fits (decode cost, a
# minimal file)
@pytest.mark.slow
def test_fit_recovers_a_simulated_ground_truth(tmp_path):
    truth = {"embedding_scale": 1.6, "prefill_scale": 0.8, "decode_scale": 1.3}
    raw = scenario_raw(with_factors(tmp_path, **truth))
    measured = simulate(parse_scenario(raw), "dedicated-1:1").metrics
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"schema": "orthrus.results/1",
                                "runs": [{"configuration": "dedicated-1:1", "metrics": measured}]}))
    result = fit(parse_scenario(scenario_raw()), load_measured([path]))
    for name, value in truth.items():
        assert result.parameters[name]["status"] == "fitted"
        assert result.parameters[name]["value"] == pytest.approx(value, rel=0.05), name
    cal = result.calibration
    assert cal.factor_fit.measured == [str(path)] and cal.factor_fit.residuals
    assert cal.coefficients == load_calibration(PRIOR).coefficients  # the prior, scaled
    out = tmp_path / "fitted.json"
    save_calibration(cal, out)
    again = simulate(parse_scenario(scenario_raw(out)), "dedicated-1:1").metrics
    assert again["throughput_rps"]["embedding"] == pytest.approx(
        measured["throughput_rps"]["embedding"], rel=0.05)


def test_fit_recovers_the_decode_cost_from_a_generation_servers_steps(tmp_path):
    """A saturated generation server's steps per second pin its iteration time: the decode
    scale comes back from them alone (a bench of stock vLLM reports its steps, not its
    per-iteration times)."""
    raw = scenario_raw(with_factors(tmp_path, decode_scale=1.5))
    truth = simulate(parse_scenario(raw), "dedicated-1:1").metrics
    (row,) = [g for g in truth["utilization"]["per_gpu"] if g["role"] == "generation"]
    one_server = {"throughput_rps": {"generation": truth["throughput_rps"]["generation"]},
                  "iterations": row["iterations"], "window_s": truth["window_s"]}
    path = tmp_path / "gen.json"
    path.write_text(json.dumps({"runs": [{"configuration": "dedicated-1:1", "metrics": one_server}]}))
    (run,) = load_measured([path], ["iterations_per_s"])
    window = truth["window_s"][1] - truth["window_s"][0]
    assert run.kind == "generation"  # from its throughput, though only its steps are fitted
    assert run.metrics == {"iterations_per_s": pytest.approx(row["iterations"] / window)}
    result = fit(parse_scenario(scenario_raw()), [run])
    assert result.parameters["decode_scale"]["status"] == "fitted"
    assert result.parameters["decode_scale"]["value"] == pytest.approx(1.5, rel=0.05)
    # the embedding replica's steps are not the generation server's
    assert result.parameters["embedding_scale"]["status"] == "undetermined"


def test_steps_per_second_from_a_results_file_or_written_by_hand(tmp_path):
    path = tmp_path / "m.json"
    for metrics, rate in [({"iterations": 90, "window_s": [10.0, 40.0]}, 3.0),
                          ({"iterations_per_s": 2.5}, 2.5),
                          ({"iterations": 0, "window_s": [10.0, 40.0],  # no step count exposed
                            "throughput_rps": {"generation": 1.0}}, None)]:
        path.write_text(json.dumps({"runs": [{"configuration": "orthrus", "metrics": metrics}]}))
        (run,) = load_measured([path])
        assert run.metrics.get("iterations_per_s") == rate
    path.write_text(json.dumps({"runs": [{"configuration": "orthrus", "metrics": {
        "iterations": 9, "window_s": "the last 30 s"}}]}))
    with pytest.raises(ValueError, match=r"metrics.window_s: expected \[start, end\]"):
        load_measured([path])


MINIMAL = """\
# a published table's figures: one dedicated embedding server
schema: orthrus.results/1
runs:
  - configuration: dedicated-1:1
    metrics:
      throughput_rps: {embedding: 9.0}
      latency_s: {embedding: {p50: 0.45}}
"""


def test_hand_written_minimal_file_fits_and_reports_undetermined(tmp_path):
    path = tmp_path / "published.yaml"
    path.write_text(MINIMAL)
    res = CliRunner().invoke(app, ["fit", str(tmp_path / "sc.yaml"), "--measured", str(path),
                                   "--out", str(tmp_path / "cal.json"), "--workers", "1"])
    assert res.exit_code != 0 and "does not exist" in res.output
    (tmp_path / "sc.yaml").write_text(json.dumps(scenario_raw()))
    res = CliRunner().invoke(app, ["fit", str(tmp_path / "sc.yaml"), "--measured", str(path),
                                   "--out", str(tmp_path / "cal.json"), "--workers", "1",
                                   "--format", "json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[:res.output.rindex("}") + 1])
    params = report["parameters"]
    assert params["embedding_scale"]["status"] == "fitted"
    # nothing measured about generation: its factors are not fitted to noise
    for name in ("prefill_scale", "decode_scale", "generation_overhead_s", "overlap"):
        assert params[name]["status"] == "undetermined", name
        assert params[name]["value"] == params[name]["prior"]
        assert params[name]["sensitivity"] == 0.0
    resid = {r["metric"]: r["residual"] for r in report["residuals"]}
    assert abs(resid["throughput_rps.embedding"]) < 0.05
    cal = load_calibration(tmp_path / "cal.json")
    assert cal.factors.embedding_scale == pytest.approx(params["embedding_scale"]["value"])
    assert cal.factor_fit.parameters["decode_scale"].status == "undetermined"
    # the simulator runs the fitted calibration
    sc = tmp_path / "fitted.yaml"
    sc.write_text(json.dumps(scenario_raw(tmp_path / "cal.json")))
    res = CliRunner().invoke(app, ["run", str(sc), "--out", str(tmp_path / "run"), "--workers", "1"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("body, message", [
    ({"runs": []}, "non-empty list"),
    ({"runs": [{"metrics": {}}]}, "needs 'configuration'"),
    ({"runs": [{"configuration": "orthrus", "metrics": {"throughput_rps": {"embeddings": 3}}}]},
     "throughput_rps.embeddings: unknown kind"),
    ({"runs": [{"configuration": "orthrus", "metrics": {"latency_s": {"ttft": {"p90": 1}}}}]},
     "latency_s.ttft.p90: unknown statistic"),
    ({"runs": [{"configuration": "orthrus", "metrics": {"utilization": {"mfu": 0.3}}}]},
     "no fitted metric"),
    ({"schema": "other/1", "runs": []}, "schema must be"),
])
def test_measured_file_errors_name_the_problem(tmp_path, body, message):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=message):
        load_measured([path])


def test_fit_refuses_a_configuration_the_scenario_cannot_hold(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(MINIMAL.replace("dedicated-1:1", "dedicated-1:3"))
    with pytest.raises(ValueError, match="dedicated-1:3"):
        fit(parse_scenario(scenario_raw()), load_measured([path]))


def test_only_kind_keeps_one_kinds_pools():
    raw = only_kind(scenario_raw(), "embedding")
    assert [p["kind"] for p in raw["workload"]["pools"]] == ["embedding"]
    with pytest.raises(ValueError, match="--only"):
        only_kind(scenario_raw(), "vision")


def test_a_kinds_pool_alone_sends_what_it_sends_in_the_whole_scenario():
    """The dedicated generation server is benched with the generation pool alone; the fit
    simulates the whole scenario. Both must see the very same requests (common random numbers):
    with per-kind closed-loop pools on a split, the generation server's run is the same run."""
    raw = scenario_raw()
    whole = simulate(parse_scenario(raw), "dedicated-1:1").requests
    alone = simulate(parse_scenario(only_kind(raw, "generation")), "dedicated-1:1").requests
    gen = [r for r in whole if r["kind"] == "generation"]
    assert gen and gen == alone
    assert {r["request_id"].split("-")[1][:2] for r in alone} == {"p1"}


def test_pool_streams_name_the_requests_and_must_differ():
    raw = scenario_raw()
    raw["workload"]["pools"][1]["stream"] = "chat"
    rows = simulate(parse_scenario(raw), "dedicated-1:1").requests
    assert {r["request_id"].split("-")[1][:5] for r in rows if r["kind"] == "generation"} == {"pchat"}
    raw["workload"]["pools"][0]["stream"] = "chat"
    with pytest.raises(ValueError, match="stream 'chat' names two pools"):
        parse_scenario(raw)
    raw["workload"]["pools"][0]["stream"] = "1"  # the other pool's default name
    with pytest.raises(ValueError, match="stream '1' names two pools"):
        parse_scenario({**raw, "workload": {**raw["workload"], "pools": [
            raw["workload"]["pools"][0], {**raw["workload"]["pools"][1], "stream": None}]}})


# ----- where a calibration comes from ----------------------------------------------------------
def test_environment_warning_fires_on_another_machine_or_dtype():
    here = this_machine()
    same = EnvironmentModel(machine=here["machine"], cpu_flags=here["cpu_flags"], dtype="float32")
    assert environment_warning(same, here, "float32", "c.json") is None
    assert environment_warning(None, here, "float32", "c.json") is None
    other = same.model_copy(update={"machine": "Other CPU", "cpu_flags": ["avx2", "avx512_bf16"]})
    line = environment_warning(other, {**here, "cpu_flags": ["avx2"]}, "float32", "c.json")
    assert line and "\n" not in line and "Other CPU" in line and "-avx512_bf16" in line
    line = environment_warning(same, here, "bfloat16", "c.json")
    assert line and "dtype float32 there, bfloat16 here" in line
    gpu = environment_warning(same.model_copy(update={"gpu": "NVIDIA A100"}), here, None, "c.json")
    assert gpu and "NVIDIA A100" in gpu


def test_run_warns_when_the_calibration_is_for_other_hardware(tmp_path):
    raw = scenario_raw() | {"hardware": "a100-40gb", "duration_s": 6, "warmup_s": 1}
    sc = tmp_path / "sc.yaml"
    sc.write_text(json.dumps(raw))
    res = CliRunner().invoke(app, ["run", str(sc), "--out", str(tmp_path / "o"), "--workers", "1"])
    assert res.exit_code == 0, res.output
    assert "made for cpu-2core, the scenario simulates a100-40gb" in res.output


def test_one_kinds_run_drops_its_combined_throughput(tmp_path):
    path = tmp_path / "emb.json"
    path.write_text(json.dumps({"runs": [{"configuration": "dedicated-1:1", "metrics": {
        "throughput_rps": {"embedding": 3.0, "generation": 0.0, "combined": 3.0},
        "latency_s": {"generation": {"p50": None, "count": 0}, "embedding": {"p50": 0.2}}}}]}))
    (run,) = load_measured([path])
    assert run.metrics == {"throughput_rps.embedding": 3.0, "latency_s.embedding.p50": 0.2}
    (run,) = load_measured([path], ["throughput_rps.*"])
    assert run.metrics == {"throughput_rps.embedding": 3.0}


def test_fit_validation_tables_and_docs_section(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("fit_validation", ROOT / "scripts" / "fit_validation.py")
    fv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fv)
    rows = [{"configuration": "orthrus", "metric": m, "simulated": 1.1, "measured": 1.0,
             "relative_error": 0.1 if m.startswith("throughput") else 0.3} for m, _ in fv.COMPARED]
    params = {"embedding_scale": {"value": 1.2, "status": "fitted"},
              "overlap": {"value": 1.0, "status": "undetermined"}}
    results = [{"mix": "5:5", "fit": params, "predicted": rows, "prior": rows,
                "iterations": [{"log": "orthrus", "batch": "all", "ratio": 1.02, "iterations": 9}],
                "speed": {"dedicated-embedding": [1.0, 1.1], "orthrus": [1.2]}}]
    args = SimpleNamespace(backend="torch", duration=20.0, warmup=4.0, clients=8, repeat=1,
                           configurations=["orthrus"], engine_cpus="1", client_cpus="0",
                           target_factor=0.0, min_completions=20)
    text = "\n".join(fv.table_lines(results, args, 12.0))
    assert "| 5:5 | orthrus | +10.0% (+10%) |" in text and "**+30.0%**" in text
    assert "2 of 6 cells meet their target." in text and "MAPE with the fitted calibration" in text
    assert "* 5:5: dedicated-embedding 1.00, 1.10; orthrus 1.20" in text
    assert "| 5:5 | orthrus | 1.02 (9) |" in text
    # too few generations finished: their four cells are shown with the count, not judged
    few = [{**results[0], "target_s": 0.2,
            "completed": {"orthrus": {"embedding": 40.0, "generation": 7.0}},
            "completed_predicted": {"orthrus": {"embedding": 38, "generation": 9}}}]
    text = "\n".join(fv.table_lines(few, SimpleNamespace(**{**vars(args), "target_factor": 2.0}), 1.0))
    assert "| 5:5 | orthrus | +10.0% (+10%) | (+10%, n=7) | **+30.0%** (+30%) | (+30%, n=7) |" in text
    assert "1 of 2 cells meet their target (4 more in brackets" in text and "5:5 200 ms" in text
    generation = {"runs": [{"metrics": {"latency_s": {"tpot": {"p50": 0.04}}}},
                           {"metrics": {"latency_s": {"tpot": {"p50": 0.06}}}}]}
    assert fv.treatment_target(2.0, generation) == pytest.approx(0.1)
    assert fv.treatment_target(0.0, generation) is None
    with pytest.raises(SystemExit, match="no TPOT"):
        fv.treatment_target(2.0, {"runs": [{"metrics": {"latency_s": {"tpot": None}}}]})
    # the prior: the one given, named in the command and the header; else profiled in the run
    shipped = ROOT / "calibration" / "cpu-1core-small.json"
    given = SimpleNamespace(**{**vars(args), "calibration": str(shipped)})
    text = "\n".join(fv.table_lines(results, given, 1.0))
    assert "--calibration calibration/cpu-1core-small.json`" in text
    assert "prior calibration: `cpu-1core-small.json` (made 2026-12-01, 1 thread(s), bfloat16)" in text
    assert fv.prior_calibration(given, None) == str(shipped)
    calls = []
    monkeypatch.setattr(fv.subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)))
    made = SimpleNamespace(**{**vars(args), "calibration": None, "out": tmp_path / "fv",
                              "model": tmp_path / "m"})
    from rich.console import Console

    path = fv.prior_calibration(made, Console(quiet=True))
    (cmd, kw), = calls
    assert path == str(tmp_path / "fv" / "prior" / "calibration-torch.json")
    assert cmd[2:4] == ["orthrus_real.cli", "calibrate"] and cmd[cmd.index("--cpus") + 1] == "1"
    assert cmd[cmd.index("--out") + 1] == path and kw["check"]
    assert "profile of the engine on its CPUs made in the same run" in "\n".join(
        fv.table_lines(results, SimpleNamespace(**{**vars(args), "calibration": path}), 1.0))
    # a stored run keeps what it was measured with (--tables-only writes its tables with that)
    assert set(fv.RUN_ARGUMENTS) <= set(vars(fv.arguments().parse_args([])))
    lines = fv.table_lines(results, args, 12.0)
    doc = tmp_path / "docs" / "fidelity.md"
    doc.parent.mkdir()
    doc.write_text("# Fidelity\n\ntoday's table\n")
    monkeypatch.setattr(fv, "ROOT", tmp_path)
    fv.write_docs(lines, "torch")
    fv.write_docs(lines, "torch")  # replaced, not appended twice
    fv.write_docs([line.replace("(torch)", "(vllm)") for line in lines], "vllm")
    out = doc.read_text()
    assert out.startswith("# Fidelity\n\ntoday's table\n") and out.count(fv.START) == 2
    assert out.count("(torch)") == 1 and out.count("(vllm)") == 1


def test_fit_validation_ranges_say_which_measurements_fall_outside():
    pytest.importorskip("torch")
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("fit_validation", ROOT / "scripts" / "fit_validation.py")
    fv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fv)
    rows = [{"configuration": "orthrus", "metric": m, "simulated": 1.1, "measured": 1.0,
             "relative_error": 0.05} for m, _ in fv.COMPARED]
    # the embedding throughput's range holds the measurement, the generation throughput's not
    ranges = [{"configuration": "orthrus", "metric": "throughput_rps.embedding", "point": 1.05,
               "low": 0.96, "high": 1.12},
              {"configuration": "orthrus", "metric": "throughput_rps.generation", "point": 1.05,
               "low": 1.02, "high": 1.10}]
    results = [{"mix": "5:5", "fit": {"overlap": {"value": 1.0, "status": "undetermined"}},
                "predicted": rows, "prior": rows, "ranges": ranges,
                "completed": {"orthrus": {"embedding": 40.0, "generation": 30.0}}}]
    args = SimpleNamespace(backend="torch", duration=20.0, warmup=4.0, clients=8, repeat=1,
                           configurations=["orthrus"], engine_cpus="1", client_cpus="0",
                           target_factor=0.0, min_completions=20)
    text = "\n".join(fv.table_lines(results, args, 1.0))
    assert "| 5:5 | orthrus | -4%..+12% | **+2%..+10%** | - | - | - | - |" in text
    assert "1 of 2 judged cells lie inside their predicted range" in text
    assert "1 of 2 reach their range within two standard errors" in text  # no spread stored: strict
    # 2 % outside, with a 3 % run-to-run CV over 2 repeats (2 standard errors: 4.2 %): near
    spread_ = {"orthrus": {"throughput_rps.generation": {"values": [1.0, 1.0], "cv": 0.03}}}
    text = "\n".join(fv.table_lines([{**results[0], "spread": spread_}], args, 1.0))
    assert "1 of 2 judged cells lie inside" in text
    assert "2 of 2 reach their range within two standard errors" in text
    spread_ = {"orthrus": {"throughput_rps.generation": {"values": [1.0, 1.0], "cv": 0.01}}}
    text = "\n".join(fv.table_lines([{**results[0], "spread": spread_}], args, 1.0))
    assert "1 of 2 reach their range within two standard errors" in text
    # a cell too small to judge is shown in brackets and not counted
    few = [{**results[0], "completed": {"orthrus": {"embedding": 40.0, "generation": 5.0}}}]
    text = "\n".join(fv.table_lines(few, args, 1.0))
    assert "**(+2%..+10%)**" in text and "1 of 1 judged cells lie inside" in text
    # a run stored before ranges existed writes its tables without them
    assert "Predicted ranges" not in "\n".join(
        fv.table_lines([{k: v for k, v in results[0].items() if k != "ranges"}], args, 1.0))


def test_fit_validation_refits_a_stored_summary_with_the_same_measurements(tmp_path):
    """--refit --from-summary: a table's stored run unpacked into the servers' results files
    gives the fit every bench it had (one run per bench, each server's kind) and the treatment's
    measured means, so the refit compares with the same measurements."""
    pytest.importorskip("torch")
    import importlib.util

    from orthrus_sim.experiment.measured import load_measured

    spec = importlib.util.spec_from_file_location("fit_validation", ROOT / "scripts" / "fit_validation.py")
    fv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fv)
    source = ROOT / "docs" / "fidelity" / "fit-validation-torch-2026-12-02.json"
    stored = json.loads(source.read_text())
    fv.unpack_summary(source, tmp_path)
    for mix in stored["mixes"]:
        base = tmp_path / mix["mix"].replace(":", "-")
        runs = load_measured([base / "dedicated-embedding" / "results.json",
                              base / "dedicated-generation" / "results.json"], fv.FIT_METRICS)
        assert [r.kind for r in runs] == ["embedding"] * 2 + ["generation"] * 2  # --repeat 2
        got = [(r.configuration, m, v) for r in runs for m, v in r.metrics.items()]
        assert got == [(x["configuration"], x["metric"], x["measured"]) for x in mix["fit_residuals"]]
        stored_mean = {x["metric"]: x["measured"] for x in mix["predicted"]
                       if x["configuration"] == "orthrus" and x["measured"] is not None}
        doc = fv.stored([("unified", None, "orthrus", base / "orthrus", "orthrus")])[0]
        assert doc["metrics"]["throughput_rps"]["embedding"] == stored_mean["throughput_rps.embedding"]
        assert fv.completions(doc["metrics"]) == {k: mix["completed"]["orthrus"].get(k)
                                                  for k in ("embedding", "generation")}
        assert doc["spread"] == mix["spread"]["orthrus"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mixes": [{**stored["mixes"][0], "fit_residuals": [
        {"configuration": "dedicated-1:1", "metric": "utilization.busy", "measured": 1.0}]}]}))
    with pytest.raises(SystemExit, match="before any throughput"):
        fv.unpack_summary(bad, tmp_path / "bad")


def test_fit_validation_measures_in_rounds(tmp_path, monkeypatch):
    """--repeat N benches every server once per round (each started afresh), so a slow minute
    of the machine falls on one run of one server; each server's results hold all its runs."""
    pytest.importorskip("torch")
    import importlib.util
    from types import SimpleNamespace

    from rich.console import Console

    spec = importlib.util.spec_from_file_location("fit_validation", ROOT / "scripts" / "fit_validation.py")
    fv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fv)
    calls = []

    def fake_serve_and_bench(cmd, port, sc, label, log, start_timeout, env, iterations):
        calls.append((label, log.name, iterations.name))
        value = float(len(calls))
        return [{"configuration": label, "metrics": {"throughput_rps": {"embedding": value}}}]

    monkeypatch.setattr(fv, "serve_and_bench", fake_serve_and_bench)
    args = SimpleNamespace(repeat=2, duration=1.0, backend="torch", engine_cpus="", model=tmp_path,
                           calibration=None, dtype="float32")
    raw = scenario_raw()
    servers = [("unified", raw, cfg, tmp_path / cfg, cfg) for cfg in ("orthrus", "unified-homo")]
    got = fv.measure(args, servers, Console(quiet=True), "5:5")
    assert calls == [("orthrus", "server.log", "iterations.jsonl"),
                     ("unified-homo", "server.log", "iterations.jsonl"),
                     ("orthrus", "server-2.log", "iterations-2.jsonl"),
                     ("unified-homo", "server-2.log", "iterations-2.jsonl")]
    assert [g["metrics"]["throughput_rps"]["embedding"] for g in got] == [2.0, 3.0]  # 1,3 and 2,4
    doc = json.loads((tmp_path / "orthrus" / "results.json").read_text())
    assert [r["metrics"]["throughput_rps"]["embedding"] for r in doc["runs"]] == [1.0, 3.0]
    assert fv.stored(servers) == got  # what --refit fits again


def test_fit_validation_gives_stock_vllm_the_engines_dtype(tmp_path):
    """Stock vLLM's --dtype auto runs an fp32 checkpoint in bf16 on a CPU; the baselines must
    compute in what the treatment computes in, so every server is given the same dtype."""
    pytest.importorskip("torch")
    import importlib.util
    from types import SimpleNamespace

    from orthrus_real.engine.device import cpu_has_bf16

    spec = importlib.util.spec_from_file_location("fit_validation", ROOT / "scripts" / "fit_validation.py")
    fv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fv)
    for name, expected in [("float32", "float32"),
                           ("bfloat16", "bfloat16" if cpu_has_bf16() else "float32")]:
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": name}))
        assert fv.served_dtype(tmp_path) == expected
    args = SimpleNamespace(backend="vllm", engine_cpus="1", model=tmp_path, dtype="float32")
    for role in ("generation", "embedding", "unified"):
        cmd, _ = fv.serve_command(args, 8000, role, tmp_path / "s.yaml", "orthrus")
        assert cmd[cmd.index("--dtype") + 1] == "float32", role
    assert "vllm.entrypoints.openai.api_server" in fv.serve_command(args, 8000, "generation")[0]


def test_fit_validation_machine_speed_is_per_run_against_the_prior(tmp_path):
    pytest.importorskip("torch")
    import importlib.util

    from orthrus_sim.costmodel import calibrated_predictor
    from orthrus_sim.costmodel.shape import BatchShape

    spec = importlib.util.spec_from_file_location("fit_validation", ROOT / "scripts" / "fit_validation.py")
    fv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fv)
    prior = str(ROOT / "calibration" / "cpu-1core-small.json")
    cost = calibrated_predictor(prior, "orthrus-small", 16).cost
    shape = BatchShape.from_items([(2, 1, 100)] * 8)
    folder = tmp_path / "orthrus"
    folder.mkdir()
    for name, slow in (("iterations.jsonl", 1.0), ("iterations-2.jsonl", 1.5),
                       ("iterations-10.jsonl", 2.0)):
        row = {"seconds": slow * cost.shape_time(shape), "shape": {
            k: getattr(shape, k) for k in BatchShape.__slots__}}
        (folder / name).write_text(json.dumps(row) + "\n")
    speed = fv.machine_speed(tmp_path, prior, "orthrus-small", {"embedding": {"lora_rank": 16}})
    assert speed == {"orthrus": pytest.approx([1.0, 1.5, 2.0])}


def test_documented_examples_load():
    (run,) = load_measured([ROOT / "docs" / "examples" / "published-dedicated.yaml"])
    assert run.configuration == "dedicated-1:3" and run.metrics == {"throughput_rps.embedding": 15.0}
    cal = load_calibration(ROOT / "docs" / "examples" / "a100-fitted-embedding.json")
    assert cal.cost_factors().embedding_scale == pytest.approx(7.2, rel=0.01)
    assert cal.factor_fit.parameters["decode_scale"].status == "undetermined"
    text = (ROOT / "docs" / "fitting.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]  # the minimal form, as documented
    import yaml

    from orthrus_sim.experiment.measured import run_metrics

    doc = yaml.safe_load(block)
    assert run_metrics(doc["runs"][0]["metrics"], "doc") == {
        "throughput_rps.embedding": 15.2, "throughput_rps.generation": 2.1,
        "latency_s.generation.p50": 41.0, "latency_s.ttft.p99": 0.9}
