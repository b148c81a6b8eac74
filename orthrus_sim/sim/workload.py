"""Clients and arrival processes: closed-loop, open-loop (Poisson, gamma), bursts, phases,
Iter-RetGen workflows and trace replay. Each client draws from its own seeded stream, so every
configuration of a scenario sees the same requests (common random numbers)."""

from __future__ import annotations

import csv
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import simpy

from orthrus_sim.engine.request import Request, RequestKind
from orthrus_sim.scenario import Scenario

EMB, GEN = RequestKind.EMBEDDING, RequestKind.GENERATION


@dataclass
class Workflow:
    workflow_id: int
    start: float
    end: float | None = None
    iterations_done: int = 0
    request_ids: list[str] = field(default_factory=list)


def load_trace(path: str) -> list[dict]:
    """Rows ``{arrival_time, kind, input_tokens, output_tokens}`` from JSONL or CSV."""
    p = Path(path)
    if p.suffix == ".jsonl":
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    else:
        with p.open() as fh:
            rows = list(csv.DictReader(fh))
    out = []
    for i, row in enumerate(rows, start=1):
        try:
            kind = str(row["kind"]).strip()
            if kind not in ("embedding", "generation"):
                raise ValueError(f"kind must be embedding or generation, got {kind!r}")
            out.append({
                "arrival_time": float(row["arrival_time"]), "kind": kind,
                "input_tokens": int(row["input_tokens"]),
                "output_tokens": int(row.get("output_tokens") or 0) if kind == "generation" else 0,
            })
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"trace {path}, row {i}: {exc}") from None
    return sorted(out, key=lambda r: r["arrival_time"])


class Phases:
    """The workload's phases: which one is current, by simulated time or by units of work
    started, and the generation share it sets. Shared with the live load generator."""

    def __init__(self, workload) -> None:
        self.workload = workload
        phases = workload.phases
        self.by_count = bool(phases) and phases[0].requests is not None
        self.ends = list(itertools.accumulate(
            (p.requests if self.by_count else p.duration_s) for p in phases))

    def __bool__(self) -> bool:
        return bool(self.ends)

    def index(self, now: float, units: int) -> int:
        position = units if self.by_count else now
        for i, end in enumerate(self.ends):
            if position < end or (self.by_count and position == end):
                return i
        return len(self.ends) - 1

    def generation_share(self, now: float, units: int) -> float:
        if not self.ends:
            return self.workload.generation_share
        return self.workload.phases[self.index(now, units)].generation_share

    def exhausted(self, units: int) -> bool:
        """Count-based phases end the workload once their requests have all started."""
        return self.by_count and units >= self.ends[-1]


def interarrival(arrival, rng: np.random.Generator) -> float:
    """Seconds to the next open-loop arrival: exponential (Poisson) or gamma with the given CV."""
    if arrival.process == "poisson":
        return rng.exponential(1.0 / arrival.rate)
    shape = 1.0 / arrival.cv**2
    return rng.gamma(shape, 1.0 / (arrival.rate * shape))


def sample_synthetic(workload, rng: np.random.Generator, share: float) -> tuple[RequestKind, int, int]:
    """Kind, input tokens and output tokens of one synthetic request."""
    if rng.random() < share:
        return GEN, workload.generation_prompt.sample(rng), workload.generation_output.sample(rng)
    return EMB, workload.embedding_input.sample(rng), 0


class Driver:
    """Issues the scenario's requests into a cluster and tracks what is outstanding."""

    def __init__(self, env: simpy.Environment, scenario: Scenario, submit) -> None:
        self.env = env
        self.scenario = scenario
        self._submit = submit
        self.workload = scenario.workload
        self.issued: list[Request] = []
        self.workflows: list[Workflow] = []
        self._ids = itertools.count()
        self._units = 0  # requests (or workflows) started, against num_requests
        self.outstanding = 0
        self.issuing_done = False
        self.all_done = env.event()
        self.phases = Phases(self.workload)
        self.phase_of: dict[str, int] = {}

    # ----- bookkeeping -------------------------------------------------------------------
    def _may_start(self) -> bool:
        s = self.scenario
        if self.phases.exhausted(self._units):
            return False
        if s.duration_s is not None and self.env.now >= s.duration_s:
            return False
        if s.num_requests is not None and self._units >= s.num_requests:
            return False
        return True

    def _start_unit(self) -> bool:
        if not self._may_start():
            self._finish_issuing()
            return False
        self._units += 1
        return True

    def _finish_issuing(self) -> None:
        self.issuing_done = True
        self._check_done()

    def _check_done(self) -> None:
        if self.issuing_done and self.outstanding == 0 and not self.all_done.triggered:
            self.all_done.succeed()

    def request_done(self, request: Request) -> None:
        self.outstanding -= 1
        request.payload.succeed(request)
        self._check_done()

    def submit(self, kind: RequestKind, input_len: int, output_len: int) -> simpy.Event:
        rid = f"{'e' if kind is EMB else 'g'}{next(self._ids)}"
        req = Request(rid, kind, self.env.now, input_len,
                      max_output_tokens=output_len if kind is GEN else 0,
                      pooling=self.scenario.embedding.pooling)
        req.payload = self.env.event()
        if self.phases:
            self.phase_of[rid] = self.phases.index(self.env.now, self._units)
        self.issued.append(req)
        self.outstanding += 1
        self._submit(req)
        return req.payload

    # ----- what to send --------------------------------------------------------------------
    def _synthetic(self, rng: np.random.Generator) -> simpy.Event:
        share = self.phases.generation_share(self.env.now, self._units)
        return self.submit(*sample_synthetic(self.workload, rng, share))

    def _workflow(self, rng: np.random.Generator):
        cfg = self.workload.iter_retgen
        flow = Workflow(len(self.workflows), self.env.now)
        self.workflows.append(flow)
        question = cfg.question_tokens.sample(rng)
        answer = 0
        for _ in range(cfg.iterations):
            emb = yield self.submit(EMB, question + answer, 0)
            flow.request_ids.append(emb.request_id)
            if cfg.retrieval_latency_s:
                yield self.env.timeout(cfg.retrieval_latency_s)
            docs = cfg.docs_per_query.sample(rng)
            prompt = question + sum(cfg.doc_tokens.sample(rng) for _ in range(docs))
            if cfg.max_prompt_tokens:
                prompt = min(prompt, cfg.max_prompt_tokens)
            gen = yield self.submit(GEN, prompt, cfg.output_tokens.sample(rng))
            flow.request_ids.append(gen.request_id)
            answer = gen.num_generated
            flow.iterations_done += 1
        flow.end = self.env.now

    def _one(self, rng: np.random.Generator):
        """One unit of work: a synthetic request or a whole workflow; yields until it is done."""
        if self.workload.kind == "iter-retgen":
            yield from self._workflow(rng)
        else:
            yield self._synthetic(rng)

    # ----- arrival processes -------------------------------------------------------------
    def start(self) -> None:
        w, a = self.workload, self.workload.arrival
        seed = self.scenario.seed
        if w.kind == "trace":
            self.env.process(self._replay(load_trace(w.trace)))
        elif a.process == "closed-loop":
            for c in range(a.clients):
                self.env.process(self._client(np.random.default_rng([seed, 1, c])))
        elif a.process == "burst":
            self._burst(np.random.default_rng([seed, 2]))
        else:
            self.env.process(self._open_loop(np.random.default_rng([seed, 3])))

    def _client(self, rng: np.random.Generator):
        think = self.workload.arrival.think_time_s
        while self._start_unit():
            yield from self._one(rng)
            if think:
                yield self.env.timeout(rng.exponential(think))

    def _burst(self, rng: np.random.Generator) -> None:
        w = self.workload
        if w.kind == "iter-retgen":
            for _ in range(self.scenario.num_requests or w.arrival.clients):
                self._units += 1
                self.env.process(self._one_detached())
        else:
            for group in w.burst:
                kind = GEN if group.kind == "generation" else EMB
                for _ in range(group.count):
                    self._units += 1
                    if kind is GEN:
                        self.submit(GEN, w.generation_prompt.sample(rng), w.generation_output.sample(rng))
                    else:
                        self.submit(EMB, w.embedding_input.sample(rng), 0)
        self._finish_issuing()

    def _one_detached(self):
        # a workflow gets its own stream so its draws do not depend on interleaving
        yield from self._one(np.random.default_rng([self.scenario.seed, 4, len(self.workflows)]))

    def _open_loop(self, rng: np.random.Generator):
        while True:
            yield self.env.timeout(interarrival(self.workload.arrival, rng))
            if not self._start_unit():
                return
            if self.workload.kind == "iter-retgen":
                self.env.process(self._one_detached())
            else:
                self._synthetic(rng)

    def _replay(self, rows: list[dict]):
        for row in rows:
            if row["arrival_time"] > self.env.now:
                yield self.env.timeout(row["arrival_time"] - self.env.now)
            if not self._start_unit():
                return
            kind = GEN if row["kind"] == "generation" else EMB
            self.submit(kind, row["input_tokens"], row["output_tokens"])
        self._finish_issuing()
