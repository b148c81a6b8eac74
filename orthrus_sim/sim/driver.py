"""The workload's sources as SimPy processes: one process per client (SimPy's own style).

The generator (``orthrus_sim.experiment.workload``) decides what to send and when; this driver
turns its actions into SimPy events and hands requests to the cluster.
"""

from __future__ import annotations

from collections.abc import Callable

import simpy

from orthrus_sim.engine.request import Request, RequestState
from orthrus_sim.experiment.results import RequestLog
from orthrus_sim.experiment.scenario import Scenario
from orthrus_sim.experiment.workload import (
    Client,
    Outcome,
    Retrieve,
    Send,
    Spawn,
    Wait,
    WaitUntil,
    Workload,
)


def outcome_of(request: Request) -> Outcome:
    if request.state is RequestState.FINISHED:
        return Outcome("finished", request.num_generated)
    if request.state is RequestState.REJECTED:
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
        self.workload = Workload(scenario, lambda: env.now, keep_specs)
        self.outstanding = 0
        self._running = 0  # client processes still alive
        self.all_done = env.event()  # every source ended and every request left

    @property
    def workflows(self):
        return self.workload.workflows

    def start(self) -> None:
        for _, client in self.workload.clients():
            self._spawn(client)

    def _spawn(self, client: Client) -> None:
        self._running += 1
        self.env.process(self._run(client))

    def request_done(self, request: Request) -> None:
        """The cluster's callback: ``request`` finished or was rejected."""
        self.outstanding -= 1
        self.log.ended(request)
        if request.payload is not None:  # a client waits for it
            request.payload.succeed(request)
        self._check_done()

    def _check_done(self) -> None:
        if self._running == 0 and self.outstanding == 0 and not self.all_done.triggered:
            self.all_done.succeed()

    def _send(self, send: Send) -> simpy.Event | None:
        """Submit the request; the event its client waits on (None when it does not wait)."""
        spec = send.spec
        req = Request(spec.request_id, spec.kind, self.env.now, spec.input_len,
                      max_output_tokens=spec.max_output_tokens,
                      pooling=self.scenario.embedding.pooling)
        req.payload = self.env.event() if send.wait else None
        self.log.sent(req, spec.phase)
        self.outstanding += 1
        self._submit(req)
        return req.payload

    def _run(self, client: Client):
        env = self.env
        value = None
        try:
            while True:
                try:
                    action = client.send(value)
                except StopIteration:
                    return
                value = None
                if isinstance(action, Send):
                    done = self._send(action)
                    if done is not None:
                        value = outcome_of((yield done))
                elif isinstance(action, Wait):
                    yield env.timeout(action.seconds)
                elif isinstance(action, WaitUntil):
                    if action.time > env.now:
                        yield env.timeout(action.time - env.now)
                elif isinstance(action, Spawn):
                    self._spawn(action.client)
                elif isinstance(action, Retrieve):
                    value = list(action.fallback)  # no vectors in a simulation
                else:
                    raise TypeError(f"unknown workload action {action!r}")
        finally:
            self._running -= 1
            self._check_done()
