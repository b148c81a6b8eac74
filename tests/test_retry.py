"""The gateway's retry rules without processes: the cluster-wide budget, the bound on one
request's attempts, the quarantine's expiry and size, and which requests' streams can be
continued on another replica."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from orthrus_real.cluster.relay import _one_choice  # noqa: E402
from orthrus_real.cluster.retry import Quarantine, RetryRules  # noqa: E402


def test_the_budget_is_a_share_of_the_requests_in_flight_with_a_floor():
    rules = RetryRules(budget=0.5, min_concurrency=4)
    assert rules.budget_allows(3, 0) and not rules.budget_allows(4, 0)  # the floor
    assert rules.budget_allows(49, 100) and not rules.budget_allows(50, 100)  # the share
    assert not RetryRules(budget=0.0, min_concurrency=0).budget_allows(0, 100)
    assert RetryRules(per_request=0).max_attempts >= 2  # refusals still reach another replica


@pytest.mark.parametrize("field, value", [("per_request", -1), ("budget", 1.5),
                                          ("min_concurrency", -2), ("poison_after", -1)])
def test_bad_rules_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RetryRules(**{field: value})


def test_quarantine_holds_a_body_until_it_expires_and_stays_bounded():
    q = Quarantine(seconds=10.0, capacity=3)
    key = Quarantine.fingerprint("/v1/completions", b'{"prompt": "x"}')
    assert key != Quarantine.fingerprint("/v1/embeddings", b'{"prompt": "x"}')
    q.add(key, now=0.0)
    assert q.holds(key, now=9.9) and not q.holds(key, now=10.0)
    assert not q.holds(key, now=5.0)  # expired entries are gone
    for i in range(5):
        q.add(f"k{i}", now=0.0)
    assert len(q) == 3 and not q.holds("k0", now=1.0) and q.holds("k4", now=1.0)
    assert q.total == 6


@pytest.mark.parametrize("doc, one", [
    ({"prompt": "x"}, True), ({"prompt": [1, 2, 3]}, True), ({"prompt": ["x"]}, True),
    ({"prompt": ["x", "y"]}, False), ({"prompt": [[1], [2]]}, False),
    ({"messages": [{"role": "user", "content": "hi"}]}, True), ({"prompt": "x", "n": 2}, False),
    ({}, False),
])
def test_only_a_stream_of_one_generation_is_continued(doc, one):
    assert _one_choice(doc) is one
