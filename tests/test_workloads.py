"""Every shipped scenario validates; trace replay, gamma arrivals, empirical lengths, phases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orthrus_sim.experiment.scenario import hardware_calibration, load_scenario, parse_scenario
from orthrus_sim.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_scenario_file_validates(path):
    sc = load_scenario(path)
    assert sc.configurations


def base(**workload) -> dict:
    return {"name": "w", "seed": 5, "cluster": {"gpus": 1}, "configurations": ["orthrus"],
            "workload": workload}


def test_trace_replay_issues_exactly_the_trace(tmp_path):
    rows = [{"arrival_time": 0.1 * i, "kind": "generation" if i % 3 else "embedding",
             "input_tokens": 50 + i, "output_tokens": 5 + i % 4} for i in range(30)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    result = simulate(parse_scenario(base(kind="trace", trace=str(trace))), "orthrus")
    issued = sorted(result.requests, key=lambda r: r["arrival_s"])  # rows come as they finish
    assert [r["arrival_s"] for r in issued] == pytest.approx([r["arrival_time"] for r in rows])
    assert [r["input_tokens"] for r in issued] == [r["input_tokens"] for r in rows]
    gens = [r for r in issued if r["kind"] == "generation"]
    assert [g["output_tokens"] for g in gens] == [r["output_tokens"] for r in rows
                                                   if r["kind"] == "generation"]
    csv_trace = tmp_path / "t.csv"
    csv_trace.write_text("arrival_time,kind,input_tokens,output_tokens\n0,video,5,1\n")
    with pytest.raises(ValueError, match="t.csv, line 2, column kind: must be embedding or generation"):
        simulate(parse_scenario(base(kind="trace", trace=str(csv_trace))), "orthrus")


def test_gamma_arrivals_match_rate_and_burstiness():
    raw = base(arrival={"process": "gamma", "rate": 20.0, "cv": 3.0}, generation_share=0.0)
    raw["num_requests"] = 4000
    result = simulate(parse_scenario(raw), "orthrus")
    arrivals = np.array(sorted(r["arrival_s"] for r in result.requests))
    gaps = np.diff(arrivals)
    assert 1 / gaps.mean() == pytest.approx(20.0, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.2)


def test_empirical_lengths_come_from_the_file(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("17\n33\n65\n")
    raw = base(arrival={"process": "closed-loop", "clients": 4}, generation_share=0.0,
               embedding_input={"dist": "empirical", "path": str(f)})
    raw["num_requests"] = 200
    result = simulate(parse_scenario(raw), "orthrus")
    assert {r["input_tokens"] for r in result.requests} == {17, 33, 65}
    with pytest.raises(ValueError, match="does not exist"):
        parse_scenario(base(embedding_input={"dist": "empirical", "path": str(tmp_path / "no")}))


def test_count_phases_change_the_mix():
    raw = base(arrival={"process": "closed-loop", "clients": 8},
               phases=[{"requests": 300, "generation_share": 0.0},
                       {"requests": 300, "generation_share": 1.0}],
               generation_output={"dist": "fixed", "value": 4})
    result = simulate(parse_scenario(raw), "orthrus")
    phases = result.metrics["phases"]
    assert [p["issued"] for p in phases] == [300, 300]
    kinds = [{r["kind"] for r in result.requests if r["phase"] == i} for i in (0, 1)]
    assert kinds == [{"embedding"}, {"generation"}]
    assert all(p["completion_s"] > 0 for p in phases)


def test_least_work_router_balances_better_than_round_robin_under_skew():
    raw = base(arrival={"process": "poisson", "rate": 40.0}, generation_share=1.0,
               generation_prompt={"dist": "lognormal", "median": 200, "sigma": 1.2, "max": 4000},
               generation_output={"dist": "lognormal", "median": 100, "sigma": 1.2, "max": 2000})
    raw.update(duration_s=60, cluster={"gpus": 4})
    p99 = {}
    for router in ("round-robin", "least-work"):
        raw["cluster"]["router"] = router
        p99[router] = simulate(parse_scenario(raw), "orthrus").metrics["latency_s"]["generation"]["p99"]
    assert p99["least-work"] <= p99["round-robin"] * 1.05


@pytest.mark.parametrize("raw", [
    {"name": "x", "duration_s": 1.0, "scheduler": {"num_blocks": 4},
     # four chunks of 512: the first three's keys and values need 96 blocks (a one-chunk
     # embedding would need none and be served)
     "workload": {"generation_share": 0.0, "arrival": {"process": "closed-loop", "clients": 1},
                  "embedding_input": {"dist": "fixed", "value": 2000}},
     "configurations": ["orthrus"]},
    {"name": "x", "duration_s": 1.0,
     "workload": {"generation_share": 0.0, "arrival": {"process": "closed-loop", "clients": 3}},
     "configurations": ["unified:generation"]},
], ids=["kv-too-small", "no-replica-serves-it"])
def test_a_workload_whose_every_request_is_rejected_ends_and_says_so(raw):
    """Defect: a closed-loop client (think time 0) whose request was rejected issued the next at
    the same simulated instant, for ever, and memory grew without bound."""
    from orthrus_sim.experiment.workload import MAX_ZERO_TIME_REJECTIONS

    result = simulate(parse_scenario(raw), raw["configurations"][0])
    m = result.metrics
    clients = raw["workload"]["arrival"]["clients"]
    assert m["rejected"]["embedding"] == clients * MAX_ZERO_TIME_REJECTIONS
    assert m["completed"]["embedding"] == 0
    assert any("requests in a row were rejected" in w for w in m["warnings"])
    assert any("no request completed" in w for w in m["warnings"])
    reasons = {r["reject_reason"] for r in result.requests}
    assert len(reasons) == 1 and ("KV blocks" in next(iter(reasons))
                                  or "does not serve embedding" in next(iter(reasons)))


def test_per_type_pools_and_ramp():
    """Per-type closed-loop pools keep each type's own load: embedding throughput no longer
    follows the generation side (one mixed pool ties them to the mix)."""
    raw = base(pools=[{"kind": "embedding", "process": "closed-loop", "clients": 8, "ramp_s": 2.0},
                      {"kind": "generation", "process": "closed-loop", "clients": 4,
                       "think_time_s": 0.5}],
               generation_output={"dist": "fixed", "value": 64})
    raw.update(duration_s=20, warmup_s=2)
    result = simulate(parse_scenario(raw), "orthrus")
    rows = result.requests
    firsts = sorted(min(r["arrival_s"] for r in rows if r["request_id"].split("-")[1] == f"p0c{c}")
                    for c in range(8))
    assert firsts == pytest.approx([2.0 * c / 8 for c in range(8)])  # the ramp
    gen_clients = {r["request_id"].split("-")[1] for r in rows if r["kind"] == "generation"}
    emb_clients = {r["request_id"].split("-")[1] for r in rows if r["kind"] == "embedding"}
    assert gen_clients == {f"p1c{c}" for c in range(4)} and emb_clients == {f"p0c{c}" for c in range(8)}
    m = result.metrics
    assert m["throughput_rps"]["embedding"] > 5 * m["throughput_rps"]["generation"]


def test_time_phases_bring_their_own_pools():
    raw = base(phases=[{"duration_s": 5, "pools": [{"kind": "embedding", "process": "poisson",
                                                    "rate": 50}]},
                       {"duration_s": 5, "pools": [{"kind": "generation", "process": "poisson",
                                                    "rate": 20}]}],
               generation_output={"dist": "fixed", "value": 8})
    result = simulate(parse_scenario(raw), "orthrus")
    early = {r["kind"] for r in result.requests if r["arrival_s"] < 5}
    late = {r["kind"] for r in result.requests if r["arrival_s"] >= 5}
    assert early == {"embedding"} and late == {"generation"}


def test_latency_counts_requests_that_arrive_in_the_window():
    """Percentiles over requests that arrive after the warm-up: the synchronised start of
    closed-loop clients is out of them."""
    raw = base(arrival={"process": "closed-loop", "clients": 64}, generation_share=1.0,
               generation_output={"dist": "fixed", "value": 32})
    raw.update(duration_s=30, warmup_s=10)
    result = simulate(parse_scenario(raw), "orthrus")
    in_window = [r for r in result.requests if r["arrival_s"] >= 10 and r["latency_s"] is not None
                 and r["finished_s"] <= 30]
    m = result.metrics
    assert m["latency_s"]["generation"]["count"] == len(in_window)
    assert m["latency_s"]["ttft"]["p99"] == pytest.approx(np.percentile(
        [r["first_token_s"] - r["arrival_s"] for r in in_window], 99))


def test_short_window_and_few_completions_warn():
    raw = base(arrival={"process": "closed-loop", "clients": 4}, generation_share=1.0,
               generation_output={"dist": "fixed", "value": 2000})
    raw.update(duration_s=20)
    warnings = simulate(parse_scenario(raw), "orthrus").metrics["warnings"]
    assert any("shorter than 3 mean generation latencies" in w or "too few samples" in w
               for w in warnings), warnings


def test_bare_split_names_are_refused():
    with pytest.raises(ValueError, match="name the split it compares, e.g. dedicated-1:3"):
        parse_scenario(base() | {"configurations": ["dedicated"], "duration_s": 1})


def test_trace_errors_name_file_and_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_time": 0, "kind": "embedding", "input_tokens": 5}\n{"arrival_time": 1,')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: not valid JSON"):
        parse_scenario(base(kind="trace", trace=str(bad)) | {"duration_s": 1})
    empty = tmp_path / "empty.csv"
    empty.write_text("arrival_time,kind,input_tokens,output_tokens\n")
    with pytest.raises(ValueError, match="holds no requests"):
        parse_scenario(base(kind="trace", trace=str(empty)))
    neg = tmp_path / "neg.csv"
    neg.write_text("arrival_time,kind,input_tokens,output_tokens\n-1,embedding,5,\n")
    with pytest.raises(ValueError, match=r"neg.csv, line 2, column arrival_time: must be a finite"):
        parse_scenario(base(kind="trace", trace=str(neg)))


def test_paths_resolve_from_the_scenario_file(tmp_path, monkeypatch):
    import yaml

    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "lens.txt").write_text("7\n9\n")
    (folder / "t.jsonl").write_text('{"arrival_time": 0, "kind": "embedding", "input_tokens": 5}\n')
    (folder / "s.yaml").write_text(yaml.safe_dump(base(
        embedding_input={"dist": "empirical", "path": "lens.txt"}, kind="trace", trace="t.jsonl")))
    monkeypatch.chdir(tmp_path)
    sc = load_scenario(folder / "s.yaml")
    assert Path(sc.workload.trace) == folder / "t.jsonl"
    # no calibration named: the one shipped for its hardware, not a file beside the scenario
    assert sc.calibration == hardware_calibration(sc.hardware) is not None


def test_tokens_are_values():
    """``Tokens`` is a plain slotted class (one is made per request): it must still behave as
    the value it was as a frozen dataclass: equal by segments, hashable, lengths summed."""
    from orthrus_sim.experiment.workload import RequestSpec, Send, Tokens

    a, b = Tokens.seeded(7, 5), Tokens(((7, 0, 5),))
    assert a == b and hash(a) == hash(b) and len(a) == a.length == 5
    assert Tokens.seeded(7, 0) == Tokens() and Tokens().length == 0
    both = a + Tokens.seeded(9, 3)
    assert both.length == 8 and both.tail(4) == Tokens(((7, 4, 1), (9, 0, 3)))
    assert both.ids()[-3:] == Tokens.seeded(9, 3).ids() and a != Tokens.seeded(8, 5)
    spec = RequestSpec("r", None, both, 0, "c")
    assert spec.input_len == 8 and Send(spec).wait and spec.phase is None


def test_tokens_mixed_late_are_the_tokens_mixed_early():
    """A synthetic request's tokens are mixed from the client's prefix when first read
    (``Tokens.mixed``): the same value, hash, ids and pickled copy as mixing up front."""
    import pickle

    from orthrus_sim.experiment.workload import Tokens, mix, mix_on

    prefix = mix(1, 2, 3)
    late, early = Tokens.mixed(prefix, 41, 6), Tokens.seeded(mix_on(prefix, (41,)), 6)
    assert late.length == 6 and late._segments is None  # nothing mixed yet
    assert pickle.loads(pickle.dumps(late)) == early
    assert late == early and hash(late) == hash(early) and late.ids() == early.ids()
    assert (late + early).tail(7) == early.tail(1) + early
    assert Tokens.mixed(prefix, 41, 0) == Tokens() and Tokens.mixed(prefix, 42, 6) != early
