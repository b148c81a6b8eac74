"""Trace pools: every public format, the window, time scaling, two kinds merged, bad rows."""

from __future__ import annotations

import json

import pytest

from orthrus_sim.experiment.scenario import parse_scenario
from orthrus_sim.experiment.trace import load_trace, trace_format, window
from orthrus_sim.sim.run import simulate

SPLITWISE = "arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
    f"{0.5 * i},{100 + i},{4 + i % 3}\n" for i in range(20))


def scenario(*pools: dict, **extra) -> dict:
    return {"name": "t", "seed": 1, "cluster": {"gpus": 1}, "configurations": ["orthrus"],
            "workload": {"pools": list(pools)}} | extra


def test_each_format_is_detected_and_read(tmp_path):
    files = {
        "splitwise": ("s.csv", SPLITWISE),
        "azure": ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                           "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:48.1805900,20,3\n"),
        "burstgpt": ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,"
                              "Log Type\n5,ChatGPT,472,18,490,Conversation log\n"
                              "7.5,GPT-4,1087,0,1087,Conversation log\n"),
        "mooncake": ("m.jsonl", '{"timestamp": 1000, "input_length": 6955, "output_length": 52}\n'
                                '{"timestamp": 3500, "input_length": 100, "output_length": 9}\n'),
    }
    for name, (file, text) in files.items():
        path = tmp_path / file
        path.write_text(text)
        assert trace_format(path) == name
        rows = load_trace(path)
        assert rows[0]["arrival_time"] == 0.0 and rows[0]["kind"] is None
    assert [r["arrival_time"] for r in load_trace(tmp_path / "a.csv")] == pytest.approx([0, 1.5])
    assert [r["arrival_time"] for r in load_trace(tmp_path / "b.csv")] == [0, 2.5]
    assert [r["arrival_time"] for r in load_trace(tmp_path / "m.jsonl")] == [0, 2.5]
    assert load_trace(tmp_path / "m.jsonl")[0]["input_tokens"] == 6955
    # BurstGPT's failed request (0 response tokens) is sent as a one-token generation
    assert [r["output_tokens"] for r in window(tmp_path / "b.csv").rows] == [18, 1]
    with pytest.raises(ValueError, match="format azure needs the columns TIMESTAMP"):
        load_trace(tmp_path / "s.csv", "azure")


def test_window_and_scaling(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text(SPLITWISE)  # 20 requests, one every 0.5 s
    w = window(path, start_s=2.0, length_s=3.0)
    assert [r["input_tokens"] for r in w.rows] == [104, 105, 106, 107, 108, 109]
    assert w.rows[0]["arrival_time"] == 0.0 and w.speedup == 1.0 and w.rate == 2.0
    fast = window(path, start_s=2.0, length_s=3.0, rate=8.0)
    assert fast.speedup == 4.0
    assert [r["arrival_time"] for r in fast.rows] == pytest.approx([0.125 * i for i in range(6)])
    assert window(path, start_s=2.0, length_s=3.0, rate=8.0, scale=2.0).speedup == 8.0
    with pytest.raises(ValueError, match=r"no request arrives in the window \[50, 60\) s"):
        window(path, start_s=50, length_s=10)


def test_two_kindless_traces_merge_into_one_mixed_workload(tmp_path):
    conv = tmp_path / "conv.csv"
    conv.write_text(SPLITWISE)
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"timestamp": 250 * i, "input_length": 40_000 if i % 2
                                        else 300, "output_length": 5}) + "\n" for i in range(16)))
    raw = scenario({"kind": "generation", "process": "trace", "trace": "conv.csv", "rate": 4.0},
                   {"kind": "embedding", "process": "trace", "trace": "code.jsonl",
                    "length_s": 2.0})
    sc = parse_scenario(raw, base_dir=tmp_path)
    result = simulate(sc, "orthrus")
    rows = result.requests
    gens = sorted((r for r in rows if r["kind"] == "generation"), key=lambda r: r["arrival_s"])
    embs = sorted((r for r in rows if r["kind"] == "embedding"), key=lambda r: r["arrival_s"])
    assert len(gens) == 20 and len(embs) == 8  # the embeddings' window: 0-2 s, 4 per second
    assert gens[-1]["arrival_s"] == pytest.approx(20 / 4.0)  # 20 over 9.5 s, replayed at 4/s
    assert max(r["input_tokens"] for r in embs) == 32768  # mistral-7b's positions
    warnings = result.metrics["warnings"]
    assert any("4 of 8 embedding inputs" in w and "cut to 32768 tokens" in w for w in warnings)
    notes = result.metrics["workload_notes"]
    assert any("time compressed x1.9" in n and "as generations" in n for n in notes)
    assert {r["state"] for r in rows} <= {"finished", "rejected", "unfinished"}


def test_rate_scale_compresses_a_trace_pool(tmp_path):
    (tmp_path / "s.csv").write_text(SPLITWISE)
    pool = {"kind": "generation", "process": "trace", "trace": "s.csv"}
    raw = scenario(pool) | {"workload": {"pools": [pool], "rate_scale": 2.0}}
    result = simulate(parse_scenario(raw, base_dir=tmp_path), "orthrus")
    assert max(r["arrival_s"] for r in result.requests) == pytest.approx(19 * 0.25)


def test_bad_rows_name_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,1\n1,x,2\n")
    pool = {"kind": "generation", "process": "trace", "trace": "bad.csv"}
    with pytest.raises(ValueError, match=r"bad.csv, line 3, column num_prefill_tokens: must be an "
                                         r"integer, got 'x'"):
        parse_scenario(scenario(pool), base_dir=tmp_path)
    iso = tmp_path / "iso.csv"
    iso.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,1\n")
    with pytest.raises(ValueError, match=r"iso.csv, line 2, column TIMESTAMP: must be an ISO"):
        load_trace(iso)
    # the file's own line, past blank lines
    gaps = tmp_path / "gaps.csv"
    gaps.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,1\n\n\n1,2,1\n2,y,1\n")
    with pytest.raises(ValueError, match=r"gaps.csv, line 6, column num_prefill_tokens"):
        load_trace(gaps)
    odd = tmp_path / "odd.csv"
    odd.write_text("when,what\n1,2\n")
    with pytest.raises(ValueError, match="no known format has the columns when, what"):
        load_trace(odd)
    (tmp_path / "s.csv").write_text(SPLITWISE)
    with pytest.raises(ValueError, match="has no kind column: give the pool kind embedding or "
                                         "generation"):
        parse_scenario(scenario(pool | {"trace": "s.csv", "kind": "mixed"}), base_dir=tmp_path)
    with pytest.raises(ValueError, match="has no kind column: replay it as a pool"):
        parse_scenario({"name": "t", "workload": {"kind": "trace", "trace": "s.csv"}},
                       base_dir=tmp_path)


def test_shipped_traces_load():
    from orthrus_sim import data_dir

    folder = data_dir("scenarios") / "traces"
    conv = window(folder / "splitwise_conv.csv")
    code = window(folder / "splitwise_code.csv")
    assert len(conv.rows) == 19_366 and len(code.rows) == 8_819
    assert conv.rate == pytest.approx(5.5, abs=0.1) and code.rate == pytest.approx(2.6, abs=0.1)


def test_iso_times_without_a_zone_are_utc(tmp_path, monkeypatch):
    """An Azure trace's gaps do not depend on the machine's zone (a clock change at 01:00 UTC
    on 2023-03-26 in Europe/Berlin would add an hour to one gap)."""
    import time

    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-03-26 00:30:00.0000000,5,1\n"
                    "2023-03-26 01:30:00.0000000,5,1\n")
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        rows = load_trace(path)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert rows[1]["arrival_time"] - rows[0]["arrival_time"] == 3600.0


def test_a_mixed_trace_s_rates_are_its_rows_own_kinds(tmp_path):
    """A trace with a kind column sends each row's kind: the capacity search's rates and the
    re-planning split's start count them, whatever the workload's generation share."""
    from orthrus_sim.experiment.arrivals import kind_rates
    from orthrus_sim.routing.replan import nominal_demand

    (tmp_path / "m.jsonl").write_text("".join(json.dumps(
        {"arrival_time": 0.5 * i, "kind": "embedding" if i % 4 == 0 else "generation",
         "input_tokens": 50, "output_tokens": 5}) + "\n" for i in range(40)))
    pool = {"kind": "mixed", "process": "trace", "trace": "m.jsonl"}
    raw = scenario(pool) | {"cluster": {"gpus": 2}, "workload": {
        "pools": [pool], "generation_share": 0.1}}
    sc = parse_scenario(raw, base_dir=tmp_path)
    rates = kind_rates(sc.workload.pools[0], 0.1)
    assert rates["generation"] == pytest.approx(3 * rates["embedding"])
    d = nominal_demand(sc)
    assert d.generation_rps == pytest.approx(3 * d.embedding_rps)


def test_tokens_scale_shrinks_a_trace_s_lengths_and_keeps_its_times(tmp_path):
    (tmp_path / "s.csv").write_text(SPLITWISE)  # inputs 100-119, outputs 4-6
    pool = {"kind": "generation", "process": "trace", "trace": "s.csv", "tokens_scale": 0.1}
    result = simulate(parse_scenario(scenario(pool), base_dir=tmp_path), "orthrus")
    gens = sorted(result.requests, key=lambda r: r["arrival_s"])
    assert [r["input_tokens"] for r in gens] == [round((100 + i) * 0.1) for i in range(20)]
    assert {r["output_tokens"] for r in gens} == {1}  # 0.4-0.6 rounds to at least one token
    assert [r["arrival_s"] for r in gens] == pytest.approx([0.5 * i for i in range(20)])
    with pytest.raises(ValueError, match="tokens_scale scales a trace's lengths: it needs "
                                         "process 'trace'"):
        parse_scenario(scenario({"kind": "generation", "process": "poisson", "rate": 1.0,
                                 "tokens_scale": 0.5}))
