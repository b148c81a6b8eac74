"""SLOs: the scenario section, attainment and goodput in the results, the table's columns."""

from __future__ import annotations

import pytest

from orthrus_sim.engine.request import Request, RequestKind, RequestState
from orthrus_sim.experiment.results import RequestLog, comparison_rows, window_warnings
from orthrus_sim.experiment.scenario import SloSection, parse_scenario
from orthrus_sim.sim.run import simulate
from tests.helpers import slo_from_rows


def _raw(**extra) -> dict:
    raw = {"name": "slo", "seed": 5, "num_requests": 200, "cluster": {"gpus": 1},
           "configurations": ["orthrus"],
           "workload": {"pools": [{"kind": "embedding", "process": "poisson", "rate": 40},
                                  {"kind": "generation", "process": "poisson", "rate": 8}],
                        "embedding_input": {"dist": "uniform", "low": 16, "high": 600},
                        "generation_prompt": {"dist": "fixed", "value": 128},
                        "generation_output": {"dist": "uniform", "low": 1, "high": 64}}}
    raw.update(extra)
    return raw


@pytest.mark.parametrize("slo, field, words", [
    ({}, "slo", "at least one of ttft_s"),
    ({"ttft_s": 0}, "slo.ttft_s", "greater than 0"),
    ({"latency_s": -1.0}, "slo.latency_s", "greater than 0"),
    ({"tpot": 0.1}, "slo.tpot", "Extra inputs"),
    ({"e2e_s": "soon"}, "slo.e2e_s", "valid number"),
])
def test_bad_slo_section_names_the_field(slo, field, words):
    with pytest.raises(ValueError) as err:
        parse_scenario(_raw(slo=slo))
    line = next(ln for ln in str(err.value).splitlines() if ln.strip().startswith(field + ":"))
    assert words in line


def test_any_subset_of_bounds_per_kind():
    sc = parse_scenario(_raw(slo={"tpot_s": 0.05, "latency_s": 0.5}))
    assert sc.slo.bounds("generation") == {"tpot_s": 0.05}
    assert sc.slo.bounds("embedding") == {"latency_s": 0.5}
    assert parse_scenario(_raw()).slo is None


def _gen(rid, arrival, first, finished, n, max_out=8, state=RequestState.FINISHED) -> Request:
    req = Request(rid, RequestKind.GENERATION, arrival, 16, max_output_tokens=max_out)
    req.first_token_at, req.finished_at, req.num_generated, req.state = first, finished, n, state
    return req


def _emb(rid, arrival, finished, state=RequestState.FINISHED) -> Request:
    req = Request(rid, RequestKind.EMBEDDING, arrival, 16)
    req.finished_at, req.state = finished, state
    return req


def test_attainment_goodput_and_tpot_as_vllm_defines_it():
    """TPOT = (e2e - ttft) / (outputs - 1); a request counts for goodput only when it finished
    and met every bound of its kind; rejected and in-flight-past-deadline requests miss."""
    slo = SloSection(ttft_s=1.0, tpot_s=0.1, e2e_s=5.0, latency_s=0.5)
    log = RequestLog(start=10.0, end_hint=None, slo=slo)
    reqs = [
        _gen("ok", 10, 10.5, 11.2, 8),      # ttft 0.5, tpot 0.7/7 = 0.1: met (bounds inclusive)
        _gen("slow-tpot", 10, 10.5, 12.0, 8),  # tpot 1.5/7 > 0.1
        _gen("slow-ttft", 11, 12.5, 12.6, 2),  # ttft 1.5
        _gen("one-token", 12, 12.2, 12.2, 1, max_out=1),  # no TPOT: meets it
        _gen("warm-up", 6, 6.1, 10.5, 100, max_out=100),  # before the window: goodput only
        _emb("e-ok", 10, 10.4),
        _emb("e-slow", 10, 10.6),
    ]
    rejected = _emb("e-rej", 11, 11.0, state=RequestState.REJECTED)
    for r in reqs + [rejected]:
        log.sent(r)
    for r in reqs + [rejected]:
        log.ended(r)
    stuck = _gen("stuck", 13, None, None, 0, state=RequestState.WAITING)  # never finishes
    log.sent(stuck)
    m = log.close(20.0)
    s = m["slo"]
    assert s["generation"]["met"] == 2 and s["generation"]["missed"] == 3  # + stuck past e2e
    assert s["generation"]["attainment"] == pytest.approx(2 / 5)
    assert s["embedding"]["met"] == 1 and s["embedding"]["missed"] == 2
    assert s["generation"]["goodput_rps"] == pytest.approx(3 / 10)  # ok, one-token, warm-up
    assert s["embedding"]["goodput_rps"] == pytest.approx(1 / 10)
    assert s["combined"]["goodput_rps"] == pytest.approx(4 / 10)
    assert s["combined"]["attainment"] == pytest.approx(3 / 8)
    assert s["generation"]["within"]["tpot_s"] == pytest.approx(3 / 4)  # of 4 finished in window
    assert m["latency_s"]["tpot"]["count"] == 3  # the one-token output has no TPOT sample
    assert s["targets"] == {"generation": {"ttft_s": 1.0, "tpot_s": 0.1, "e2e_s": 5.0},
                            "embedding": {"latency_s": 0.5}}


def test_a_cut_run_counts_a_request_only_once_its_fate_is_known():
    """With duration_s, a request whose deadline falls after the end is 'late' (left out, met or
    not); an earlier one still in flight missed; without a deadline (tpot only) one in flight
    with no bound broken is undetermined, and a warning says so."""
    log = RequestLog(start=0.0, end_hint=10.0, slo=SloSection(e2e_s=2.0, latency_s=1.0))
    done_late = _gen("fast-but-late", 9.0, 9.1, 9.5, 2)  # met, but its deadline 11 > 10
    done = _gen("done", 1.0, 1.1, 1.5, 2)
    for r in (done_late, done):
        log.sent(r)
        log.ended(r)
    for r in (_gen("in-flight-missed", 7.0, None, None, 0, state=RequestState.WAITING),
              _emb("e-in-flight-late", 9.5, None, state=RequestState.WAITING)):
        log.sent(r)
    s = log.close(10.0)["slo"]
    assert (s["generation"]["met"], s["generation"]["missed"], s["generation"]["late"]) == (1, 1, 1)
    assert (s["embedding"]["met"], s["embedding"]["missed"], s["embedding"]["late"]) == (0, 0, 1)
    assert s["embedding"]["attainment"] is None

    log = RequestLog(start=0.0, end_hint=10.0, slo=SloSection(tpot_s=0.1))
    running = _gen("running", 9.0, 9.2, None, 3, max_out=100, state=RequestState.RUNNING)
    broke = _gen("broke", 1.0, 1.2, None, 3, max_out=10, state=RequestState.RUNNING)  # 8.8/9 > 0.1
    for r in (running, broke):
        log.sent(r)
    m = log.close(10.0)
    assert m["slo"]["generation"]["undetermined"] == 1 and m["slo"]["generation"]["missed"] == 1
    assert any("no SLO yet broken" in w for w in window_warnings(m))


def test_simulated_attainment_matches_the_per_request_rows():
    slo = {"ttft_s": 0.4, "tpot_s": 0.06, "e2e_s": 2.5, "latency_s": 0.3}
    sc = parse_scenario(_raw(slo=slo, warmup_s=0.5))
    res = simulate(sc, "orthrus")
    s = res.metrics["slo"]
    expected = slo_from_rows(res.requests, slo, start=0.5)
    for kind in ("embedding", "generation"):
        met, counted = expected[kind]
        assert (s[kind]["met"], s[kind]["met"] + s[kind]["missed"]) == (met, counted)
        assert s[kind]["late"] == s[kind]["undetermined"] == 0  # a run to completion
        assert 0 < met < counted  # the bounds bite, but not always
    thr = res.metrics["throughput_rps"]
    assert s["combined"]["goodput_rps"] < thr["combined"]
    for kind in ("embedding", "generation"):
        assert s[kind]["goodput_rps"] <= thr[kind]
    row = comparison_rows([{"configuration": "orthrus", "metrics": res.metrics}])[0]
    assert row["goodput/s"] == s["combined"]["goodput_rps"]
    assert row["SLO gen"] == s["generation"]["attainment"]
    plain = simulate(parse_scenario(_raw()), "orthrus").metrics
    assert plain["slo"] is None
    assert "goodput/s" not in comparison_rows([{"configuration": "orthrus", "metrics": plain}])[0]
