"""A schema-driven fuzz of the server's own OpenAPI document (schemathesis): a few hundred
generated requests over every operation; none may get a 5xx, and the server is healthy and
holds nothing afterwards. Repeatable (derandomized); the model length is kept short so a
generated ``max_tokens`` cannot make a case slow."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from orthrus_sim.engine import SchedulerConfig  # noqa: E402
from tests.test_server import metric, start_server  # noqa: E402

CASES_PER_OPERATION = 40


# slow stage: 40 generated cases per operation; the fast stage sends each refusal by hand
# (test_server_limits, test_server_isolation)
@pytest.mark.slow
def test_fuzzing_the_openapi_document_finds_no_server_error(tiny_models):
    url, runner = start_server(tiny_models["llama"], max_queued=64, max_inputs_per_request=8,
                               scheduler=SchedulerConfig(max_model_len=64, token_budget=256,
                                                         chunk_size=64))
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    statuses: Counter = Counter()
    failures: list[str] = []

    for op in operations:
        @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def one(case):
            r = case.call(base_url=url, timeout=60)
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} {case.body!r:.300}: "
                                f"{r.status_code} {r.text[:300]}")
            elif r.status_code >= 400:  # every error in OpenAI's shape
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text

        one()
    print("fuzz cases by status:", dict(statuses))
    assert not failures, "\n".join(failures[:10])
    assert sum(statuses.values()) >= 200 and statuses[200] > 0 and statuses[400] > 0
    assert httpx.get(url + "/health").status_code == 200
    text = httpx.get(url + "/metrics").text
    assert metric(text, "orthrus_requests_in_flight") == 0
    assert metric(text, "orthrus_kv_blocks_used") == 0
    assert runner.failed is None
