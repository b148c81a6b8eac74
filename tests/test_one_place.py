"""Logic that was written twice now lives once (issue 25): the workload's action interpreter,
the measurement window, the process pool, the file-name rule, the percentile summary."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from orthrus_sim import safe_name
from orthrus_sim.engine.request import RequestKind
from orthrus_sim.experiment.quantiles import Quantiles, summarize, summary
from orthrus_sim.experiment.results import MeasurementWindow
from orthrus_sim.experiment.workload import (
    Outcome,
    RequestSpec,
    Retrieve,
    Send,
    Spawn,
    Tokens,
    Wait,
    WaitUntil,
    interpret,
    run_async,
)
from orthrus_sim.questions.run import in_processes


def spec(i: int) -> RequestSpec:
    return RequestSpec(f"r{i}", RequestKind.EMBEDDING, Tokens.seeded(i, 8), 0, "c")


class ListHost:
    """A host that records what it is asked; its waitables are plain tuples."""

    def __init__(self) -> None:
        self.clock = 10.0
        self.log: list = []

    def now(self) -> float:
        return self.clock

    def issue(self, send):
        self.log.append(("send", send.spec.request_id))
        return ("outcome", send.spec.request_id) if send.wait else None

    def sleep(self, seconds):
        self.log.append(("sleep", seconds))
        return ("sleep", seconds)

    def spawn(self, client):
        self.log.append(("spawn", client))

    def retrieve(self, action):
        return list(action.fallback)


def client_script(seen: list):
    seen.append((yield Send(spec(1))))
    seen.append((yield Send(spec(2), wait=False)))
    yield Wait(0.5)
    yield WaitUntil(3.0)  # in the past: no sleep
    yield WaitUntil(12.0)
    yield Spawn("other", "child")
    seen.append((yield Retrieve(None, 2, (4, 7))))


def test_interpret_carries_out_every_action_through_its_host():
    host, seen = ListHost(), []
    steps = interpret(client_script(seen), host)
    waited = []
    value = None
    while True:
        try:
            waitable = steps.send(value)
        except StopIteration:
            break
        waited.append(waitable)
        value = Outcome("finished") if waitable[0] == "outcome" else None
    assert waited == [("outcome", "r1"), ("sleep", 0.5), ("sleep", 2.0)]
    assert host.log == [("send", "r1"), ("send", "r2"), ("sleep", 0.5), ("sleep", 2.0),
                        ("spawn", "child")]
    assert seen == [Outcome("finished"), None, [4, 7]]
    with pytest.raises(TypeError, match="unknown workload action"):
        next(interpret((x for x in ["nonsense"]), host))


def test_run_async_awaits_each_waitable_and_sends_back_its_result():
    async def give(x):
        return x * 2

    got = []

    def steps():
        got.append((yield give(1)))
        got.append((yield give(5)))

    asyncio.run(run_async(steps()))
    assert got == [2, 10]


def test_measurement_window_opens_at_warmup_and_never_starts_after_the_end():
    w = MeasurementWindow(5.0, {"busy": 0.0})
    assert w.opening == {"busy": 0.0} and w.start(3.0) == 3.0 and w.start(9.0) == 5.0
    w.open({"busy": 2.0})
    assert w.opening == {"busy": 2.0}


def _square(x: int) -> int:
    if x == 3:
        raise ValueError("three")
    return x * x


def test_in_processes_yields_every_item_with_its_result_or_error():
    polled = []
    out = {}
    for item, future in in_processes(_square, [1, 2, 3], 2, poll=lambda: polled.append(1)):
        out[item] = future.exception() or future.result()
    assert out[1] == 1 and out[2] == 4 and isinstance(out[3], ValueError)
    assert polled


def test_one_file_name_rule():
    assert safe_name("unified:pkg/mod:Cls") == "unified_pkg_mod_Cls"
    assert safe_name("dedicated-1:3") == "dedicated-1_3"


def test_one_summary_shape_for_lists_sketches_and_histograms():
    from orthrus_real.measure.bench import histogram_summary

    values = list(np.random.default_rng(0).exponential(1.0, 500))
    q = Quantiles()
    for v in values:
        q.add(v)
    assert summary(values) == pytest.approx(q.summary())
    empty = summarize(0, None, lambda p: None)
    assert summary([]) == empty == Quantiles().summary()
    before = {}
    after = {'h_bucket{k="a",le="1.0"}': 4.0, 'h_bucket{k="a",le="2.0"}': 8.0,
             'h_bucket{k="a",le="+Inf"}': 8.0, 'h_sum{k="a"}': 10.0}
    got = histogram_summary(before, after, "h", 'k="a"')
    assert set(got) == set(empty) and got["count"] == 8 and got["mean"] == 1.25
    assert got["p50"] == pytest.approx(1.0) and got["p99"] == pytest.approx(1.98)
    assert histogram_summary(before, {}, "h", 'k="a"') == empty


def test_dead_code_is_gone():
    from orthrus_real.server.api import bodies
    from orthrus_sim.costmodel.coefficients import Coefficients
    from orthrus_sim.engine import BatchItem, BlockManager, Request
    from orthrus_sim.experiment import scenario, workload

    gone = [(scenario, "PROCESSES"), (workload.Workload, "end_time"), (Request, "is_done"),
            (BatchItem, "is_last_chunk"), (BlockManager, "can_hold"), (Coefficients, "with_ops"),
            (bodies, "CHAT_ROLES")]
    assert [name for owner, name in gone if hasattr(owner, name)] == []
