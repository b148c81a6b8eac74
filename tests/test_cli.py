"""What a new user meets on the command lines: one-line errors naming the problem, shipped
scenarios by name from anywhere, formats, versions, sweeps checked before they start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orthrus_sim.cli import app as sim_app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def small(**extra) -> dict:
    raw = {"name": "small", "seed": 1, "duration_s": 3, "cluster": {"gpus": 1},
           "calibration": "a100-40gb",
           "workload": {"pools": [{"kind": "embedding", "process": "poisson", "rate": 20},
                                  {"kind": "generation", "process": "poisson", "rate": 2}],
                        "generation_output": {"dist": "fixed", "value": 16}},
           "configurations": ["orthrus", "unified-homo"]}
    raw.update(extra)
    return raw


@pytest.fixture
def scenario_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(small()))
    return path


def test_version_and_shipped_scenarios_by_name_from_anywhere(tmp_path, monkeypatch):
    from orthrus_sim import __version__

    res = runner.invoke(sim_app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"orthrus-sim {__version__}"
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(sim_app, ["validate", "quickstart"])
    assert res.exit_code == 0 and "is valid" in res.output
    res = runner.invoke(sim_app, ["catalogue"])
    assert "quickstart" in res.output and "a100-40gb" in res.output


def test_results_carry_provenance_and_formats(scenario_file, tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(sim_app, ["run", str(scenario_file), "--out", str(out), "--workers", "1",
                                  "--format", "csv"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if line.startswith(("configuration,", "orthrus,",
                                                                          "unified-homo,"))]
    assert lines[0].startswith("configuration,emb/s,gen/s,out tok/s") and len(lines) == 3
    assert "total/s" in lines[0]  # CSV and JSON carry every column
    doc = json.loads((out / "results.json").read_text())
    assert doc["version"] and len(doc["scenario_sha256"]) == 64
    assert doc["commit"] is None or len(doc["commit"]) == 40
    res = runner.invoke(sim_app, ["run", str(scenario_file), "--out", str(out), "--workers", "1",
                                  "--format", "json"])
    rows = json.loads(res.stdout)  # only JSON on stdout
    assert {r["configuration"] for r in rows} == {"orthrus", "unified-homo"}
    assert {"rejected", "unfin.", "adm e p99"} <= set(rows[0])


def test_tables_are_not_cut_in_a_file(scenario_file, tmp_path):
    out = subprocess.run([sys.executable, "-m", "orthrus_sim.cli", "run", str(scenario_file),
                          "--out", str(tmp_path / "o"), "--workers", "1"],
                         capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert "unified-homo" in out and "configuration" in out and "…" not in out


@pytest.mark.parametrize("grid, message", [
    ("workload.generation_shar=0.1,0.2", "generation_shar"),
    ("workload.generation_share=0.1,abc", "generation_share"),
    ("cluster.gpus=", "at least one value"),
])
def test_sweep_checks_every_point_before_it_starts(scenario_file, tmp_path, grid, message):
    res = runner.invoke(sim_app, ["sweep", str(scenario_file), "--grid", grid,
                                  "--out", str(tmp_path / "sw"), "--workers", "1"])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "sw").exists()


def test_sweep_skips_what_a_point_cannot_hold_and_says_so(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(small(configurations=["orthrus", "dedicated-1:1"])))
    res = runner.invoke(sim_app, ["sweep", str(path), "--grid", "cluster.gpus=1,2",
                                  "--out", str(tmp_path / "sw"), "--workers", "1"])
    assert res.exit_code == 0, res.output
    assert "skipped dedicated-1:1" in res.output and "uses 2 GPUs but cluster.gpus is 1" in res.output
    doc = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [len(p["runs"]) for p in doc["points"]] == [1, 2]


@pytest.mark.parametrize("args, message", [
    (["run", "scenarios"], "is a directory"),
    (["run", "no-such-scenario"], "shipped scenarios: "),
    (["validate", "quickstart", "--set", "workload.trace=missing.jsonl"], "missing.jsonl does not exist"),
    (["run", "quickstart", "--format", "xml"], "--format must be one of"),
])
def test_errors_are_one_line_without_traceback(args, message):
    res = runner.invoke(sim_app, args)
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit)
    assert message in res.output and "Traceback" not in res.output


def test_validate_reads_traces(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"arrival_time": 0, "kind": "embedding", "input_tokens": 5}\n{"arrival_time": 1')
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "workload": {"kind": "trace", "trace": "t.jsonl"}}))
    res = runner.invoke(sim_app, ["validate", str(path)])
    assert res.exit_code == 2 and "t.jsonl, line 2: not valid JSON" in res.output


def test_the_readme_policy_example_runs_from_the_repository_root(tmp_path):
    """The console script (not python -m) finds tests.example_policy in the working directory."""
    exe = Path(sys.executable).parent / "orthrus-sim"
    if not exe.exists():
        pytest.skip("orthrus-sim is not installed as a console script here")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(small(configurations=["orthrus"], scheduler={
        "policy": "tests.example_policy:ShortestEmbeddingFirst"})))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(exe), "run", str(path), "--out", str(tmp_path / "o"), "--workers", "1"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert "shortest-embedding-first" in (tmp_path / "o" / "results.json").read_text()


def test_real_cli_errors_name_the_problem(tmp_path):
    pytest.importorskip("torch")
    from orthrus_real.cli import app as real_app

    res = runner.invoke(real_app, ["serve", "--model", str(tmp_path), "--port", "99999"])
    assert res.exit_code == 2 and "--port must be between 1 and 65535" in res.output
    res = runner.invoke(real_app, ["serve", "--help"])
    assert ".[vllm]" in res.output  # markup does not swallow the brackets
    import torch

    if not torch.cuda.is_available():
        from orthrus_real.engine.device import choose_device

        with pytest.raises(ValueError, match="--device cuda"):
            choose_device("cuda")


def test_dtype_follows_the_cpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from orthrus_real.engine import device

    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2", "fma"})
    dtype, why = device.choose_dtype(torch.device("cpu"), None, torch.bfloat16)
    assert dtype == torch.float32 and "no bf16 instructions" in why
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert device.choose_dtype(torch.device("cpu"), None, torch.bfloat16)[0] == torch.bfloat16
    assert device.choose_dtype(torch.device("cpu"), "float32", torch.bfloat16)[0] == torch.float32
    with pytest.raises(ValueError, match="--dtype must be one of"):
        device.choose_dtype(torch.device("cpu"), "fp8", torch.bfloat16)


def test_calibrate_warns_when_the_fit_is_poor():
    pytest.importorskip("torch")
    from orthrus_real.measure.calibrate import fit_warnings
    from orthrus_sim.costmodel import load_calibration

    cal = load_calibration(ROOT / "calibration" / "cpu-2core-small.json")
    cal.fit_error.iteration_mape = 0.75
    cal.fit_error.detail["holdout_mape_decode"] = 0.5
    warnings = fit_warnings(cal)
    assert any("the fit is poor: held-out MAPE 75.0%" in w for w in warnings)
    assert any("decode iterations are fitted poorly" in w for w in warnings)


def test_results_table_with_slos_fits_80_columns():
    """Goodput joins the default columns when a scenario has SLOs; attainment waits for --wide
    (the table fits an 80-column terminal either way)."""
    from rich.console import Console

    from orthrus_sim.experiment.results import comparison_table

    m = {"throughput_rps": {"embedding": 123.45, "generation": 12.34, "combined": 135.79},
         "output_tokens_per_s": 6543.2, "latency_s": {"embedding": {"p99": 0.123},
                                                      "ttft": {"p99": 0.456}, "tpot": {"p99": 0.0234}},
         "slo": {"combined": {"goodput_rps": 130.0}, "embedding": {"attainment": 0.995},
                 "generation": {"attainment": 0.99}}, "rejected": {}, "unfinished": {}}
    console = Console(width=80, record=True)
    console.print(comparison_table([{"configuration": "unified-hetero", "metrics": m}], "t"))
    text = console.export_text()
    assert "goodput" in text and "SLO emb" not in text and "130.00" in text
    assert "123.45" in text and "0.0234" in text  # no figure wrapped across lines


def test_a_scenario_uses_its_hardwares_calibration_and_says_what_its_figures_stand_on():
    """Issue 61: no calibration named -> the one shipped for the hardware; a derived one and a
    GPU with none each print one line (on stderr: stdout may be JSON); ``roofline`` opts out."""
    from orthrus_sim.experiment.scenario import hardware_calibration, parse_scenario

    raw = {k: v for k, v in small().items() if k != "calibration"}
    for hardware in ("h100-sxm", "a40", "a100-80gb", "h200", "a100-40gb"):
        sc = parse_scenario({**raw, "hardware": hardware})
        assert sc.calibration_file == hardware_calibration(hardware)
        assert Path(sc.calibration_file).name == f"{hardware}.json"
    assert parse_scenario({**raw, "hardware": "l40s"}).calibration_file is None
    assert parse_scenario({**raw, "hardware": "h100-sxm", "calibration": "roofline"}).calibration_file is None
    expected = {"h100-sxm": None, "h200": "derived, not fitted",
                "l40s": "a roofline with assumed efficiencies"}
    for hardware, words in expected.items():
        res = runner.invoke(sim_app, ["validate", "quickstart", "--set", f"hardware={hardware}",
                                      "--set", "calibration=null"])
        assert res.exit_code == 0, res.output
        if words is None:
            assert "note:" not in res.stderr and "warning" not in res.stderr
        else:
            assert words in res.stderr and words not in res.stdout
