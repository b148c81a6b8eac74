"""A server's front end: what a request spends in the server outside the forward pass
(tokenisation, pooling output, HTTP; the cost factors' per-request overheads), one request at a
time. A replica's own (``cluster.front_end: per-replica``) or one for the whole cluster
(``shared``)."""

from __future__ import annotations

from collections.abc import Callable

import simpy

from orthrus_sim.engine.request import Request


class FrontEnd:
    """Requests pass one at a time, each for ``overhead_s(kind)`` seconds, then go on to
    ``then``."""

    def __init__(self, env: simpy.Environment, overhead_s: Callable[[str], float],
                 then: Callable[[Request], None]) -> None:
        self.env = env
        self._slot = simpy.Resource(env, 1)
        self._overhead_s = overhead_s
        self._then = then
        self.inside = 0  # requests submitted and not yet passed on (a replica drains them)

    def submit(self, request: Request) -> None:
        self.inside += 1
        self.env.process(self._through(request))

    def _through(self, request: Request):
        with self._slot.request() as slot:
            yield slot
            yield self.env.timeout(self._overhead_s(request.kind.value))
        self.inside -= 1
        self._then(request)
