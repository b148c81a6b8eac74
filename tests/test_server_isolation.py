"""One request cannot break the server: a request whose rows make a step raise fails alone
(the PyTorch engine bisects the batch), an error the engine cannot attribute rebuilds it and
re-runs the requests in flight, and sampling is safe for every value validation accepts."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from tests.test_server import metric, start_server  # noqa: E402

MAGIC = 400  # a prompt token id the injected fault reacts to (no good request has it)


def good_requests():
    """20 requests of both kinds: (path, body)."""
    reqs = []
    for i in range(10):
        reqs.append(("/v1/embeddings", {"input": [[4 + i, 20, 30, 40], [7, 8 + i]]}))
        reqs.append(("/v1/completions", {"prompt": [5 + i, 9, 10, 11], "max_tokens": 6,
                                         "temperature": 0, "ignore_eos": True}))
    return reqs


def run_all(url, requests, watch_health=True):
    """Send ``requests`` concurrently while polling /health; the responses and the health codes."""
    health: list[int] = []

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            stop = asyncio.Event()

            async def poll():
                while not stop.is_set():
                    health.append((await c.get("/health")).status_code)
                    await asyncio.sleep(0.01)

            poller = asyncio.create_task(poll()) if watch_health else None
            out = await asyncio.gather(*(c.post(p, json=b) for p, b in requests))
            stop.set()
            if poller is not None:
                await poller
            return out

    return asyncio.run(go()), health


def results(responses):
    out = []
    for r in responses:
        assert r.status_code == 200, r.text
        body = r.json()
        if body["object"] == "list":
            out.append(np.array([d["embedding"] for d in body["data"]]))
        else:
            out.append(body["choices"][0]["text"])
    return out


def same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, str):
            assert x == y
        else:
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def isolated(tiny_models):
    url, runner = start_server(tiny_models["llama"], max_queued=256)
    baseline = results(run_all(url, good_requests(), watch_health=False)[0])
    return url, runner, baseline


def test_a_request_that_makes_the_step_raise_fails_alone(isolated):
    url, runner, baseline = isolated
    engine = runner.engine
    real_forward = engine.forward

    def faulty_forward(batch):  # any pass holding the bad request's tokens raises
        if any(MAGIC in it.request.token_ids for it in batch.items):
            raise RuntimeError("injected fault")
        return real_forward(batch)

    engine.forward = faulty_forward
    try:
        bad = [("/v1/completions", {"prompt": [MAGIC, 5, 6], "max_tokens": 40, "ignore_eos": True}),
               ("/v1/embeddings", {"input": [[8, 9, MAGIC]]})]
        # the values: tiny top_p and temperature pass validation and must sample safely
        tiny = [("/v1/completions", {"prompt": [6, 7], "max_tokens": 5, "top_p": 1e-46}),
                ("/v1/completions", {"prompt": [6, 7], "max_tokens": 5, "temperature": 1e-40})]
        good = good_requests()
        responses, health = run_all(url, bad + tiny + good)
    finally:
        engine.forward = real_forward
    for r in responses[:2]:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "injected fault" in err["message"]
    assert all(r.status_code == 200 for r in responses[2:4])
    same(results(responses[4:]), baseline)  # every good request, complete and correct
    assert health and set(health) == {200}
    assert runner.engine is engine and runner.rebuilds == 0  # found inside the step
    text = httpx.get(url + "/metrics").text
    assert metric(text, "orthrus_requests_total", '{kind="generation",outcome="failed"}') == 1
    assert metric(text, "orthrus_requests_total", '{kind="embedding",outcome="failed"}') == 1
    assert metric(text, "orthrus_kv_blocks_used") == 0
    assert httpx.get(url + "/health").status_code == 200


def test_an_unattributed_step_error_rebuilds_the_engine_and_reruns_the_rest(isolated, caplog):
    """An error escaping ``step`` (as the vLLM backend's core raises it): the engine is
    rebuilt, the requests in flight re-run one at a time, the one that fails alone is failed."""
    url, runner, baseline = isolated
    real_factory = runner.factory

    def poison(engine):
        real_step = engine.step

        def step():
            if any(MAGIC in r.token_ids for r in engine.policy.live()):
                raise RuntimeError("injected core fault")
            return real_step()

        engine.step = step
        return engine

    runner.factory = lambda: poison(real_factory())
    poison(runner.engine)
    try:
        bad = [("/v1/completions", {"prompt": [MAGIC, 5, 6], "max_tokens": 8, "ignore_eos": True})]
        with caplog.at_level("ERROR", logger="orthrus"):
            responses, health = run_all(url, bad + good_requests())
    finally:
        runner.factory = real_factory
    assert responses[0].status_code == 500 and "injected core fault" in responses[0].text
    same(results(responses[1:]), baseline)
    assert set(health) <= {200} and runner.rebuilds >= 1
    assert any(rec.exc_info and "injected core fault" in str(rec.exc_info[1])
               for rec in caplog.records)  # logged with its traceback
    assert httpx.get(url + "/health").status_code == 200
    assert runner.outstanding == 0 and not runner.probation and not runner.held


def test_streamed_requests_that_sent_tokens_fail_on_an_unattributed_error(isolated):
    url, runner, _ = isolated
    engine, real_step, steps = runner.engine, runner.engine.step, [0]
    seen = threading.Event()

    def step():
        steps[0] += 1
        if seen.is_set():
            raise RuntimeError("injected once")
        return real_step()

    engine.step = step
    chunks = 0
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": [5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if '"error"' in line:
                    break
                if chunks == 2:
                    seen.set()
    assert '"error"' in line and "injected once" in line  # told in the stream, not lost silently
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
    assert r.status_code == 200
    assert runner.engine is not engine  # rebuilt (without the fault)
