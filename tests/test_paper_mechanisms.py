"""The mechanisms the paper's baselines needed (docs/paper.md, docs/fitting.md's parameters):
a shared front end, a stock embedding server's own costs (device scale, padded batches,
per-request overhead, batch budget), the adapter's cost on generation rows, and joint fits
across scenario files. Each is neutral by default; each test fails if its mechanism goes."""

from __future__ import annotations

from pathlib import Path

import pytest

from orthrus_sim.costmodel import (
    CostModel,
    LoRASpec,
    get_hardware,
    get_model,
    load_calibration,
    save_calibration,
)
from orthrus_sim.costmodel.calibration import CostFactorsModel
from orthrus_sim.costmodel.factors import CostFactors, FactoredCostModel, apply_factors, padded
from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.experiment.measured import load_measured, measured_under
from orthrus_sim.experiment.plan import plan_configuration
from orthrus_sim.experiment.scenario import load_scenario, parse_scenario, scenario_dump
from orthrus_sim.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
PRIOR = ROOT / "calibration" / "cpu-2core-small.json"


def calibration(tmp_path: Path, **factors) -> str:
    path = tmp_path / ("cal-" + "-".join(f"{k}={v}" for k, v in sorted(factors.items())) + ".json")
    cal = load_calibration(PRIOR)
    save_calibration(cal.model_copy(update={"factors": CostFactorsModel(**factors)}), path)
    return str(path)


def scenario(cal: str, share: float = 0.5, **cluster) -> dict:
    return {
        "name": "mechanisms", "seed": 2, "duration_s": 20, "warmup_s": 4,
        "hardware": "cpu-2core", "model": "orthrus-small", "calibration": cal,
        "cluster": {"gpus": 2, **cluster},
        "scheduler": {"token_budget": 1024, "chunk_size": 256, "max_num_seqs": 32},
        "workload": {"arrival": {"process": "closed-loop", "pools": "mixed", "clients": 16},
                     "generation_share": share,
                     "embedding_input": {"dist": "uniform", "low": 16, "high": 256},
                     "generation_prompt": {"dist": "fixed", "value": 64},
                     "generation_output": {"dist": "fixed", "value": 16}},
        "configurations": ["dedicated-1:1"],
    }


def run(raw: dict, configuration: str = "dedicated-1:1") -> dict:
    return simulate(parse_scenario(raw), configuration, keep_rows=False).metrics


def test_a_shared_front_end_queues_both_kinds_behind_each_other(tmp_path):
    cal = calibration(tmp_path, embedding_overhead_s=0.1, generation_overhead_s=0.1)
    own = run(scenario(cal))["throughput_rps"]
    shared = run(scenario(cal, front_end="shared"))["throughput_rps"]
    # one 100 ms front end for the cluster: at most 10 requests/s of both kinds together
    assert shared["combined"] <= 10.3
    assert own["combined"] > 1.3 * shared["combined"]  # two front ends, one per replica
    with pytest.raises(ValueError, match="front_end"):
        parse_scenario(scenario(cal, front_end="one"))


def test_the_stock_embedding_servers_overhead_is_its_own(tmp_path):
    cal = calibration(tmp_path, stock_embedding_overhead_s=0.1)
    split = run(scenario(cal, front_end="shared"))["throughput_rps"]
    assert split["embedding"] <= 10.5  # 100 ms each, on the front end the split's embeddings pass
    unified = scenario(cal, front_end="shared") | {"configurations": ["orthrus"]}
    neutral = scenario(calibration(tmp_path), front_end="shared") | {"configurations": ["orthrus"]}
    # Orthrus's embeddings do not pay it: the same run as without it
    assert run(unified, "orthrus")["throughput_rps"] == run(neutral, "orthrus")["throughput_rps"]


def test_padding_prices_a_stock_batch_as_its_longest_input():
    base = CostModel(get_hardware("cpu-2core"), get_model("orthrus-small"))
    shape = BatchShape.from_items([(0, 16, 0), (0, 256, 0)])
    assert padded(shape, 256, 0.0) == shape
    full = padded(shape, 256, 1.0)
    assert (full.tokens, full.num_seqs) == (512, 2)
    assert full.chunk_pairs == pytest.approx(2 * 256 * 257 / 2)
    assert base.shape_time(full) > 1.5 * base.shape_time(shape)


def test_a_padded_stock_server_serves_mixed_lengths_slower(tmp_path):
    vllm = run(scenario(calibration(tmp_path), share=0.1))["throughput_rps"]["embedding"]
    cal = calibration(tmp_path, stock_embedding_padding=1.0, stock_embedding_scale=4.0)
    plain = run(scenario(calibration(tmp_path, stock_embedding_scale=4.0), share=0.1))
    pads = run(scenario(cal, share=0.1))
    assert plain["throughput_rps"]["embedding"] < vllm
    assert pads["throughput_rps"]["embedding"] < 0.85 * plain["throughput_rps"]["embedding"]


def test_stock_terms_reach_only_a_splits_embedding_replica():
    raw = scenario(str(PRIOR)) | {"configurations": ["dedicated-1:1", "orthrus", "disagg-pd-1:1"]}
    sc = parse_scenario(raw)
    hw = get_hardware(sc.hardware)
    factors = CostFactors(stock_embedding_scale=3.0, adapter_scale=2.0)
    shape = BatchShape.from_items([(0, 128, 0)])
    decode = BatchShape.from_items([(2, 1, 100)] * 4)
    for name in ("dedicated-1:1", "orthrus", "disagg-pd-1:1"):
        for plan in plan_configuration(sc, name):
            base = plan.cost_model(hw, load_calibration(PRIOR).to_coefficients())
            cost = apply_factors(base, factors, plan.stock)
            emb = 3.0 if plan.role == "embedding" else 1.0
            adapter = 2.0 if plan.lora is not None else 1.0
            assert cost.shape_time(shape) == pytest.approx(emb * base.shape_time(shape))
            assert cost.shape_time(decode) == pytest.approx(adapter * base.shape_time(decode))


def test_the_adapter_scale_slows_generation_rows_of_an_adapter_replica_only():
    base = CostModel(get_hardware("cpu-2core"), get_model("orthrus-small"), lora=LoRASpec(16))
    wrapped = FactoredCostModel(base, CostFactors(adapter_scale=1.5))
    emb = BatchShape.from_items([(0, 200, 0)])
    decode = BatchShape.from_items([(2, 1, 100)] * 8)
    assert wrapped.shape_time(emb) == pytest.approx(base.shape_time(emb))
    assert wrapped.shape_time(decode) == pytest.approx(1.5 * base.shape_time(decode))
    assert wrapped.decode_step_times(decode, 3) == pytest.approx(
        [1.5 * t for t in base.decode_step_times(decode, 3)])
    plain = CostModel(get_hardware("cpu-2core"), get_model("orthrus-small"))
    assert apply_factors(plain, CostFactors(adapter_scale=1.5)) is plain


def test_the_stock_servers_budget_is_its_own(tmp_path):
    raw = scenario(str(PRIOR))
    raw["scheduler"] |= {"embedding_token_budget": 4096}
    plans = plan_configuration(parse_scenario(raw), "dedicated-1:1")
    assert [p.config.token_budget for p in plans] == [4096, 1024]
    assert [p.config.token_budget for p in plan_configuration(parse_scenario(scenario(str(PRIOR))),
                                                              "dedicated-1:1")] == [1024, 1024]


def test_new_factors_are_neutral_and_checked():
    assert CostFactors().seen_by(True, True) == CostFactors()
    seen = CostFactors(adapter_scale=2.0, stock_embedding_padding=0.5).seen_by(False, False)
    assert seen == CostFactors()
    with pytest.raises(ValueError, match="stock_embedding_padding"):
        CostFactors(stock_embedding_padding=1.5)
    with pytest.raises(ValueError, match="adapter_scale"):
        CostFactors(adapter_scale=0.0)


def test_a_run_measured_under_another_scenario_file():
    base = scenario_dump(load_scenario("paper/mix_sweep"))
    raw = measured_under(base, ["scenario=paper/iter_retgen", "cluster.gpus=1"])
    assert raw["workload"]["kind"] == "iter-retgen" and raw["cluster"]["gpus"] == 1
    assert measured_under(base, ["workload.generation_share=0.1"])["workload"][
        "generation_share"] == 0.1
    with pytest.raises(ValueError, match="scenario_overrides 'scenario=nowhere'"):
        measured_under(base, ["scenario=nowhere"])
    with pytest.raises(ValueError, match="given 2 times"):
        measured_under(base, ["scenario=paper/iter_retgen", "scenario=paper/mix_sweep"])


def test_the_papers_baselines_load_with_their_scenarios():
    runs = load_measured([ROOT / "scenarios" / "paper" / "baselines.yaml"])
    assert len(runs) == 7 and sum(len(r.metrics) for r in runs) == 13
    for r in runs:
        raw = measured_under(scenario_dump(load_scenario("paper/mix_sweep")), r.overrides)
        parse_scenario(raw | {"configurations": [r.configuration]})


def test_a_case_is_simulated_at_the_factors_it_pays(tmp_path):
    from orthrus_sim.questions.evaluation import Simulations

    raw = scenario(str(PRIOR)) | {"duration_s": 6, "warmup_s": 1,
                                  "configurations": ["dedicated-1:1", "orthrus"]}
    cases = [((), "dedicated-1:1"), ((), "orthrus")]
    with Simulations(parse_scenario(raw), load_calibration(PRIOR), cases, 1, tmp_path) as sims:
        base = sims.simulate([CostFactors()])[0]
        assert sims.simulations == 2
        adapter = sims.simulate([CostFactors(adapter_scale=1.5)])[0]
        assert sims.simulations == 3  # the split loads no adapter: its run is reused
        assert adapter[(), "dedicated-1:1"] is base[(), "dedicated-1:1"]
        stock = sims.simulate([CostFactors(stock_embedding_scale=2.0)])[0]
        assert sims.simulations == 4  # Orthrus has no stock embedding server
        assert stock[(), "orthrus"] is base[(), "orthrus"]
        assert stock[(), "dedicated-1:1"]["throughput_rps"] != base[(), "dedicated-1:1"][
            "throughput_rps"]
