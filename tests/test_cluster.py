"""Several replicas behind one endpoint (``orthrus-real serve --replicas 2``): every request
reaches a replica and completes, the project's router decides where (round-robin alternates,
least-work sends a burst to the idle replica, a dedicated split routes by kind and each side
refuses the other kind), a replica killed mid-load loses nothing (its requests go to the other,
a stream continues there with the same greedy text, a request that kills every replica it
reaches is quarantined) and comes back on restart, a drain moves generations at once, SIGTERM
drains; /metrics and /health per replica."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("torch")

from orthrus_real.cluster.devices import Device, parse_devices  # noqa: E402
from orthrus_real.cluster.metrics_text import merge, replica_roles, sum_replicas  # noqa: E402
from orthrus_real.cluster.replicas import free_port, plan_replicas  # noqa: E402
from orthrus_real.server.serving import wait_healthy  # noqa: E402
from orthrus_sim.experiment.scenario import parse_scenario  # noqa: E402

REPLICA = "x-orthrus-replica"


def devices_arg() -> str:
    """Two single-core replicas where there are two cores, else both on the one."""
    return "cpu:0,cpu:1" if (os.cpu_count() or 1) >= 2 else "cpu:0,cpu:0"


class Cluster:
    """``orthrus-real serve --replicas N`` in a child process, healthy."""

    def __init__(self, model, *args: str, replicas: int = 2, devices: str | None = None,
                 start_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orthrus_real.cli", "serve", "--model", str(model), "--port",
             str(self.port), "--replicas", str(replicas), "--devices", devices or devices_arg(),
             "--threads", "1", "--kv-cache-tokens", "8192", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []  # read as it comes, so a test can wait for a log line
        self.reader = threading.Thread(target=self.read_output, daemon=True)
        self.reader.start()
        try:
            wait_healthy(self.url, start_timeout, self.proc)
        except RuntimeError:
            print(self.close()[-5000:])
            raise

    def read_output(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace"))

    def wait_for_log(self, text: str, timeout: float = 120.0) -> None:
        """Until the server has logged ``text`` (e.g. the Ray driver's own "ready" line)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.lines)):
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                f"no {text!r} in the log:\n" + "".join(self.lines)[-3000:]
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.reader.join(30)
        return "".join(self.lines)


@pytest.fixture(scope="module")
def rr_cluster(tiny_models):
    # OpenAI's largest embeddings batch (2,048 inputs) is allowed, and fits the queue
    c = Cluster(tiny_models["llama"], "--configuration", "orthrus", "--max-inputs-per-request",
                "2048", "--max-queued", "4096")
    yield c
    c.close()


@pytest.fixture(scope="module")
def lw_cluster(tiny_models):
    c = Cluster(tiny_models["llama"], "--configuration", "orthrus", "--router", "least-work",
                "--auto-restart")
    yield c
    c.close()


def gen(prompt, n=4, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}


# ----- no processes ---------------------------------------------------------------------------
def test_devices_parse_one_per_replica_and_name_the_problem():
    assert parse_devices("cuda:0,cuda:1", 2, 2) == [Device("cuda", 0), Device("cuda", 1)]
    assert parse_devices("cpu:0,1,cpu:0-1", 2, 0) == [Device("cpu", cpus=frozenset({0, 1}))] * 2
    assert parse_devices("cpu", 3, 0) == [Device("cpu")] * 3
    assert str(parse_devices("cpu:0-1;cpu:0", 2, 0)[0]) == "cpu:0-1"
    with pytest.raises(ValueError, match="names 3 devices for --replicas 2"):
        parse_devices("cpu:0,cpu:0,cpu:0", 2, 0)
    with pytest.raises(ValueError, match="1 CUDA device"):
        parse_devices("cuda:0,cuda:1", 2, 1)
    with pytest.raises(ValueError, match="'gpu0' is not a device"):
        parse_devices("gpu0", 1, 0)


def test_placement_is_the_simulators_plan_and_disagg_is_refused(tiny_models):
    sc = parse_scenario({"name": "t", "num_requests": 1, "model": str(tiny_models["llama"]),
                         "cluster": {"gpus": 2}, "configurations": ["dedicated-1:1"]})
    specs = plan_replicas(sc, "dedicated-1:1", [Device("cpu")] * 2, 1, "adapter-dir")
    assert [(s.role, s.plan.policy, s.adapter) for s in specs] == [
        ("embedding", "embedding-only", "adapter-dir"), ("generation", "generation", None)]
    with pytest.raises(ValueError, match="KV transfer between engines is not built"):
        plan_replicas(sc, "disagg-pd-1:1", [Device("cpu")] * 2, 1, None)


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--configuration", "disagg-pd-1:1"], "KV transfer between engines"),
    (["--replicas", "3", "--configuration", "dedicated-1:1"], "uses 2 GPUs but cluster.gpus is 3"),
    (["--replicas", "2", "--devices", "cpu:0,cpu:0,cpu:0"], "names 3 devices for --replicas 2"),
    (["--replicas", "2", "--router", "fastest"], "cluster.router"),
])
def test_serve_replicas_refuses_bad_options_before_starting_anything(tiny_models, args, message):
    from typer.testing import CliRunner

    from orthrus_real.cli import app

    res = CliRunner().invoke(app, ["serve", "--model", str(tiny_models["llama"]), "--port",
                                   str(free_port()), *args])
    assert res.exit_code == 2 and message in res.output, res.output


def test_metrics_merge_labels_each_replica_and_sums_back():
    text = ('# HELP x_total x\n# TYPE x_total counter\nx_total 2.0\n'
            '# HELP h h\n# TYPE h gauge\nh{kind="e"} 1.0\n')
    merged = merge({0: text, 1: text.replace("2.0", "3.0")})
    assert merged.count("# TYPE x_total counter") == 1
    assert 'x_total{replica="0"} 2.0' in merged and 'h{replica="1",kind="e"} 1.0' in merged
    from orthrus_real.measure.bench import parse_prometheus

    total, each = sum_replicas(parse_prometheus(merged))
    assert total["x_total"] == 5.0 and each[1]["x_total"] == 3.0 and total['h{kind="e"}'] == 2.0
    assert replica_roles({'orthrus_cluster_replica_up{replica="1",role="generation"}': 1.0}) == {
        1: "generation"}


# ----- a round-robin cluster ------------------------------------------------------------------
def test_every_request_completes_and_round_robin_alternates(rr_cluster):
    url = rr_cluster.url
    seen = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(4):
            r = c.post("/v1/completions", json=gen([5 + i, 6, 7]))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            seen.append(r.headers[REPLICA])
        for i in range(4):
            r = c.post("/v1/embeddings", json={"input": f"text {i}"})
            assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
            seen.append(r.headers[REPLICA])
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "stream": True}) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
    # each kind in turn over both replicas (the router's round-robin per kind)
    assert seen == ["0", "1", "0", "1", "0", "1", "0", "1"]

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=gen([4, i + 5], 3))
                                          for i in range(6)],
                                        *[c.post("/v1/embeddings", json={"input": [[4, 5, i + 6]]})
                                          for i in range(6)])

    assert all(r.status_code == 200 for r in asyncio.run(burst()))
    health = rr_cluster.health()
    assert health["status"] == "ok" and [r["up"] for r in health["replicas"]] == [True, True]
    assert all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in health["replicas"])
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'orthrus_iterations_total{replica="0"}' in text
    assert 'orthrus_iterations_total{replica="1"}' in text
    assert 'orthrus_cluster_routed_total{kind="generation",replica="1"} 5.0' in text
    own = httpx.get(url + "/replicas/1/metrics", timeout=10).text
    assert "orthrus_iterations_total " in own and "replica=" not in own


def test_bodies_the_gateway_cannot_read_reach_the_replica_and_get_its_4xx(rr_cluster):
    """What the gateway's fuzz found: a body too deep for JSON, or text that is not Unicode,
    is still relayed (the gateway's token estimate falls back) and the replica names the
    problem; the gateway's own errors (an unknown path, a bad path parameter) are OpenAI's."""
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with httpx.Client(base_url=rr_cluster.url, timeout=60) as c:
        for path, content in (("/v1/completions", deep), ("/v1/embeddings", b"[" * 50_000),
                              ("/v1/completions", b'{"prompt": "a\\udfffb", "max_tokens": 2}'),
                              ("/v1/embeddings", b'{"input": ["\\ud800"]}')):
            r = c.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == 400 and set(r.json()["error"]) == {
                "message", "type", "param", "code"}, (path, r.text[:300])
        for method, path, status in (("GET", "/replicas/abc/metrics", 400), ("GET", "/nope", 404),
                                     ("GET", "/v1/embeddings", 405)):
            r = c.request(method, path)
            assert r.status_code == status and "message" in r.json()["error"], (path, r.text)


def test_openai_client_embeds_token_id_lists_and_a_2048_batch_through_the_gateway(rr_cluster):
    """What LangChain's OpenAI embeddings send by default (token-id lists, through the ``openai``
    client) reaches a replica intact: the same vectors as the text they tokenise to; and a batch
    of OpenAI's largest size (2,048 inputs) is answered in order."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=rr_cluster.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    texts = ["a first text", "and a second one"]
    ids = [httpx.post(rr_cluster.url + "/tokenize", json={"prompt": t}, timeout=10).json()["tokens"]
           for t in texts]
    by_ids = client.embeddings.create(model=model, input=ids)
    by_text = client.embeddings.create(model=model, input=texts)
    assert [d.index for d in by_ids.data] == [0, 1]
    assert by_ids.usage.prompt_tokens == sum(len(x) for x in ids) == by_text.usage.prompt_tokens
    for a, b in zip(by_ids.data, by_text.data, strict=True):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-4
    batch = client.embeddings.create(model=model, input=[[5 + i % 40, 6, 7] for i in range(2048)])
    assert [d.index for d in batch.data] == list(range(2048))
    assert batch.data[0].embedding == batch.data[40].embedding != batch.data[1].embedding


def test_continuous_usage_stats_through_the_gateway(rr_cluster):
    """guidellm's streamed requests (``stream_options.continuous_usage_stats``) through the
    gateway: usage in every chunk, and the closing usage chunk once."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", rr_cluster.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 1, 2, 3, 4, 5, 5]
    assert [e["choices"] for e in events].count([]) == 1 and events[-1]["choices"] == []


def test_bench_measures_the_cluster_per_replica(rr_cluster):
    from orthrus_real.measure.bench import bench

    sc = parse_scenario({"name": "t", "seed": 3, "num_requests": 12,
                         "workload": {"arrival": {"process": "poisson", "rate": 40},
                                      "embedding_input": {"dist": "fixed", "value": 8},
                                      "generation_prompt": {"dist": "fixed", "value": 8},
                                      "generation_output": {"dist": "fixed", "value": 4}},
                         "cluster": {"gpus": 2}})
    doc, _ = asyncio.run(bench(rr_cluster.url, sc))
    metrics = doc["runs"][0]["metrics"]
    gpus = metrics["utilization"]["per_gpu"]
    assert [g["replica"] for g in gpus] == [0, 1] and all(g["iterations"] > 0 for g in gpus)
    assert [g["role"] for g in gpus] == ["unified", "unified"]
    assert metrics["completed"]["embedding"] + metrics["completed"]["generation"] == 12


def test_admin_restart_drains_and_restarts_a_live_replica(rr_cluster):
    url = rr_cluster.url
    before = rr_cluster.health()["replicas"][1]
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/admin/replicas/1/restart").status_code == 202
        assert c.post("/admin/replicas/7/restart").json()["error"]["code"] == "replica_not_found"
        for _ in range(600):
            health = rr_cluster.health()
            if health["replicas"][1]["restarts"] == 1 and health["replicas"][1]["up"]:
                break
            time.sleep(0.1)
        assert health["status"] == "ok" and health["replicas"][1]["pid"] != before["pid"]
        seen = {c.post("/v1/embeddings", json={"input": "x"}).headers[REPLICA] for _ in range(2)}
        assert seen == {"0", "1"}


def stream_text(c: httpx.Client, path: str, body: dict, on_chunk=None) -> tuple[str, list[dict]]:
    """A streamed answer's text (completion or chat deltas) and its events; ``on_chunk(n,
    replica)`` after the n-th content chunk."""
    text, events = "", []
    with c.stream("POST", path, json={**body, "stream": True,
                                      "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        where = r.headers[REPLICA]
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            events.append(doc)
            for ch in doc.get("choices", ()):
                piece = ch.get("text") if "text" in ch else ch.get("delta", {}).get("content")
                if piece is not None:
                    text += piece
                    if on_chunk:
                        on_chunk(sum(1 for e in events if e.get("choices")), where)
    return text, events


def test_a_drain_moves_a_seeded_stream_and_it_goes_on_with_the_same_text(rr_cluster):
    """``drain?migrate=true`` takes a replica out of routing and moves its stream to the other
    replica at once; the seeded chat stream continues from the tokens it sent: the same text as
    without the move, one role chunk, one id, usage counting every token."""
    body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 150,
            "temperature": 0.8, "top_k": 40, "seed": 123, "ignore_eos": True}
    with httpx.Client(base_url=rr_cluster.url, timeout=60) as c:
        ref = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        drained = {}

        def drain_at(n: int, where: str) -> None:
            if n == 3 and not drained:
                drained.update(c.post(f"/admin/replicas/{where}/drain?migrate=true").json())
                # while drained: new requests go to the other replica only
                others = {c.post("/v1/embeddings", json={"input": "x"}).headers[REPLICA]
                          for _ in range(2)}
                assert others == {str(1 - int(where))}

        text, events = stream_text(c, "/v1/chat/completions", body, drain_at)
        assert drained["moved"] == 1 and drained["status"] == "drained"
        assert text == ref
        assert len({e["id"] for e in events}) == 1
        roles = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
        assert len(roles) == 1
        assert events[-1]["usage"]["completion_tokens"] == 150
        assert not any("token_ids" in ch for e in events for ch in e["choices"])
        health = rr_cluster.health()
        i = drained["replica"]
        assert health["status"] == "degraded" and health["replicas"][i]["draining"]
        assert c.post(f"/admin/replicas/{i}/resume").json()["status"] == "up"
        assert rr_cluster.health()["status"] == "ok"
        text = httpx.get(rr_cluster.url + "/metrics", timeout=10).text
        assert 'orthrus_cluster_migrations_total{why="moved"} 1.0' in text


def sigterm_mid_stream(cluster: Cluster, n: int) -> int:
    """SIGTERM the cluster while a stream of ``n`` tokens is in flight; new requests must then
    get 503 draining. Returns the stream's chunks."""
    chunks = 0
    with httpx.stream("POST", cluster.url + "/v1/completions", json=gen([5] * 20, n, stream=True),
                      timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            if chunks == 2:
                cluster.proc.send_signal(signal.SIGTERM)
                for _ in range(100):  # under Ray the signal reaches the gateway through Ray
                    late = httpx.post(cluster.url + "/v1/embeddings", json={"input": "x"},
                                      timeout=10)
                    if late.status_code == 503:
                        break
                    time.sleep(0.05)
                assert late.json()["error"]["code"] == "draining"
                assert httpx.get(cluster.url + "/health", timeout=10).json()["status"] == "draining"
    return chunks


def test_sigterm_drains_the_cluster(rr_cluster):
    """Last on this cluster: the stream in flight finishes, new requests get 503, then the
    gateway and both replicas exit."""
    pids = [r["pid"] for r in rr_cluster.health()["replicas"]]
    chunks = sigterm_mid_stream(rr_cluster, 1200)
    assert chunks == 1200
    assert rr_cluster.proc.wait(60) in (0, -signal.SIGTERM)
    log = rr_cluster.close()
    assert "stopping 2 replica(s)" in log
    for pid in pids:  # both engines drained and exited
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # the startup log lists each replica's device, model, role and KV capacity
    assert "replica 0: role unified, device cpu:" in log and "kv_cache 8192 tokens" in log


# ----- least work; a replica that dies ------------------------------------------------------
def test_least_work_sends_a_burst_to_the_idle_replica(lw_cluster):
    url = lw_cluster.url

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            async with c.stream("POST", "/v1/completions", json=gen([5] * 8, 600, stream=True)) as r:
                busy = r.headers[REPLICA]
                burst = await asyncio.gather(*[c.post("/v1/completions", json=gen([6, i + 4], 3))
                                               for i in range(5)])
                async for _ in r.aiter_lines():
                    pass
            return busy, burst

    busy, burst = asyncio.run(go())
    assert busy == "0"  # both idle: the lower index
    assert all(r.status_code == 200 for r in burst)
    assert [r.headers[REPLICA] for r in burst] == ["1"] * 5


def kill_mid_stream(url: str, victim: dict, texts: bool = False, n: int = 400) -> dict:
    """A long and a short stream, one to each replica, the ``victim``'s killed at its third
    token: ``{replica: (chunks, the error event or None, tokens asked[, text])}``."""
    async def stream(c, n):
        async with c.stream("POST", "/v1/completions", json=gen([7] * 8, n, stream=True)) as r:
            where, chunks, error, text = r.headers[REPLICA], 0, None, ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    doc = json.loads(line[6:])
                    if "error" in doc:
                        error = doc["error"]
                        continue
                    chunks += 1
                    text += doc["choices"][0]["text"]
                    if where == str(victim["replica"]) and chunks == 3:
                        os.kill(victim["pid"], signal.SIGKILL)
            return (where, chunks, error, n, text) if texts else (where, chunks, error, n)

    async def go():
        # a read that waits 15 s fails the test: the error must come well before
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(15.0)) as c:
            return await asyncio.gather(stream(c, n), stream(c, 60))

    # which stream reaches which replica depends on the order the two arrive in: the other
    # replica's stream is judged against its own length
    return {out[0]: out[1:] for out in asyncio.run(go())}


def watch_health(cluster: Cluster) -> tuple[list[dict], threading.Event]:
    """/health every 20 ms into a list until the event is set: a short window (a replica down
    while --auto-restart brings it back) is seen however long the test's own steps take."""
    seen: list[dict] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            seen.append(cluster.health())
            time.sleep(0.02)

    threading.Thread(target=poll, daemon=True).start()
    return seen, stop


# slow stage: a second kill and a restart; the fast stage kills one replica under load, a drain moves
# a stream
@pytest.mark.slow
def test_a_killed_replica_s_stream_goes_on_elsewhere_and_it_comes_back(lw_cluster):
    """SIGKILL at the third token of a greedy stream: the stream continues on the other replica
    from the tokens it sent (no error, the exact text of an undisturbed run, every token once),
    the other replica's stream is untouched, the dead one is out of routing and comes back."""
    url = lw_cluster.url
    with httpx.Client(base_url=url, timeout=60) as c:
        refs = {n: c.post("/v1/completions", json=gen([7] * 8, n)).json()["choices"][0]["text"]
                for n in (400, 60)}
    victim = lw_cluster.health()["replicas"][0]
    seen, stop = watch_health(lw_cluster)
    results = kill_mid_stream(url, victim, texts=True)
    assert sorted(results) == ["0", "1"]
    for where, (chunks, error, asked, text) in results.items():
        assert error is None and chunks == asked, where  # every token, once
        assert text == refs[asked], where
    for _ in range(50):  # the monitor sees the exit within a fraction of a second
        if any(not h["replicas"][0]["up"] for h in list(seen)):
            break
        time.sleep(0.1)
    down = [h for h in list(seen) if not h["replicas"][0]["up"]]
    assert down and down[0]["status"] == "degraded" and down[0]["replicas"][0]["last_exit"]
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(600):  # --auto-restart: the gateway starts it again
            health = lw_cluster.health()
            if health["replicas"][0]["up"]:
                break
            time.sleep(0.1)
        stop.set()
        assert health["status"] == "ok" and health["replicas"][0]["restarts"] == 1
        assert health["replicas"][0]["pid"] != victim["pid"]
        r = c.post("/v1/completions", json=gen([5, 6], 3))
        assert r.status_code == 200 and r.headers[REPLICA] == "0"  # both idle: back on 0
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'orthrus_cluster_migrations_total{why="down"} 1.0' in text


def closed_loop(url: str, clients: int, seconds: float, kill_at: float, victim: int) -> list:
    """``clients`` closed-loop clients for ``seconds``, half embeddings, half completions
    (streamed and not); replica ``victim`` SIGKILLed at ``kill_at`` s. Every answer:
    (kind, status, retries header, error code or None)."""
    out: list = []

    async def client(c: httpx.AsyncClient, i: int, end: float) -> None:
        k = 0
        while time.monotonic() < end:
            k += 1
            if i % 2:
                r = await c.post("/v1/embeddings", json={"input": f"client {i} request {k}"})
                out.append(("embedding", r.status_code, r.headers.get("x-orthrus-retries"), None))
                continue
            body = gen([5 + i, 6 + k % 50], 24 + 8 * (k % 4), stream=bool(k % 2))
            async with c.stream("POST", "/v1/completions", json=body) as r:
                error = None
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        error = json.loads(line[6:])["error"]["code"]
            out.append(("generation", r.status_code, r.headers.get("x-orthrus-retries"), error))

    async def killer(start: float) -> None:
        await asyncio.sleep(kill_at)
        pid = httpx.get(url + "/admin/replicas", timeout=10).json()["replicas"][victim]["pid"]
        os.kill(pid, signal.SIGKILL)

    async def go() -> None:
        start = time.monotonic()
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            await asyncio.gather(killer(start), *(client(c, i, start + seconds)
                                                  for i in range(clients)))

    asyncio.run(go())
    return out


def test_a_replica_killed_under_load_loses_no_request(lw_cluster):
    """The chaos run of docs/cluster.md, short: a closed loop of both kinds, one replica
    SIGKILLed mid-run: every request answers 200 with no error event; those in flight on the
    dead replica were sent again (their retries header, the gateway's counters)."""
    answers = closed_loop(lw_cluster.url, clients=8, seconds=8.0, kill_at=3.0, victim=1)
    bad = [a for a in answers if a[1] != 200 or a[3] is not None]
    assert len(answers) > 30 and not bad, bad[:5]
    text = httpx.get(lw_cluster.url + "/metrics", timeout=10).text
    retried = sum(float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("orthrus_cluster_retries_total{"))
    assert retried >= 1
    assert any(a[2] not in (None, "0") for a in answers) or "migrations_total" in text
    for _ in range(600):
        if lw_cluster.health()["status"] == "ok":
            break
        time.sleep(0.1)


# slow stage: a stall and its recovery; the fast stage kills one replica under load
@pytest.mark.slow
def test_a_stalled_replica_s_work_moves_at_once_and_it_is_routed_again_after(lw_cluster):
    """SIGSTOP mid-stream: within a few seconds (a /health probe unanswered for 1.5 s) the
    stream continues on the other replica with its exact greedy text and an embedding there is
    answered elsewhere; the stalled replica is routed nothing until it answers again."""
    url = lw_cluster.url
    for _ in range(600):
        if lw_cluster.health()["status"] == "ok":
            break
        time.sleep(0.1)
    body = gen([8] * 8, 600)
    with httpx.Client(base_url=url, timeout=60) as c:
        ref = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stopped: dict = {}

        def stop_it(n: int, where: str) -> None:
            if n == 3 and not stopped:
                pid = lw_cluster.health()["replicas"][int(where)]["pid"]
                os.kill(pid, signal.SIGSTOP)
                stopped.update(replica=int(where), pid=pid, at=time.monotonic())

        try:
            text, events = stream_text(c, "/v1/completions", body, stop_it)
            took = time.monotonic() - stopped["at"]
            health = lw_cluster.health()
        finally:
            os.kill(stopped["pid"], signal.SIGCONT)
    assert text == ref and not any("error" in e for e in events)
    assert took < 20, took  # moved after the stall was seen, not after the process was killed
    victim = health["replicas"][stopped["replica"]]
    assert victim["stalled"] or not victim["up"]
    for _ in range(600):  # it answers again (or, if it was taken down, comes back restarted)
        if lw_cluster.health()["status"] == "ok":
            break
        time.sleep(0.1)
    assert lw_cluster.health()["status"] == "ok"
    for _ in range(100):  # what was moved off it is gone from it too
        if all(r["in_flight"] == 0 for r in lw_cluster.health()["replicas"]):
            break
        time.sleep(0.1)
    assert [r["in_flight"] for r in lw_cluster.health()["replicas"]] == [0, 0]
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'orthrus_cluster_migrations_total{why="stalled"}' in text


# slow stage: kills both replicas in turn; the fast stage kills one under load
@pytest.mark.slow
def test_a_request_that_kills_every_replica_it_reaches_is_quarantined(lw_cluster):
    """A non-streamed generation in flight on a replica that dies goes to the other; when that
    one dies with it too, it is failed (422 request_quarantined) instead of reaching a third,
    and the same body is refused at once while others are served."""
    url = lw_cluster.url
    for _ in range(600):
        if lw_cluster.health()["status"] == "ok":
            break
        time.sleep(0.1)
    for _ in range(100):  # nothing else in flight: the replicas that run it are the ones busy
        if all(r["in_flight"] == 0 for r in lw_cluster.health()["replicas"]):
            break
        time.sleep(0.1)
    assert [r["in_flight"] for r in lw_cluster.health()["replicas"]] == [0, 0]
    body = gen([9] * 8, 3000)
    killed: list[int] = []

    def kill_where_it_runs() -> None:
        """Kill the replica running it (holding its ~3000 tokens of work for 0.5 s: it has
        reached the engine), twice."""
        since: dict[int, float] = {}
        while len(killed) < 2:
            reps = httpx.get(url + "/admin/replicas", timeout=10).json()["replicas"]
            for r in reps:
                if r["up"] and r["outstanding_tokens"] > 2000 and r["replica"] not in killed:
                    if time.monotonic() - since.setdefault(r["replica"], time.monotonic()) > 0.5:
                        killed.append(r["replica"])
                        os.kill(r["pid"], signal.SIGKILL)
                else:
                    since.pop(r["replica"], None)
            time.sleep(0.05)

    t = threading.Thread(target=kill_where_it_runs)
    t.start()
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    t.join()
    assert sorted(killed) == [0, 1]
    log = [line for line in lw_cluster.lines[-400:] if "[replica" not in line]
    assert r.status_code == 422 and r.json()["error"]["code"] == "request_quarantined", \
        r.text[:200] + "".join(log[-30:])
    again = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert again.status_code == 422 and "quarantined" in again.json()["error"]["message"]
    for _ in range(600):  # both come back (--auto-restart) and serve other requests
        if lw_cluster.health()["status"] == "ok":
            break
        time.sleep(0.1)
    assert httpx.post(url + "/v1/completions", json=gen([5, 6], 3), timeout=60).status_code == 200
    text = httpx.get(url + "/metrics", timeout=10).text
    assert "orthrus_cluster_quarantined_total 1.0" in text


# slow stage: a third cluster; the split's placement and refusals are planned in the fast stage
@pytest.mark.slow
# ----- a dedicated split ----------------------------------------------------------------------
def test_dedicated_split_routes_by_kind_and_each_side_refuses_the_other(tiny_models):
    c = Cluster(tiny_models["qwen2"], "--configuration", "dedicated-1:1")
    try:
        with httpx.Client(base_url=c.url, timeout=60) as client:
            for i in range(3):
                e = client.post("/v1/embeddings", json={"input": f"doc {i}"})
                g = client.post("/v1/completions", json=gen([4, 5 + i]))
                assert e.status_code == g.status_code == 200
                assert (e.headers[REPLICA], g.headers[REPLICA]) == ("0", "1")
            replicas = c.health()["replicas"]
            assert [(r["role"], r["policy"]) for r in replicas] == [
                ("embedding", "embedding-only"), ("generation", "generation")]
            embed_side, gen_side = (r["url"] for r in replicas)
            wrong = [client.post(embed_side + "/v1/completions", json=gen([4, 5])),
                     client.post(gen_side + "/v1/embeddings", json={"input": "x"})]
            for r, serves in zip(wrong, ("embedding", "generation")):
                assert r.status_code == 400
                err = r.json()["error"]
                assert err["code"] == "wrong_replica_kind"
                assert f"serves {serves} requests only" in err["message"]
    finally:
        log = c.close()
    assert "replica 0: role embedding" in log and "replica 1: role generation" in log


def test_the_predicting_rules_route_over_real_replicas(tiny_models):
    """The gateway's replicas carry what ``least-predicted-time`` and ``adaptive`` read (the
    plan's cost model, the scheduler config): a long prompt booked on replica 0 sends the next
    embeddings to replica 1, and release empties the books (no processes needed)."""
    from orthrus_real.cluster.machine_plan import ClusterArgs, make_replicas
    from orthrus_sim.engine.request import Request, RequestKind
    from orthrus_sim.routing.rules import make_router

    sc = parse_scenario({"name": "t", "num_requests": 1, "model": str(tiny_models["llama"]),
                         "cluster": {"gpus": 2, "router": "least-predicted-time"},
                         "configurations": ["orthrus"]})
    args = ClusterArgs(replicas=2, configuration="orthrus", devices="cpu:0,cpu:0",
                       router="least-predicted-time", threads=1, adapter=None)
    replicas = make_replicas(sc, "orthrus", args)
    assert all(r.cost is not None and r.policy.config.token_budget > 0 for r in replicas)
    router = make_router("least-predicted-time", replicas)
    long = Request("g", RequestKind.GENERATION, 0.0, 4000, max_output_tokens=16)
    assert router.route(long) is replicas[0]  # both idle: the lower index
    embeddings = [Request(f"e{i}", RequestKind.EMBEDDING, 0.0, 64) for i in range(3)]
    assert [router.route(e).index for e in embeddings] == [1, 1, 1]
    for req in [long, *embeddings]:
        router.release(req)
    assert router.route(Request("e9", RequestKind.EMBEDDING, 0.0, 64)) is replicas[0]


def test_each_replica_is_given_the_engine_hot_path_options(tiny_models):
    """serve --replicas N --attention paged --no-cuda-graphs --cpu-gemm onednn: every replica's
    engine runs them (not the defaults)."""
    from orthrus_real.cluster.replicas import ServeOptions, child_command

    sc = parse_scenario({"name": "t", "num_requests": 1, "model": str(tiny_models["llama"]),
                         "cluster": {"gpus": 2}, "configurations": ["orthrus"]})
    specs = plan_replicas(sc, "orthrus", [Device("cpu")] * 2, 1, None)
    opts = ServeOptions(str(tiny_models["llama"]), attention="paged", cuda_graphs=False,
                        static_step=True, cpu_gemm="onednn")
    for spec in specs:
        cmd = child_command(spec, opts, 9999)
        assert cmd[cmd.index("--attention") + 1] == "paged"
        assert cmd[cmd.index("--cpu-gemm") + 1] == "onednn"
        assert "--no-cuda-graphs" in cmd and "--static-step" in cmd
    plain = child_command(specs[0], ServeOptions(str(tiny_models["llama"])), 9999)
    assert "--attention" not in plain and not any("graphs" in c or "static" in c for c in plain)
    assert "--cpu-gemm" not in plain


def test_adaptive_placement_packs_generations_over_real_replicas(tiny_models):
    """``--router adaptive`` with a target over the gateway's replicas: while embeddings queue,
    generations are packed onto the decoding side (one replica while it holds the target) and
    embeddings go where they finish first (mostly the other), as in the simulator's cluster."""
    from orthrus_real.cluster.machine_plan import ClusterArgs, make_replicas
    from orthrus_sim.engine.request import Request, RequestKind
    from orthrus_sim.routing.rules import AdaptivePlacement, make_router

    # the tiny model's decode step is predicted at ~2 ms: a 5 ms target leaves room to pack
    sc = parse_scenario({"name": "t", "num_requests": 1, "model": str(tiny_models["llama"]),
                         "cluster": {"gpus": 2, "router": "adaptive"},
                         "scheduler": {"tpot_target_s": 0.005}, "configurations": ["orthrus"]})
    args = ClusterArgs(replicas=2, configuration="orthrus", devices="cpu:0,cpu:0",
                       router="adaptive", threads=1, adapter=None)
    replicas = make_replicas(sc, "orthrus", args)
    target = replicas[0].spec.plan.config.tpot_target_s
    router = make_router("adaptive", replicas, target, sc.cluster.adaptive_pack)
    assert isinstance(router, AdaptivePlacement) and target == 0.005
    for i in range(100):  # embeddings queue on both replicas
        router.route(Request(f"e{i}", RequestKind.EMBEDDING, 0.0, 256))
    gens = [router.route(Request(f"g{i}", RequestKind.GENERATION, 0.0, 32, max_output_tokens=8))
            for i in range(4)]
    assert len({g.index for g in gens}) == 1 and len(router.decoding()) == 1  # packed
    late = [router.route(Request(f"x{i}", RequestKind.EMBEDDING, 0.0, 256)).index
            for i in range(20)]
    # new embeddings go mostly to the replica that does not decode
    assert late.count(gens[0].index) < late.count(1 - gens[0].index)


def test_the_gateway_plans_for_the_clients_its_scenario_has(tiny_models):
    """The adaptive planner weighs a closed loop's clients (who wait for answers) differently
    from open-loop arrivals; the gateway serving a scenario (``serve --scenario``) builds it as
    the simulated cluster does (``routing.closed_loop``), and without one (clients unknown) for
    open-loop arrivals. No processes are started."""
    from orthrus_real.cluster.machine_plan import ClusterArgs, make_replicas
    from orthrus_real.cluster.replicas import ServeOptions
    from orthrus_real.cluster.serve import cluster_scenario, make_gateway
    from orthrus_sim.routing.rules import AdaptivePlacement

    model = str(tiny_models["llama"])
    opts = ServeOptions(model)
    args = ClusterArgs(replicas=2, configuration="orthrus", devices="cpu:0,cpu:0",
                       router="adaptive", threads=1, adapter=None)
    served, _ = cluster_scenario(None, ["scheduler.tpot_target_s=0.005"], [], "ibs", args, opts)
    closed = parse_scenario({"name": "t", "num_requests": 1, "model": model,
                             "cluster": {"gpus": 2, "router": "adaptive"},
                             "workload": {"arrival": {"process": "closed-loop", "clients": 8}},
                             "scheduler": {"tpot_target_s": 0.005}, "configurations": ["orthrus"]})
    for sc, waits in ((served, False), (closed, True)):
        gateway = make_gateway(sc, make_replicas(sc, "orthrus", args), opts, False, 10.0)
        assert isinstance(gateway.router, AdaptivePlacement)
        assert gateway.router.closed_loop is waits
        assert gateway.router.planner.slo is None  # the throughput objective
    # the goodput objective reaches the gateway's planner with the scenario's SLOs
    goodput = parse_scenario({"name": "t", "num_requests": 1, "model": model,
                              "cluster": {"gpus": 2, "router": "adaptive", "objective": "goodput"},
                              "slo": {"latency_s": 0.5, "tpot_s": 0.01},
                              "scheduler": {"tpot_target_s": 0.005}, "configurations": ["orthrus"]})
    gateway = make_gateway(goodput, make_replicas(goodput, "orthrus", args), opts, False, 10.0)
    assert gateway.router.planner.slo == {"embedding": {"latency_s": 0.5},
                                          "generation": {"tpot_s": 0.01}}
    assert gateway.rule.slo == gateway.router.planner.slo  # kept for the router over those up
    # a split under the same rule and target (its replicas run as stock servers, without the
    # target) is routed by kind; the gateway is built before any replica is routable
    split = make_replicas(closed, "dedicated-1:1", args)
    gateway = make_gateway(closed, split, opts, False, 10.0)
    assert not isinstance(gateway.router, AdaptivePlacement)
    assert [r.role for r in gateway.router.replicas] == ["embedding", "generation"]
