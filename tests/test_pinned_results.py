"""Every result stays the same for a seed: short runs of the shipped scenarios, pinned.

The simulator's speed work (docs/performance.md) must not change what it computes. Each case
below runs a shortened shipped scenario (every policy, both loops, preemption, a TPOT target
with the placement planner, workflows, Disagg-PD's transfers, phases) and compares a digest of
its metrics, request rows and timeline with the pinned one. A digest that moves means the
simulation computes something else: if that is intended, say why in the commit and pin the new
digest (``python tests/test_pinned_results.py`` prints them). Floats enter the digest at 10
significant digits, so a last-bit difference of a maths library cannot move a digest unless it
changes what happens.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from orthrus_sim.experiment.scenario import load_scenario
from orthrus_sim.sim.run import simulate

SHORT = ["duration_s=40", "warmup_s=10"]
CASES: dict[str, tuple[str, list[str], str]] = {
    "mix_sweep/orthrus": ("mix_sweep", SHORT, "orthrus"),
    "mix_sweep/unified-homo": ("mix_sweep", SHORT, "unified-homo"),
    "mix_sweep/unified-hetero": ("mix_sweep", SHORT, "unified-hetero"),
    "mix_sweep/dedicated-1:3": ("mix_sweep", SHORT, "dedicated-1:3"),
    "mix_sweep/disagg-pd-2:2": ("mix_sweep", SHORT, "disagg-pd-2:2"),
    "mix_sweep/adaptive-target": ("mix_sweep", SHORT + ["scheduler.tpot_target_s=0.03",
                                                        "cluster.router=adaptive"], "orthrus"),
    # the target with every iteration capped (no slack): as before the slack existed
    "mix_sweep/adaptive-target-strict": ("mix_sweep", SHORT + ["scheduler.tpot_target_s=0.03",
                                                               "scheduler.tpot_slack_iterations=0",
                                                               "cluster.router=adaptive"],
                                         "orthrus"),
    "mix_sweep/mixed-pool-reserve": ("mix_sweep", SHORT + ["workload.arrival.pools=mixed",
                                                           "scheduler.kv_admission=reserve"],
                                     "orthrus"),
    "kv_pressure/orthrus": ("kv_pressure", ["duration_s=150", "warmup_s=30"], "orthrus"),
    "iter_retgen/orthrus": ("iter_retgen", ["duration_s=150", "warmup_s=30"], "orthrus"),
    "phased/orthrus": ("phased", [], "orthrus"),
}

PINNED = {
    "iter_retgen/orthrus": "0a1a651628b7fd6af259",
    "kv_pressure/orthrus": "e3ab43ba456cd6f03743",
    "mix_sweep/adaptive-target": "7034711883067704a349",
    "mix_sweep/adaptive-target-strict": "8afa6e3bd955a1c136a7",
    "mix_sweep/dedicated-1:3": "f24b818227f590ae9977",
    "mix_sweep/disagg-pd-2:2": "f329f308b383cbd78a24",
    "mix_sweep/mixed-pool-reserve": "e8c37c7d5c5da20495fe",
    "mix_sweep/orthrus": "5dc656705559a62c922c",
    "mix_sweep/unified-hetero": "14778a0751443d372a03",
    "mix_sweep/unified-homo": "3e5ae927c416376fbe84",
    "phased/orthrus": "9a6faa6c0d6f17d9d046",
}


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.10g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def digest(name: str) -> str:
    scenario, overrides, configuration = CASES[name]
    result = simulate(load_scenario(scenario, overrides), configuration)
    metrics = {k: v for k, v in result.metrics.items() if k != "sim_wall_s"}
    doc = _rounded([metrics, result.requests, result.timeline])
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:20]


@pytest.mark.parametrize("name", sorted(CASES))
def test_results_are_pinned(name):
    assert digest(name) == PINNED[name], (
        f"{name}: the simulation computes something else than before; if intended, explain it "
        "in the commit and pin the new digest (python tests/test_pinned_results.py)")


if __name__ == "__main__":
    for case in sorted(CASES) if len(sys.argv) < 2 else sys.argv[1:]:
        print(f'    "{case}": "{digest(case)}",', flush=True)
