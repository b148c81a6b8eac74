"""Bursty open loops: MMPP and diurnal rates hold their mean, repeat per seed, and a correlated
group's kinds burst together while independent ones do not."""

from __future__ import annotations

import numpy as np
import pytest

from orthrus_sim.experiment.arrivals import Modulation, arrival_times, mean_rate
from orthrus_sim.experiment.scenario import Pool, parse_scenario
from orthrus_sim.experiment.workload import Send, WaitUntil, Workload

MMPP = {"process": "mmpp", "rate": 20.0, "off_rate": 2.0, "on_s": 10.0, "off_s": 30.0}


def draw(pool: Pool, horizon: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mod = Modulation(pool.on_s, pool.off_s, np.random.default_rng([seed, 1])) \
        if pool.process == "mmpp" else None
    out = []
    for t in arrival_times(pool, rng, 0.0, 1.0, mod):
        if t >= horizon:
            break
        out.append(t)
    return np.array(out)


def test_mmpp_mean_rate_and_burstiness():
    pool = Pool(kind="generation", **MMPP)
    assert mean_rate(pool) == 6.5  # (20 x 10 + 2 x 30) / 40
    times = draw(pool, 40_000.0)
    assert len(times) / 40_000.0 == pytest.approx(6.5, rel=0.05)
    per_s = np.bincount(times.astype(int))
    assert per_s.std() ** 2 > 5 * per_s.mean()  # far burstier than Poisson (variance = mean)


def test_diurnal_mean_rate_and_shape():
    sine = Pool(kind="generation", process="diurnal", rate=10.0, amplitude=0.8, period_s=100.0)
    times = draw(sine, 20_000.0)
    assert len(times) / 20_000.0 == pytest.approx(10.0, rel=0.03)
    within = (times % 100.0)
    peak, trough = np.sum((within > 15) & (within < 35)), np.sum((within > 65) & (within < 85))
    assert peak > 5 * trough  # 1.8x the mean at the crest against 0.2x
    steps = Pool(kind="embedding", process="diurnal", rate=10.0, period_s=100.0, profile=[1, 3])
    times = draw(steps, 20_000.0)
    assert len(times) / 20_000.0 == pytest.approx(10.0, rel=0.03)
    first = np.sum(times % 100.0 < 50.0) / 10_000.0
    assert first == pytest.approx(5.0, rel=0.05)


def _arrivals(raw: dict, horizon: float) -> dict[str, list[float]]:
    """Each kind's arrival times from the scenario's sources, run without a simulator."""
    sc = parse_scenario(raw)
    now = [0.0]
    work = Workload(sc, lambda: now[0])
    out: dict[str, list[float]] = {"embedding": [], "generation": []}
    for _, client in work.clients():
        now[0] = 0.0
        action = next(client)
        while True:
            if isinstance(action, WaitUntil):
                now[0] = action.time
            elif isinstance(action, Send):
                out[action.spec.kind.value].append(action.spec.intended_at)
            try:
                action = client.send(None)
            except StopIteration:
                break
            if now[0] > horizon:
                break
    return out


def scenario(correlate: str | None, seed: int = 3) -> dict:
    pools = [{"kind": k, **MMPP, "correlate": correlate} for k in ("embedding", "generation")]
    return {"name": "b", "seed": seed, "duration_s": 4000, "workload": {"pools": pools}}


def test_correlated_kinds_burst_together_and_runs_repeat_per_seed():
    def corr(arrivals):
        e, g = (np.bincount(np.array(arrivals[k]).astype(int), minlength=4001)[:4000]
                for k in ("embedding", "generation"))
        return np.corrcoef(e, g)[0, 1]

    together = _arrivals(scenario("both"), 4000)
    apart = _arrivals(scenario(None), 4000)
    assert corr(together) > 0.6 and abs(corr(apart)) < 0.2
    assert _arrivals(scenario("both"), 500) == _arrivals(scenario("both"), 500)
    assert _arrivals(scenario("both", seed=4), 500) != _arrivals(scenario("both"), 500)


def test_bursty_pools_are_checked():
    with pytest.raises(ValueError, match="process 'mmpp' needs on_s and off_s"):
        Pool(kind="generation", process="mmpp", rate=3.0)
    with pytest.raises(ValueError, match="process 'diurnal' needs period_s"):
        Pool(kind="generation", process="diurnal", rate=3.0)
    raw = scenario("g")
    raw["workload"]["pools"][1]["on_s"] = 5.0
    with pytest.raises(ValueError, match="correlate group 'g' shares one on/off sequence"):
        parse_scenario(raw)
