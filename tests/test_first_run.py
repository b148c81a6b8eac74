"""The simulator's first impression (issue 25): the quickstart shows what Orthrus is for, the
table fits 80 columns, machine-readable output is only that, plots label what they show, and
a bad override names itself."""

from __future__ import annotations

import json

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from orthrus_sim.cli import app
from orthrus_sim.experiment.results import COLUMNS, comparison_rows, comparison_table, headline
from orthrus_sim.experiment.scenario import load_scenario, parse_scenario
from orthrus_sim.sim.run import simulate

runner = CliRunner()


@pytest.fixture(scope="module")
def quickstart_runs():
    """The shipped quickstart, shortened, Orthrus beside Unified-Hetero."""
    sc = load_scenario("quickstart", ["duration_s=30", "warmup_s=10"])
    return [{"configuration": c, "metrics": simulate(sc, c, keep_rows=False).metrics}
            for c in ("unified-hetero", "orthrus")]


def test_quickstart_shows_orthrus_and_unified_hetero_differ(quickstart_runs):
    hetero, ours = (r["metrics"] for r in quickstart_runs)
    assert ours["latency_s"]["embedding"]["p99"] < 0.2 * hetero["latency_s"]["embedding"]["p99"]
    assert ours["throughput_rps"]["generation"] >= 0.97 * hetero["throughput_rps"]["generation"]
    line = headline(quickstart_runs)
    assert line.startswith("orthrus vs unified-hetero: emb p99") and len(line) <= 80


def test_table_fits_80_columns_with_per_kind_tpot_and_tokens(quickstart_runs):
    runs = quickstart_runs + [{**quickstart_runs[0], "configuration": "disagg-pd-1:1"}]
    console = Console(width=80, record=True)
    console.print(comparison_table(runs, "a title that is fairly long (2 GPU, a100-40gb)"))
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= 80
    header = next(x for x in lines if "configuration" in x)
    for col in ("emb/s", "gen/s", "out tok/s", "emb p99", "TTFT p99", "TPOT p99"):
        assert col in header
    assert "total/s" not in header and "disagg-pd-1:1" in text  # names are never folded
    wide = Console(width=250, record=True)
    wide.print(comparison_table(runs, "t", wide=True))
    wide_text = wide.export_text()
    assert all(c.name in wide_text for c in COLUMNS)
    row = comparison_rows(quickstart_runs)[1]
    assert row["out tok/s"] > 0 and 0 < row["TPOT p99"] < 1


def small_file(tmp_path, **extra):
    raw = {"name": "small", "seed": 1, "duration_s": 3, "calibration": "a100-40gb",
           "workload": {"pools": [{"kind": "embedding", "process": "poisson", "rate": 20},
                                  {"kind": "generation", "process": "poisson", "rate": 2}],
                        "generation_output": {"dist": "fixed", "value": 16}},
           "configurations": ["orthrus", "unified-hetero"], **extra}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_json_output_is_only_json_for_runs_and_resumed_sweeps(tmp_path):
    path = small_file(tmp_path)
    res = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o"), "--workers", "1",
                              "--format", "json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["configuration"] for r in rows] == ["orthrus", "unified-hetero"]
    assert "results:" in res.stderr
    args = ["sweep", str(path), "--grid", "seed=1,2", "--out", str(tmp_path / "sw"),
            "--workers", "1", "--format", "json", "--set", "configurations=[orthrus]"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, args)  # resumed: every point already stored
    assert again.exit_code == 0 and "already in" in again.stderr
    assert json.loads(again.stdout) == json.loads(first.stdout)


def test_plots_label_gpus_number_narrow_axes_and_show_a_2d_grid(tmp_path, monkeypatch):
    from orthrus_sim.questions import plots

    seen = {}
    finish = plots._finish

    def record(fig, axes, path, title):
        fig.canvas.draw()
        seen[path.name] = [(ax.get_title(), ax.get_xlabel(),
                            [t.get_text() for t in ax.get_xticklabels() if t.get_text()],
                            [ln.get_label() for ln in ax.get_lines()]) for ax in axes]
        finish(fig, axes, path, title)

    monkeypatch.setattr(plots, "_finish", record)
    path = small_file(tmp_path)
    res = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o"), "--workers", "1",
                              "--set", "cluster.gpus=2"])
    assert res.exit_code == 0, res.output
    tpot = next(a for a in seen["latency_cdf.png"] if a[1].startswith("time per output"))
    assert len(tpot[2]) >= 2  # numbers on its axis (the spread is narrow)
    busy = [a for a in seen["timeline.png"] if "GPU 0" in a[3]]
    assert busy and all({"GPU 0", "GPU 1"} <= set(a[3]) for a in busy)
    res = runner.invoke(app, ["sweep", str(path), "--grid", "seed=1,2", "--grid",
                              "scheduler.chunk_size=256,512", "--out", str(tmp_path / "sw"),
                              "--workers", "1", "--set", "configurations=[orthrus]"])
    assert res.exit_code == 0, res.output
    panels = seen["sweep.png"]
    assert sorted(a[0] for a in panels) == ["scheduler.chunk_size=256", "scheduler.chunk_size=512"]


def test_override_errors_name_the_override_and_suggest_the_field(tmp_path):
    sc = load_scenario("quickstart", ["workload.pools.1.rate=12"])
    assert sc.workload.pools[1].rate == 12
    with pytest.raises(ValueError, match=r"workload\.pools is a list of 2 items; address one by "
                                         r"its index 0-1, not '5'"):
        load_scenario("quickstart", ["workload.pools.5.rate=12"])
    with pytest.raises(ValueError, match=r"\(from --set scheduler\.chunk_size=99999\)"):
        load_scenario("quickstart", ["scheduler.chunk_size=99999"])
    with pytest.raises(ValueError, match=r"did you mean 'workload\.pools\.0\.rate'"):
        load_scenario("quickstart", ["workload.pools.0.rat=3"])
    with pytest.raises(ValueError, match=r"did you mean 'seed'"):
        parse_scenario({"name": "x", "duration_s": 1, "sead": 3})
    path = small_file(tmp_path)
    res = runner.invoke(app, ["sweep", str(path), "--grid", "workload.pools.7.rate=1,2",
                              "--out", str(tmp_path / "sw")])
    assert res.exit_code == 2 and "--grid 'workload.pools.7.rate=1'" in res.output
    assert "--set" not in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["sweep", str(path), "--grid", "scheduler.chunk_size=99999",
                              "--out", str(tmp_path / "sw")])
    assert res.exit_code == 2 and "(from --grid scheduler.chunk_size=99999)" in res.output
