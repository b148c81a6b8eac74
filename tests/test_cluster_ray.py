"""The same cluster as a Ray Serve application on a local Ray instance (``serve --ray local``):
a dedicated-1:2 split routes by kind and round-robin over its two generation replicas, each
side refuses the other kind, a generation replica killed mid-stream fails its request while
the other serves on and Ray Serve brings it back, SIGTERM drains."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.ray_serve, pytest.mark.slow]  # Ray Serve: a minute and a half

from tests.test_cluster import REPLICA, Cluster, gen, kill_mid_stream, sigterm_mid_stream  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster(tiny_models):
    c = Cluster(tiny_models["llama"], "--configuration", "dedicated-1:2", "--ray", "local",
                replicas=3, devices="cpu:0,cpu:1,cpu:1" if (os.cpu_count() or 1) >= 2 else "cpu:0",
                start_timeout=240.0)
    # the gateway answers while the driver still waits for every deployment to be healthy
    c.wait_for_log(f"orthrus ready: http://127.0.0.1:{c.port}")
    yield c
    c.close()


def test_ray_routes_by_kind_round_robin_and_each_side_refuses_the_other(ray_cluster):
    url = ray_cluster.url
    with httpx.Client(base_url=url, timeout=60) as c:
        embeds = [c.post("/v1/embeddings", json={"input": f"doc {i}"}) for i in range(3)]
        gens = [c.post("/v1/completions", json=gen([4, 5 + i])) for i in range(4)]
        assert all(r.status_code == 200 for r in embeds + gens)
        assert [r.headers[REPLICA] for r in embeds] == ["0"] * 3
        assert [r.headers[REPLICA] for r in gens] == ["1", "2", "1", "2"]
        replicas = ray_cluster.health()["replicas"]
        assert [r["role"] for r in replicas] == ["embedding", "generation", "generation"]
        wrong = c.post(replicas[0]["url"] + "/v1/completions", json=gen([4, 5]))
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_replica_kind"
        wrong = c.post(replicas[1]["url"] + "/v1/embeddings", json={"input": "x"})
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_replica_kind"
        text = c.get("/metrics").text
        assert all(f'orthrus_iterations_total{{replica="{i}"}}' in text for i in range(3))


def test_ray_replica_killed_mid_stream_goes_on_elsewhere_and_ray_brings_it_back(ray_cluster):
    """The gateway's retries under Ray Serve: the killed replica's stream continues on the
    other generation replica from the tokens it sent (every token once, the same greedy text)."""
    url = ray_cluster.url
    with httpx.Client(base_url=url, timeout=60) as c:
        refs = {n: c.post("/v1/completions", json=gen([7] * 8, n)).json()["choices"][0]["text"]
                for n in (400, 60)}
    victim = ray_cluster.health()["replicas"][1]
    results = kill_mid_stream(url, victim, texts=True)
    # which stream reached the victim depends on the order they arrived in: each is judged
    # against its own length
    for where in ("1", "2"):  # the victim's went on elsewhere, the other's finished in full
        chunks, error, asked, text = results[where]
        assert error is None and chunks == asked and text == refs[asked], where
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json=gen([5, 6], 3))
        # served by the replica up: the other one, or replica 1 only once Ray Serve has already
        # brought it back in a new process (on a slow machine that can come first)
        assert r.status_code == 200
        if r.headers[REPLICA] == "1":
            assert ray_cluster.health()["replicas"][1]["pid"] != victim["pid"]
        for _ in range(900):  # Ray Serve starts a new replica; the gateway routes to it again
            health = ray_cluster.health()
            if health["replicas"][1]["up"]:
                break
            time.sleep(0.2)
        assert health["status"] == "ok" and health["replicas"][1]["pid"] != victim["pid"]
        seen = {c.post("/v1/completions", json=gen([5, 6], 3)).headers[REPLICA] for _ in range(2)}
        assert seen == {"1", "2"}


def test_ray_sigterm_drains(ray_cluster):
    chunks = sigterm_mid_stream(ray_cluster, 1200)
    assert chunks == 1200
    assert ray_cluster.proc.wait(120) == 0
    assert "stopped" in ray_cluster.close()


def test_ray_sigterm_while_the_application_starts_drains_instead_of_killing(tiny_models):
    """A SIGTERM the moment the gateway answers (the driver still waits in ``serve.run``) is
    caught, not left to Ray's handler that ends the driver and so every replica unasked."""
    c = Cluster(tiny_models["llama"], "--configuration", "orthrus", "--ray", "local",
                replicas=1, devices="cpu:0", start_timeout=240.0)
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(120) == 0
    log = c.close()
    assert "SIGTERM received" not in log and "draining" in log and "stopped" in log
