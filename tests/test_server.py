"""The OpenAI-compatible server on loopback: API, errors, disconnects, load, drain."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from orthrus_real.server.serving import bind_socket, build, serve, wait_healthy  # noqa: E402


def start_server(model_dir, **kwargs):
    app, runner = build(str(model_dir), str(model_dir / "adapter"), **kwargs)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=serve, args=(app, runner),
                              kwargs=dict(sock=sock, log_level="warning"), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 30.0)
    return url, runner


@pytest.fixture(scope="module")
def server(tiny_models):
    url, runner = start_server(tiny_models["llama"], max_queued=256)
    yield url, runner


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_models_health_and_concurrent_mix(server):
    url, _ = server
    assert httpx.get(url + "/v1/models").json()["data"][0]["object"] == "model"

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            embs = [c.post("/v1/embeddings", json={"input": [f"text {i}", "more words"] if i % 2
                                                   else [[5, 6, 7], [8, 9, 10, 11]]}) for i in range(12)]
            gens = [c.post("/v1/completions", json={"prompt": [4 + i, 9, 10], "max_tokens": 5,
                                                    "temperature": 0, "ignore_eos": True})
                    for i in range(8)]
            return await asyncio.gather(*embs, *gens)

    responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses)
    emb = responses[0].json()
    assert len(emb["data"]) == 2 and len(emb["data"][1]["embedding"]) == 64
    assert emb["usage"]["prompt_tokens"] == emb["usage"]["total_tokens"] >= 4
    gen = responses[-1].json()
    assert gen["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert gen["choices"][0]["finish_reason"] == "length"


def test_streaming_matches_non_streaming(server):
    url, _ = server
    body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    pieces, lines = [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert chunk["object"] == "text_completion"
        pieces.append(chunk["choices"][0]["text"])
    assert "".join(pieces) == full
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_token_ids_and_a_resumed_stream_continue_one_answer(server):
    """``return_token_ids`` (vLLM's) gives each chunk's token ids and once the prompt's;
    ``resume_token_ids`` given the first k of them streams exactly the rest (no role chunk in a
    chat), with the usage of the whole answer: what the gateway splices after a replica dies."""
    url, _ = server
    for path, body in (("/v1/completions", {"prompt": "hello there"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body = {**body, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}

        def events(path: str, body: dict) -> list[dict]:
            with httpx.stream("POST", url + path, json=body, timeout=60) as r:
                return [json.loads(line[6:]) for line in r.iter_lines()
                        if line.startswith("data: {")]

        def text(chunks: list[dict]) -> str:
            pieces = [c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content"))
                      for c in chunks if c["choices"]]
            return "".join(p or "" for p in pieces)

        whole = events(path, body)
        ids = [t for c in whole if c["choices"] for t in c["choices"][0].get("token_ids", [])]
        assert len(ids) == 12 and whole[-1]["usage"]["completion_tokens"] == 12
        assert sum("prompt_token_ids" in c["choices"][0] for c in whole if c["choices"]) == 1
        rest = events(path, {**body, "resume_token_ids": ids[:5]})
        again = [t for c in rest if c["choices"] for t in c["choices"][0].get("token_ids", [])]
        assert again == ids[5:] and rest[-1]["usage"]["completion_tokens"] == 12
        assert not any("role" in c["choices"][0].get("delta", {}) for c in rest if c["choices"])
        first = httpx.post(url + path, json={**body, "stream": False, "max_tokens": 5,
                                             "stream_options": None}, timeout=60).json()
        assert first["choices"][0]["token_ids"] == ids[:5]
        assert text(whole).startswith(first["choices"][0].get("text")
                                      or first["choices"][0]["message"]["content"])
        assert text(whole).endswith(text(rest))


def test_openai_client_unchanged(server):
    openai = pytest.importorskip("openai")
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    emb = client.embeddings.create(model=model, input=["a b c", "d e"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 64
    b64 = client.embeddings.create(model=model, input="a b c", encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(vec, emb.data[0].embedding, rtol=1e-4, atol=1e-6)  # other batch
    comp = client.completions.create(model=model, prompt="hi", max_tokens=4, temperature=0)
    assert comp.usage.completion_tokens <= 4
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="hi", max_tokens=4, temperature=0, stream=True))
    assert text == comp.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3)
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/embeddings", {"input": 5}, 400, "input"),
    ("/v1/embeddings", {"input": ""}, 400, "input"),
    ("/v1/embeddings", {"input": []}, 400, "input"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/embeddings", {"input": [7] * 5000}, 400, "input"),
    ("/v1/completions", {"prompt": [7] * 4000, "max_tokens": 200}, 400, "prompt"),
    ("/v1/embeddings", {"input": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/embeddings", {"input": [99999]}, 400, "input"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "resume_token_ids": [5, 6, 7]}, 400,
     "resume_token_ids"),
    ("/v1/completions", {"prompt": "x", "resume_token_ids": [99999]}, 400, "resume_token_ids"),
    ("/v1/completions", {"prompt": "x", "resume_token_ids": []}, 400, "resume_token_ids"),
    ("/v1/completions", {"prompt": ["x", "y"], "resume_token_ids": [5]}, 400, "resume_token_ids"),
    ("/v1/completions", {"prompt": "x", "return_token_ids": "yes"}, 400, "return_token_ids"),
])
def test_bad_inputs(server, path, body, status, param):
    url, _ = server
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_invalid_json_and_oversized_body(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/embeddings", json={"input": "x" * (2 << 20)}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.get(url + "/v1/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_mid_stream_frees_blocks(server):
    url, _ = server
    before = httpx.get(url + "/metrics").text
    aborted = metric(before, "orthrus_requests_total", '{kind="generation",outcome="aborted"}')
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": [5] * 200, "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += bool(line)
            if seen == 3:
                text = httpx.get(url + "/metrics").text
                assert metric(text, "orthrus_kv_blocks_used") > 0
                break
    for _ in range(100):
        text = httpx.get(url + "/metrics").text
        if metric(text, "orthrus_kv_blocks_used") == 0:
            break
        time.sleep(0.05)
    assert metric(text, "orthrus_kv_blocks_used") == 0
    assert metric(text, "orthrus_requests_total", '{kind="generation",outcome="aborted"}') == aborted + 1


def test_load_64_clients(tiny_models):
    """64 clients against a queue of 24: some are told 429 and retry; every client gets its 3
    requests served. Bounded by request counts, not a wall-clock window (a slow machine takes
    longer, it does not fail)."""
    url, runner = start_server(tiny_models["mistral"], max_queued=24)
    counts = {"ok": 0, "429": 0, "other": 0}

    async def client(i, c):
        served = 0
        while served < 3:
            if i % 2:
                r = await c.post("/v1/embeddings", json={"input": [4 + i] * (10 + i)})
            else:
                r = await c.post("/v1/completions", json={"prompt": [4 + i] * 8, "max_tokens": 4,
                                                          "ignore_eos": True})
            if r.status_code == 200:
                counts["ok"] += 1
                served += 1
            elif r.status_code == 429:
                assert r.json()["error"]["code"] == "queue_full"
                counts["429"] += 1
                await asyncio.sleep(0.05)  # back off: clients retrying at once starve the server
            else:
                counts["other"] += 1
                return

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            await asyncio.gather(*(client(i, c) for i in range(64)))

    asyncio.run(go())
    assert counts["other"] == 0 and counts["ok"] == 64 * 3 and counts["429"] > 0
    text = httpx.get(url + "/metrics").text
    done = sum(metric(text, "orthrus_requests_total", f'{{kind="{k}",outcome="completed"}}')
               for k in ("embedding", "generation"))
    assert done == counts["ok"]
    assert metric(text, "orthrus_requests_in_flight") == 0
    assert metric(text, "orthrus_kv_blocks_used") == 0
    assert httpx.get(url + "/health").status_code == 200


# slow stage: a thousand tokens drained after SIGTERM; the fast stage drains a live replica
# through the cluster's admin restart
@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(tiny_models, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    model = tiny_models["qwen2"]
    proc = subprocess.Popen([sys.executable, "-m", "orthrus_real.cli", "serve", "--model", str(model),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60.0, proc)
        body = {"prompt": [5] * 50, "max_tokens": 1000, "ignore_eos": True, "temperature": 0,
                "stream": True}
        chunks = 0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                if chunks == 2:  # the request is surely in flight: stop the server now
                    proc.send_signal(signal.SIGTERM)
                    # draining: the listener stays open, new requests and /health get 503
                    late = httpx.post(url + "/v1/embeddings", json={"input": "x"}, timeout=10)
                    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
                    assert httpx.get(url + "/health", timeout=10).status_code == 503
        assert chunks == 1000  # the request in flight finished in full
        # uvicorn re-raises the captured SIGTERM once it has drained, so the exit is by that signal
        assert proc.wait(60) in (0, -signal.SIGTERM)
        log = proc.stdout.read()
        assert b"orthrus ready: http://" in log and b"kv_cache:" in log and b"draining" in log
        assert b"Finished server process" in log
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_that_cannot_be_rebuilt_ends_requests_and_refuses_new_ones(tiny_models):
    url, runner = start_server(tiny_models["qwen2"], max_queued=16)
    engine, real_step, steps = runner.engine, runner.engine.step, [0]

    def failing_step():  # e.g. the vLLM backend's worker process dies mid-run
        steps[0] += 1
        if steps[0] > 3:
            raise RuntimeError("worker process died")
        return real_step()

    def no_engine():
        raise RuntimeError("the device is gone")

    engine.step = failing_step
    runner.factory = no_engine  # the rebuild after the failure fails too
    body = {"prompt": [5, 6, 7], "max_tokens": 50, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and "RuntimeError: worker process died" in r.text
    assert r.json()["error"]["type"] == "server_error"
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
    assert "the device is gone" in health.json()["error"]["message"]
    again = httpx.post(url + "/v1/embeddings", json={"input": "x"}, timeout=10)
    assert again.status_code == 503 and "engine failed" in again.text
    assert runner.outstanding == 0


def test_list_of_prompts_and_usage_in_the_stream(server):
    url, _ = server
    tokens = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "ignore_eos": True}).json()
    assert [c["index"] for c in tokens["choices"]] == [0, 1]
    body = {"prompt": ["one two", "three"], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["completion_tokens"] == 8
    texts = {0: "", 1: ""}
    usage = None
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                for c in chunk["choices"]:
                    texts[c["index"]] += c["text"]
                usage = chunk.get("usage") or usage
    assert [texts[0], texts[1]] == [c["text"] for c in r["choices"]]
    assert usage == r["usage"]


def sse_events(url: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed answer, in order (``[DONE]`` checked, then left out)."""
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_continuous_usage_stats_put_the_usage_in_every_chunk(server):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it with every streamed
    request): each chunk carries the usage so far, as vLLM's server writes it (its prompt's
    tokens, its choice's completion tokens; a chat's role chunk 0), and the closing usage chunk
    still comes; without ``include_usage`` it adds nothing, as in vLLM."""
    url, _ = server
    options = {"include_usage": True, "continuous_usage_stats": True}
    prompts = [[5, 6, 7], [8, 9]]
    events = sse_events(url, "/v1/completions", {
        "prompt": prompts, "max_tokens": 3, "ignore_eos": True, "stream": True,
        "stream_options": options})
    *chunks, closing = events
    seen = {0: 0, 1: 0}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        i = choice["index"]
        seen[i] += 1
        assert chunk["usage"] == {"prompt_tokens": len(prompts[i]), "completion_tokens": seen[i],
                                  "total_tokens": len(prompts[i]) + seen[i]}
    assert seen == {0: 3, 1: 3}
    assert closing["choices"] == [] and closing["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
            "ignore_eos": True, "stream": True, "stream_options": options}
    *chunks, closing = sse_events(url, "/v1/chat/completions", chat)
    prompt = closing["usage"]["prompt_tokens"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 4]
    assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] == prompt
               + c["usage"]["completion_tokens"] for c in chunks)
    assert closing["choices"] == [] and closing["usage"]["completion_tokens"] == 4
    quiet = sse_events(url, "/v1/chat/completions", {
        **chat, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in e for e in quiet)


def test_vllms_honoured_extras(server):
    """What vLLM's clients may send beside OpenAI's parameters and this server does as vLLM
    does: stop_token_ids, truncation_side, request_id, top_k -1, nulls for defaults,
    use_activation, the byte order of base64 embeddings."""
    url, _ = server
    greedy = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}
    ids = httpx.post(url + "/v1/completions", json=greedy, timeout=30).json()["choices"][0]["token_ids"]
    stopped = httpx.post(url + "/v1/completions", timeout=30, json={
        **greedy, "ignore_eos": False, "stop_token_ids": [ids[2]]}).json()
    assert stopped["choices"][0]["token_ids"] == ids[:ids.index(ids[2]) + 1]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(url + "/v1/completions", timeout=30, json={
        **greedy, "request_id": "mine-1", "top_k": -1, "top_p": None, "temperature": None,
        "seed": 3, "stream": None}).json()
    assert r["id"] == "cmpl-mine-1" and r["usage"]["completion_tokens"] == 6
    left = httpx.post(url + "/v1/completions", timeout=30, json={
        **greedy, "prompt": [5, 6, 7, 8, 9], "truncate_prompt_tokens": 2, "max_tokens": 1}).json()
    right = httpx.post(url + "/v1/completions", timeout=30, json={
        **greedy, "prompt": [5, 6, 7, 8, 9], "truncate_prompt_tokens": 2, "max_tokens": 1,
        "truncation_side": "right"}).json()
    assert left["choices"][0]["prompt_token_ids"] == [8, 9]
    assert right["choices"][0]["prompt_token_ids"] == [5, 6]

    def embed(**extra) -> np.ndarray:
        r = httpx.post(url + "/v1/embeddings", json={"input": "a b c", **extra}, timeout=30)
        assert r.status_code == 200, r.text
        vec = r.json()["data"][0]["embedding"]
        if isinstance(vec, str):
            order = {"big": ">", "little": "<"}.get(extra.get("endianness"), "=")
            return np.frombuffer(base64.b64decode(vec), dtype=f"{order}f4")
        return np.array(vec)

    plain = embed()
    for order in ("native", "little", "big"):
        np.testing.assert_allclose(embed(encoding_format="base64", endianness=order), plain,
                                   rtol=1e-5, atol=1e-6)
    raw = embed(use_activation=False)
    np.testing.assert_allclose(raw, embed(normalize=False), rtol=1e-5, atol=1e-6)
    assert abs(np.linalg.norm(plain) - 1) < 1e-4 and abs(np.linalg.norm(raw) - 1) > 1e-3
    r = httpx.post(url + "/v1/embeddings", json={"input": "x", "use_activation": False,
                                                 "normalize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_activation"


def test_a_batch_of_2048_inputs_is_refused_naming_the_limit(server):
    """OpenAI's largest embeddings batch (2,048 inputs) against the default limit: a 400 that
    names the limit and the option that raises it (the gateway's test sends one it answers);
    a limit over --max-queued is the queue's, named as such (such a batch could never be
    queued: 429, retried, forever)."""
    url, _ = server
    r = httpx.post(url + "/v1/embeddings", json={"input": ["a"] * 2048}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input" and err["code"] == "too_many_inputs"
    assert "2048" in err["message"] and "256" in err["message"]
    assert "--max-inputs-per-request" in err["message"]
    from types import SimpleNamespace

    from orthrus_real.server.api import ApiError, ServerContext

    queue_bound = SimpleNamespace(max_inputs=2048, runner=SimpleNamespace(max_queued=1024))
    ServerContext.check_count(queue_bound, 1024, "input")
    with pytest.raises(ApiError, match="limit of 1024 per request \\(--max-queued"):
        ServerContext.check_count(queue_bound, 2048, "input")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "temprature": 0}, "temprature"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/embeddings", {"input": "x", "dimensions": 32}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "colour": "red"}, "colour"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
     "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, "tools"),
])
def test_unsupported_and_unknown_parameters_are_named(server, path, body, param):
    url, _ = server
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_models_say_what_they_serve_and_an_embedding_id_refuses_completions(server):
    url, _ = server
    data = httpx.get(url + "/v1/models").json()["data"]
    base, adapter = data[0], data[1]
    assert base["serves"] == ["completions", "chat", "embeddings"] and base["parent"] is None
    assert adapter["serves"] == ["embeddings"] and adapter["parent"] == base["id"]
    r = httpx.post(url + "/v1/completions", json={"model": adapter["id"], "prompt": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"
    r = httpx.post(url + "/v1/embeddings", json={"model": adapter["id"], "input": "x"}, timeout=30)
    assert r.status_code == 200


def test_tokenize_detokenize_and_version(server):
    url, _ = server
    t = httpx.post(url + "/tokenize", json={"prompt": "hello there"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0
    d = httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert "hello" in d["prompt"]
    assert httpx.post(url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    from orthrus_sim import __version__

    assert httpx.get(url + "/version").json() == {"version": __version__}


def test_api_key(tiny_models):
    url, _ = start_server(tiny_models["llama"], api_key="s3cret")
    assert httpx.get(url + "/health").status_code == 200  # open, as are /metrics and /version
    r = httpx.post(url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/embeddings", json={"input": "x"},
                   headers={"Authorization": "Bearer s3cret"}, timeout=30)
    assert r.status_code == 200


def test_iterations_endpoint_pages_the_engine_record_and_the_cost_model_reads_it(server, tmp_path):
    """``GET /iterations`` gives each step's time and shape, oldest first, page by page;
    ``save_iterations`` writes them all; the residual script predicts the same batches."""
    url, runner = server
    first = runner.engine.iterations
    r = httpx.post(url + "/v1/completions", json={"prompt": [4, 9, 10], "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    page = httpx.get(url + "/iterations", params={"since": first, "limit": 2}).json()
    assert [row["iteration"] for row in page["data"]] == [first + 1, first + 2]
    assert page["next"] == first + 2 and page["data"][0]["seconds"] > 0
    assert page["data"][0]["shape"]["chunk_tokens"] == 3  # the prompt, then decodes
    assert page["data"][1]["shape"]["decodes"] == 1 and page["data"][1]["decodes"] == 1
    rest = httpx.get(url + "/iterations", params={"since": page["next"]}).json()
    assert rest["data"][0]["iteration"] == first + 3 and rest["next"] >= first + 6
    bad = httpx.get(url + "/iterations", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"

    from orthrus_real.measure.validate import save_iterations
    from orthrus_sim.costmodel import calibrated_predictor
    from orthrus_sim.costmodel.iteration_check import iteration_residuals, load_iterations

    log = tmp_path / "iterations.jsonl"
    assert save_iterations(url, log) == runner.engine.iterations
    rows = load_iterations(log, "server")
    calibration = Path(__file__).resolve().parents[1] / "calibration" / "cpu-2core-small.json"
    cost = calibrated_predictor(str(calibration), str(runner.engine.model_dir)).cost
    out = {r["batch"]: r for r in iteration_residuals(rows, cost)}
    assert out["all"]["iterations"] == len(rows) and out["decode"]["iterations"] >= 5
    assert out["prefill"]["measured_s"] > 0
    # the prediction is the cost model's for the recorded shape, row by row
    decode_rows = [r for r in rows if r["shape"].decodes == r["shape"].tokens]
    assert out["decode"]["predicted_s"] == pytest.approx(
        sum(cost.shape_time(r["shape"]) for r in decode_rows))
    log.write_text('{"seconds": 1}\n')
    with pytest.raises(ValueError, match="line 1: not an iteration row"):
        load_iterations(log)
