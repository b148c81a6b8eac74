"""The workload's sources as SimPy processes: one process per client (SimPy's own style).

The generator (``orthrus_sim.experiment.workload``) decides what to send and when, and its
``interpret`` carries the actions out; this driver is its host: SimPy events for the waits, and
requests handed to the cluster.
"""

from __future__ import annotations

from collections.abc import Callable

import simpy
from simpy import Event
from simpy.events import Timeout

from orthrus_sim.engine.request import FINISHED, REJECTED, Request
from orthrus_sim.experiment.results import RequestLog
from orthrus_sim.experiment.scenario import Scenario
from orthrus_sim.experiment.slo import ATTAINMENT_EPS
from orthrus_sim.experiment.workload import Client, Outcome, Retrieve, Send, Workload, interpret


def outcome_of(request: Request) -> Outcome:
    state = request.state
    if state is FINISHED:
        return Outcome("finished", request.num_generated)
    if state is REJECTED:
        return Outcome("rejected", reason=request.reject_reason)
    return Outcome("unfinished", request.num_generated)


class SimDriver:
    """Issues the workload's requests into ``submit`` and tracks what is outstanding."""

    def __init__(self, env: simpy.Environment, scenario: Scenario,
                 submit: Callable[[Request], None], log: RequestLog, keep_specs: bool = False) -> None:
        self.env = env
        self.scenario = scenario
        self._submit = submit
        self.log = log
        self.workload = Workload(scenario, lambda: env._now, keep_specs)
        self._pooling = scenario.embedding.pooling
        self.outstanding = 0
        self._running = 0  # client processes still alive
        self.all_done = env.event()  # every source ended and every request left
        # scenario.stop_below_attainment: per kind that can stop the run, the requests it sends
        self.stopped = env.event()
        self._floor = scenario.stop_below_attainment
        self._most: dict[str, int] = {}
        if self._floor is not None and log.slo is not None:
            self._most = {k: n for k, n in self.workload.most_requests().items() if n}

    @property
    def workflows(self):
        return self.workload.workflows

    def start(self) -> None:
        for _, client in self.workload.clients():
            self.spawn(client)

    def request_done(self, request: Request) -> None:
        """The cluster's callback: ``request`` finished or was rejected."""
        self.outstanding -= 1
        self.log.ended(request)
        if self._most:
            self._check_misses(request.kind._value_)
        if request.payload is not None:  # a client waits for it
            request.payload.succeed(outcome_of(request))
        self._check_done()

    def _check_misses(self, kind: str) -> None:
        """Stop the run once ``kind`` missed more than its attainment floor allows of the most
        requests it can send: its attainment is then below the floor whatever follows."""
        most = self._most.get(kind)
        missed = self.log.slo.missed[kind]
        # more misses than this: at best (most - missed) / most < floor - ATTAINMENT_EPS
        if most is not None and missed > (1.0 - self._floor + ATTAINMENT_EPS) * most \
                and not self.stopped.triggered:
            self.stopped.succeed({"kind": kind, "missed": missed, "most_requests": most,
                                  "time_s": self.env.now})

    def _check_done(self) -> None:
        if self._running == 0 and self.outstanding == 0 and not self.all_done.triggered:
            self.all_done.succeed()

    # ----- the host of ``interpret``: SimPy events ------------------------------------------
    def now(self) -> float:
        return self.env._now  # SimPy's clock without its property (sim/replica.py)

    def issue(self, send: Send) -> simpy.Event | None:
        """Submit the request; the event its client waits on (None when it does not wait)."""
        spec = send.spec
        env = self.env
        # positional (token_ids None, then the pooling head): a keyword costs 20 % of the call
        req = Request(spec.request_id, spec.kind, env._now, spec.tokens.length,
                      spec.max_output_tokens, None, self._pooling)
        req.payload = Event(env) if send.wait else None
        self.log.sent(req, spec.phase)
        self.outstanding += 1
        self._submit(req)
        return req.payload

    def sleep(self, seconds: float) -> simpy.Event:
        return Timeout(self.env, seconds)

    def spawn(self, client: Client) -> None:
        """Start ``client`` as a SimPy process (``interpret`` itself, with no wrapper: every
        resumption of a client passes one generator fewer); its end is counted when it ends."""
        self._running += 1
        self.env.process(interpret(client, self)).callbacks.append(self._client_ended)

    def retrieve(self, action: Retrieve) -> list[int]:
        return list(action.fallback)  # no vectors in a simulation

    def _client_ended(self, _process: simpy.Process) -> None:
        self._running -= 1
        self._check_done()
