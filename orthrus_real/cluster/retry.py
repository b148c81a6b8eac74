"""What the gateway may send again, and how much: its retry rules, the cluster-wide retry budget
and the quarantine of requests that take replicas down with them.

What is retried (``docs/cluster.md``, "Retries and migration"): a request whose replica went
down, or refused it (nothing listening, or a 503 while draining), goes to another replica that
serves its kind when that is safe: an embedding always (it is idempotent), a generation when
nothing of its answer has reached the client (non-streamed ones, streams before their first
event). A stream that has sent tokens continues on another replica from its prompt plus those
tokens (``relay.Relay``). Bounded three ways:

* per request: at most ``per_request`` retries after a replica went down with it (refusals and
  drains, where the replica never ran it, do not count, up to ``max_attempts``);
* cluster-wide (Envoy's retry budget): requests retrying at once at most ``budget`` of the
  requests in flight, or ``min_concurrency``, whichever is more, so a failing cluster is not
  handed twice its load;
* a request in flight on ``poison_after`` replicas that each went down is failed (422
  ``request_quarantined``) instead of reaching another, and the same body is refused for
  ``quarantine_s`` seconds: a request that kills its engine does not kill them all.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryRules:
    per_request: int = 2  # retries after replicas went down with the request
    budget: float = 0.5  # requests retrying at once, as a share of the requests in flight
    min_concurrency: int = 16  # ... but at least this many
    poison_after: int = 2  # replicas that went down with one request: it is quarantined
    quarantine_s: float = 600.0
    wait_s: float = 60.0  # how long a request waits for a replica of its kind that restarts

    def __post_init__(self) -> None:
        for name in ("per_request", "min_concurrency", "poison_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"retry rules: {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.budget <= 1:
            raise ValueError(f"retry rules: budget must be in [0, 1], got {self.budget}")

    @property
    def max_attempts(self) -> int:
        """Attempts of one request in all (refusals included), so no request loops forever."""
        return 2 * (self.per_request + 1) + 2

    def budget_allows(self, retrying: int, in_flight: int) -> bool:
        """One more request may start retrying while ``retrying`` are and ``in_flight`` run."""
        return retrying < max(self.min_concurrency, self.budget * in_flight)


class Quarantine:
    """Bodies of requests that replicas went down with, refused until they expire (bounded)."""

    def __init__(self, seconds: float, capacity: int = 4096) -> None:
        self.seconds, self.capacity = seconds, capacity
        self._until: OrderedDict[str, float] = OrderedDict()
        self.total = 0  # requests quarantined since start

    @staticmethod
    def fingerprint(path: str, body: bytes) -> str:
        return hashlib.sha256(path.encode() + b"\0" + body).hexdigest()

    def add(self, key: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._until[key] = now + self.seconds
        self._until.move_to_end(key)
        self.total += 1
        while len(self._until) > self.capacity:
            self._until.popitem(last=False)

    def holds(self, key: str, now: float | None = None) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if (time.monotonic() if now is None else now) >= until:
            del self._until[key]
            return False
        return True

    def __len__(self) -> int:
        return len(self._until)
