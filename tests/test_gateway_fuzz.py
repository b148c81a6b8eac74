"""A schema-driven fuzz of the gateway's own OpenAPI document (schemathesis) over a 2-replica
cluster: a few hundred generated requests over every operation but the admin ones that change
the cluster; none may get a 5xx except a 503 the docs name (a replica failed, none up, the
cluster draining), every 4xx is in OpenAI's error shape, and afterwards the cluster is healthy,
both replicas up and holding nothing. Repeatable (derandomized); the model length is kept short
so a generated ``max_tokens`` cannot make a case slow."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from orthrus_real.cluster.metrics_text import sum_replicas  # noqa: E402
from orthrus_real.measure.bench import parse_prometheus  # noqa: E402
from tests.test_cluster import Cluster  # noqa: E402

CASES_PER_OPERATION = 40
DOCUMENTED_503 = {"replica_failed", "no_replica", "draining"}  # the gateway's module docs


def fuzzed(operation) -> bool:
    """Every GET, and every POST but the admin routes (restart, drain: they change the cluster)."""
    return operation.method.upper() == "GET" or not operation.path.startswith("/admin/")


# slow stage: hundreds of generated requests through a cluster; the server's own fuzz runs in the fast
# stage
@pytest.mark.slow
def test_fuzzing_the_gateways_openapi_document_finds_no_server_error(tiny_models):
    cluster = Cluster(tiny_models["llama"], "--configuration", "orthrus", "--max-model-len", "64",
                      "--token-budget", "256", "--chunk-size", "64", "--max-queued", "64",
                      "--max-inputs-per-request", "8", "--log-level", "warning")
    try:
        url = cluster.url
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        operations = [op for op in (result.ok() for result in schema.get_all_operations())
                      if fuzzed(op)]
        paths = {op.path for op in operations}
        assert {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
                "/health", "/metrics", "/replicas/{index}/metrics"} <= paths
        # the relay routes document the replica's body (the gateway forwards it unvalidated)
        doc = httpx.get(url + "/openapi.json").json()
        body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
        assert "messages" in body["content"]["application/json"]["schema"]["properties"]
        assert "$defs" not in str(doc) and "#/$defs" not in str(doc)
        statuses: Counter = Counter()
        failures: list[str] = []

        for op in operations:
            @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None,
                      derandomize=True, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy())
            def one(case):
                r = case.call(base_url=url, timeout=60)
                statuses[r.status_code] += 1
                what = f"{case.method} {case.formatted_path} {case.body!r:.300}"
                if r.status_code >= 500:
                    try:
                        code = r.json()["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = None
                    if not (r.status_code == 503 and code in DOCUMENTED_503):
                        failures.append(f"{what}: {r.status_code} {r.text[:300]}")
                elif r.status_code >= 400:  # every error in OpenAI's shape
                    try:
                        shape = set(r.json()["error"])
                    except (ValueError, KeyError, TypeError):
                        shape = None
                    if shape != {"message", "type", "param", "code"}:
                        failures.append(f"{what}: {r.status_code} not OpenAI's error shape: "
                                        f"{r.text[:300]}")

            one()
        print("fuzz cases by status:", dict(sorted(statuses.items())))
        assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:10])
        assert sum(statuses.values()) >= 200 and statuses[200] > 0 and statuses[400] > 0

        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        replicas = health.json()["replicas"]
        assert [r["up"] for r in replicas] == [True, True]
        assert all(r["in_flight"] == 0 and r["outstanding_tokens"] == 0 for r in replicas)
        _, each = sum_replicas(parse_prometheus(httpx.get(url + "/metrics", timeout=10).text))
        for i in (0, 1):
            assert each[i].get("orthrus_requests_in_flight", 0.0) == 0, each[i]
            assert each[i].get("orthrus_kv_blocks_used", 0.0) == 0, each[i]
        assert "orthrus_iterations_total" in each[0] and "orthrus_iterations_total" in each[1]
    finally:
        log = cluster.close()
    assert "Traceback" not in log, log[-5000:]
