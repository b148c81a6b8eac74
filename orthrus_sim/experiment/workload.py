"""The workload generator: given a scenario and its seed, the exact requests and when to send them.

Every source of load (a closed-loop client, an open-loop or burst source, a trace, an Iter-RetGen
workflow) is a plain Python generator that yields *actions*; a driver carries them out and sends
the result back. The simulator's driver (``orthrus_sim.sim.driver``) runs them as SimPy
processes, ``orthrus-real bench`` as asyncio tasks, so a scenario is the same experiment
simulated and measured::

    Wait(seconds)        sleep (think time)          -> None
    WaitUntil(t)         sleep until time t (s)      -> None
    Send(spec, wait)     send one request            -> its Outcome (wait=True), else None
    Spawn(name, client)  start another source        -> None
    Retrieve(query, k, fallback)  vector search (live) -> document indices

What a request holds is a function of the seed and of its place in its client's stream only
(never of timing): a client draws kinds and lengths from its own stream, and token ids are
seeded segments (``Tokens``) materialised on demand, so the simulator never builds them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from orthrus_sim.engine.request import RequestKind
from orthrus_sim.experiment.arrivals import Modulation, arrival_times
from orthrus_sim.experiment.scenario import Pool, Scenario, pool_stream
from orthrus_sim.experiment.trace import load_trace

EMB, GEN = RequestKind.EMBEDDING, RequestKind.GENERATION
FIRST_TOKEN_ID = 4  # ids below are left to special tokens
MAX_ZERO_TIME_REJECTIONS = 64

_MASK = (1 << 64) - 1


def mix(*values: int) -> int:
    """A 64-bit seed from integers (splitmix64 over them): cheap, stable across processes."""
    return mix_on(0x9E3779B97F4A7C15, values)


def mix_on(h: int, values) -> int:
    """``mix`` continued from the state ``h`` (``mix(*a, *b) == mix_on(mix(*a), b)``), so a
    client's constant prefix (the seed and its name) is mixed once."""
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK
        h ^= h >> 29
    return h


class Tokens:
    """Token ids as seeded segments ``(seed, skip, length)``: segment ids are the draws
    ``skip .. skip+length`` of ``default_rng(seed)`` in ``[FIRST_TOKEN_ID, vocab)``.

    A value: never changed once made (every operation returns a new one). A plain slotted
    class, not a frozen dataclass: one is made per request, and a frozen dataclass's
    ``__init__`` costs several times as much. A synthetic request's seed is mixed when its
    segments are first read (``mixed``): a simulation reads only the length."""

    __slots__ = ("_segments", "length", "_mix")

    def __init__(self, segments: tuple[tuple[int, int, int], ...] = ()) -> None:
        self._segments = segments
        self.length = sum(n for _, _, n in segments)
        self._mix = None

    @classmethod
    def seeded(cls, seed: int, length: int) -> Tokens:
        return cls(((seed, 0, length),)) if length > 0 else cls()

    @classmethod
    def mixed(cls, prefix: int, n: int, length: int) -> Tokens:
        """``seeded(mix_on(prefix, (n,)), length)``, the seed mixed when first read."""
        if length <= 0:
            return cls()
        tokens = object.__new__(cls)
        tokens._segments = None
        tokens.length = length
        tokens._mix = (prefix, n)
        return tokens

    @property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        segments = self._segments
        if segments is None:
            prefix, n = self._mix
            segments = self._segments = ((mix_on(prefix, (n,)), 0, self.length),)
        return segments

    def __len__(self) -> int:
        return self.length

    def __eq__(self, other: object) -> bool:
        return type(other) is Tokens and other.segments == self.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    def __repr__(self) -> str:
        return f"Tokens(segments={self.segments!r})"

    def __add__(self, other: Tokens) -> Tokens:
        return Tokens(self.segments + other.segments)

    def tail(self, n: int) -> Tokens:
        """The last ``n`` tokens."""
        out: list[tuple[int, int, int]] = []
        need = n
        for seed, skip, length in reversed(self.segments):
            if need <= 0:
                break
            take = min(length, need)
            out.append((seed, skip + length - take, take))
            need -= take
        return Tokens(tuple(reversed(out)))

    def ids(self, vocab: int = 500) -> list[int]:
        if vocab <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab must be larger than {FIRST_TOKEN_ID}, got {vocab}")
        ids: list[int] = []
        for seed, skip, length in self.segments:
            draws = np.random.default_rng(seed).integers(FIRST_TOKEN_ID, vocab, size=skip + length)
            ids.extend(int(t) for t in draws[skip:])
        return ids


# The request and the per-request actions (Send, Wait, WaitUntil) are named tuples: immutable
# values made once per request, for a fraction of a frozen dataclass's cost. As tuples they
# compare equal to tuples of the same fields (nothing compares them) and change with
# ``_replace``, not ``dataclasses.replace``. The workload's hot path makes them with
# ``tuple.__new__`` and every field given: the same value, without the class's Python-level
# ``__new__`` (one call per request fewer).

class RequestSpec(NamedTuple):
    """One request as the workload defines it."""

    request_id: str
    kind: RequestKind
    tokens: Tokens
    max_output_tokens: int  # 0 for embeddings
    client: str
    intended_at: float | None = None  # its scheduled send time (open loop, burst, trace)
    phase: int | None = None
    workflow: int | None = None

    @property
    def input_len(self) -> int:
        return self.tokens.length


@dataclass
class Outcome:
    """How a sent request ended, as the driver reports it back to its client."""

    state: str  # finished | rejected | unfinished
    num_generated: int = 0
    embedding: list[float] | None = None
    reason: str | None = None


class Wait(NamedTuple):
    seconds: float


class WaitUntil(NamedTuple):
    time: float


class Send(NamedTuple):
    spec: RequestSpec
    wait: bool = True


_make = tuple.__new__  # a named tuple from all its fields (see above)


@dataclass(frozen=True)
class Spawn:
    name: str
    client: Generator


@dataclass(frozen=True)
class Retrieve:
    query: list[float] | None
    k: int
    fallback: tuple[int, ...]  # the seeded choice, for a driver without vector search


Client = Generator[Any, Any, Any]


class Host(Protocol):
    """What a driver provides to carry out actions: the SimPy one's waitables are events, the
    asyncio one's awaitables; ``interpret`` only passes them through."""

    def now(self) -> float: ...
    def issue(self, send: Send) -> Any: ...  # what waits for its Outcome, or None (wait=False)
    def sleep(self, seconds: float) -> Any: ...
    def spawn(self, client: Client) -> None: ...
    def retrieve(self, action: Retrieve) -> list[int]: ...


def interpret(client: Client, host: Host) -> Generator[Any, Any, None]:
    """Carry out ``client``'s actions through ``host``: the one interpreter of both drivers.
    It yields the host's waitables and takes back what they give (an Outcome, or None), so a
    SimPy process runs it as it is and an asyncio task awaits each one (``run_async``)."""
    value = None
    while True:
        try:
            action = client.send(value)
        except StopIteration:
            return
        value = None
        if isinstance(action, Send):
            waitable = host.issue(action)
            if waitable is not None:
                value = yield waitable
        elif isinstance(action, Wait):
            yield host.sleep(action.seconds)
        elif isinstance(action, WaitUntil):
            delay = action.time - host.now()
            if delay > 0:
                yield host.sleep(delay)
        elif isinstance(action, Spawn):
            host.spawn(action.client)
        elif isinstance(action, Retrieve):
            value = host.retrieve(action)
        else:
            raise TypeError(f"unknown workload action {action!r}")


async def run_async(steps: Generator[Any, Any, None]) -> None:
    """The asyncio adapter of ``interpret``: await each waitable, send its result back."""
    value = None
    while True:
        try:
            waitable = steps.send(value)
        except StopIteration:
            return
        value = await waitable


@dataclass
class WorkflowRecord:
    workflow_id: int
    start: float
    end: float | None = None
    iterations_done: int = 0
    request_ids: list[str] = field(default_factory=list)
    failed: str | None = None  # why it stopped early (a step was rejected)


def embedding_limit(s: Scenario) -> int:
    """The longest embedding input the embedding model takes (its positions, or
    ``scheduler.max_model_len`` or ``embedding.max_input_tokens`` where shorter): a trace's
    longer inputs are cut to it."""
    from orthrus_sim.costmodel import get_model

    limit = get_model(s.embedding.model or s.model).max_position_embeddings
    return min(limit, s.scheduler.max_model_len or limit, s.embedding.max_input_tokens or limit)


def embeddings_cut(rows: list[dict] | tuple[dict, ...], kind: str | None,
                   limit: int) -> list[dict]:
    """A trace's rows with each embedding's input cut to ``limit`` tokens (``kind``: the
    pool's, or None where each row gives its own); a row not cut is the same object."""
    return [dict(r, input_tokens=limit) if (kind or r["kind"]) == "embedding"
            and r["input_tokens"] > limit else r for r in rows]


class Workload:
    """The scenario's sources of load, sharing one clock and the units-of-work count.

    ``clock()`` is the driver's time in seconds (simulated, or since the run started).
    """

    def __init__(self, scenario: Scenario, clock: Callable[[], float], keep_specs: bool = False) -> None:
        self.scenario = scenario
        self.workload = scenario.workload
        self.clock = clock
        self.seed = scenario.seed
        self.units = 0  # requests or workflows started (num_requests and count phases)
        self.workflows: list[WorkflowRecord] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []  # how the load was made from its sources (a trace's scaling)
        self.specs: list[RequestSpec] | None = [] if keep_specs else None
        self._workflow_ids = itertools.count()
        w = self.workload
        self._by_count = bool(w.phases) and w.phases[0].requests is not None
        self._phase_ends = list(itertools.accumulate(
            (p.requests if self._by_count else p.duration_s) for p in w.phases))
        self._corpus: list[Tokens] | None = None
        self._client_seeds: dict[str, int] = {}
        self._prompt_length = w.generation_prompt.sampler()
        self._output_length = w.generation_output.sampler()
        self._embedding_length = w.embedding_input.sampler()

    def _client_seed(self, client: str) -> int:
        """``mix`` of the seed and the client's name: the prefix of its requests' token seeds."""
        seed = self._client_seeds.get(client)
        if seed is None:
            seed = self._client_seeds[client] = mix(self.seed, *map(ord, client))
        return seed

    # ----- when the workload stops --------------------------------------------------------
    def phase(self) -> int | None:
        if not self._phase_ends:
            return None
        position = self.units if self._by_count else self.clock()
        for i, end in enumerate(self._phase_ends):
            if position < end or (self._by_count and position == end):
                return i
        return len(self._phase_ends) - 1

    def _start_unit(self, until: float | None = None) -> int | None | bool:
        """Count one more unit of work if the workload (and the source's own window) allows
        it; returns its phase (None without phases), or False when no unit may start."""
        s, now = self.scenario, self.clock()
        if s.duration_s is not None and now >= s.duration_s:
            return False
        if until is not None and now >= until:
            return False
        if s.num_requests is not None and self.units >= s.num_requests:
            return False
        if self._by_count and self.units >= self._phase_ends[-1]:
            return False
        self.units += 1
        return self.phase()

    def _share(self, pool: Pool, phase: int | None) -> float:
        if pool.generation_share is not None:
            return pool.generation_share
        if phase is not None and self.workload.phases[phase].generation_share is not None:
            return self.workload.phases[phase].generation_share
        return self.workload.generation_share

    # ----- what to send ---------------------------------------------------------------------
    def _spec(self, kind: RequestKind, tokens: Tokens, n_out: int, rid: str, client: str,
              phase: int | None, intended: float | None = None,
              workflow: int | None = None) -> RequestSpec:
        spec = _make(RequestSpec, (rid, kind, tokens, n_out if kind is GEN else 0, client, intended,
                                   phase, workflow))
        if self.specs is not None:
            self.specs.append(spec)
        return spec

    def _request(self, pool: Pool, rng: np.random.Generator, client: str, seed: int, n: int,
                 phase: int | None, intended: float | None = None) -> Send:
        """Request ``n`` of ``client``, a synthetic one: its kind and lengths drawn from
        ``rng``, its tokens seeded by ``seed`` (the client's prefix) and ``n``."""
        if pool.kind == "mixed":
            kind = GEN if rng.random() < self._share(pool, phase) else EMB
        else:
            kind = GEN if pool.kind == "generation" else EMB
        if kind is GEN:
            n_in, n_out = self._prompt_length(rng), self._output_length(rng)
        else:
            n_in, n_out = self._embedding_length(rng), 0
        rid = f"{'e' if kind is EMB else 'g'}-{client}-{n}"
        spec = self._spec(kind, Tokens.mixed(seed, n, n_in), n_out, rid, client,
                          phase, intended)
        return _make(Send, (spec, intended is None))

    def corpus(self) -> list[Tokens]:
        """The Iter-RetGen retrieval corpus: seeded documents (the same in every run)."""
        if self._corpus is None:
            cfg = self.workload.iter_retgen
            rng = np.random.default_rng([self.seed, 9])
            self._corpus = [Tokens.seeded(mix(self.seed, 9, i), cfg.doc_tokens.sample(rng))
                            for i in range(cfg.corpus_size)]
        return self._corpus

    # ----- sources --------------------------------------------------------------------------
    def most_requests(self) -> dict[str, int | None]:
        """Per kind, the most requests the sources will send (None: a source of that kind is
        open-ended: a closed loop, workflows, an open loop with no duration_s or num_requests).
        Trace pools send their window's rows, burst pools their count, open loops what a dry
        run of their source sends (``_dry_count``)."""
        w = self.workload
        out: dict[str, int | None] = {"embedding": 0, "generation": 0}
        if w.kind == "trace":
            rows = load_trace(w.trace)
            for r in rows:
                out[r["kind"]] += 1
            return out
        if w.kind != "synthetic" or w.phases:
            return dict.fromkeys(out)
        s = self.scenario
        for i, pool in enumerate(w.default_pools()):
            if pool.process == "trace":
                rows = pool.replay().rows
                for kind in out:
                    if out[kind] is not None:
                        out[kind] += sum((pool.kind if pool.kind != "mixed" else r["kind"])
                                         == kind for r in rows)
                continue
            if pool.kind == "workflow":  # a workflow sends both kinds, as many as it takes
                return dict.fromkeys(out)
            if pool.process == "burst":
                sent = {k: pool.count if pool.kind in (k, "mixed") else 0 for k in out}
            elif pool.process == "closed-loop" or (s.duration_s is None
                                                   and s.num_requests is None):
                sent = {k: None if pool.kind in (k, "mixed") else 0 for k in out}
            else:
                sent = self._dry_count(pool, i)
            out = {k: None if n is None or sent[k] is None else n + sent[k]
                   for k, n in out.items()}
        return out

    def _dry_count(self, pool: Pool, position: int) -> dict[str, int]:
        """What an open-loop pool sends, per kind: its source run without a simulator, on a
        workload of its own (its sends do not wait, so it makes the same draws in the same
        order as in the run, and ends where the run's would: duration_s, num_requests)."""
        now = [0.0]
        dry = Workload(self.scenario, lambda: now[0])
        counts = {"embedding": 0, "generation": 0}
        for _, source in dry._pool_sources(pool, pool_stream(pool.stream, position), 0.0, None):
            for action in source:
                if type(action) is WaitUntil:  # the clock as the run's advances it
                    delay = action.time - now[0]
                    if delay > 0:
                        now[0] = now[0] + delay
                elif type(action) is Send:
                    counts[action.spec.kind.value] += 1
        return counts

    def clients(self) -> list[tuple[str, Client]]:
        """The sources to start at time 0."""
        w = self.workload
        if w.kind == "trace":
            return [("trace", self._trace())]
        out = [(name, gen) for i, pool in enumerate(w.default_pools())
               for name, gen in self._pool_sources(pool, pool_stream(pool.stream, i), 0.0, None)]
        start = 0.0
        for p, phase in enumerate(w.phases):
            end = start + (phase.duration_s or 0.0)
            for j, pool in enumerate(phase.pools):
                out += self._pool_sources(pool, pool_stream(pool.stream, j, p), start, end)
            start = end
        return out

    def _pool_sources(self, pool: Pool, tag: str, start: float,
                      until: float | None) -> list[tuple[str, Client]]:
        if pool.process == "closed-loop":
            return [(f"p{tag}c{c}", self._closed_loop(pool, tag, c, start + pool.ramp_s * c / pool.clients,
                                                      until))
                    for c in range(pool.clients)]
        if pool.process == "burst":
            return [(f"p{tag}b", self._burst(pool, tag, start, until))]
        if pool.process == "trace":
            return [(f"p{tag}t", self._trace_pool(pool, tag, start, until))]
        return [(f"p{tag}o", self._open_loop(pool, tag, start, until))]

    def _closed_loop(self, pool: Pool, tag: str, client: int, start: float,
                     until: float | None) -> Client:
        name = f"p{tag}c{client}"
        rng = np.random.default_rng([self.seed, 1, mix(*map(ord, tag)), client])
        seed = self._client_seed(name)
        workflows = pool.kind == "workflow"
        if start > 0:
            yield WaitUntil(start)
        rejected, last_rejection = 0, None
        for n in itertools.count():
            phase = self._start_unit(until)
            if phase is False:
                return
            if workflows:  # a unit of work is a whole workflow, else one request
                outcome = yield from self._workflow(rng, name, n, phase)
            else:
                outcome = yield self._request(pool, rng, name, seed, n, phase)
            if outcome is not None and outcome.state == "rejected":
                now = self.clock()
                rejected = rejected + 1 if now == last_rejection or rejected == 0 else 1
                last_rejection = now
                if rejected >= MAX_ZERO_TIME_REJECTIONS and not pool.think_time_s:
                    self.warnings.append(
                        f"client {name} stopped at t={now:.3f} s: {rejected} requests in a row "
                        f"were rejected at that instant (last reason: {outcome.reason})")
                    return
            else:
                rejected = 0
            if pool.think_time_s:
                yield Wait(float(rng.exponential(pool.think_time_s)))

    def _open_loop(self, pool: Pool, tag: str, start: float, until: float | None) -> Client:
        name = f"p{tag}o"
        rng = np.random.default_rng([self.seed, 3, mix(*map(ord, tag))])
        seed = self._client_seed(name)
        modulation = None
        if pool.process == "mmpp":  # a correlated group's pools draw the same on/off sequence
            group = pool.correlate or f"pool {tag}"
            modulation = Modulation(pool.on_s, pool.off_s,
                                    np.random.default_rng([self.seed, 6, mix(*map(ord, group))]))
        times = arrival_times(pool, rng, start, self.workload.rate_scale, modulation)
        for n, t in enumerate(times):
            yield WaitUntil(t)
            phase = self._start_unit(until)
            if phase is False:
                return
            yield self._pool_unit(pool, tag, name, seed, rng, n, phase, intended=t)

    def _burst(self, pool: Pool, tag: str, start: float, until: float | None) -> Client:
        name = f"p{tag}b"
        rng = np.random.default_rng([self.seed, 2, mix(*map(ord, tag))])
        seed = self._client_seed(name)
        if start > 0:
            yield WaitUntil(start)
        for n in range(pool.count):
            phase = self._start_unit(until)
            if phase is False:
                return
            yield self._pool_unit(pool, tag, name, seed, rng, n, phase, intended=start)

    def _pool_unit(self, pool: Pool, tag: str, name: str, seed: int, rng, n: int, phase,
                   intended: float) -> Spawn | Send:
        """Unit ``n`` of an open-loop or burst pool: a workflow (spawned, so that it runs beside
        the pool) or one request."""
        if pool.kind == "workflow":
            wf_rng = np.random.default_rng([self.seed, 4, mix(*map(ord, tag)), n])
            return Spawn(f"{name}w{n}", self._workflow(wf_rng, f"{name}w{n}", 0, phase))
        return self._request(pool, rng, name, seed, n, phase, intended)

    def _trace(self) -> Client:
        yield from self._replay(load_trace(self.workload.trace), "trace",
                                lambda n: mix(self.seed, 5, n))

    def _replay(self, rows, client: str, seed_of: Callable[[int], int], start: float = 0.0,
                until: float | None = None, kind: str | None = None) -> Client:
        """Send each row at ``start`` + its arrival time, without waiting for its answer: a
        trace's requests (of ``kind``, or each row's own)."""
        for n, row in enumerate(rows):
            t = start + row["arrival_time"]
            yield WaitUntil(t)
            phase = self._start_unit(until)
            if phase is False:
                return
            k = GEN if (kind or row["kind"]) == "generation" else EMB
            rid = f"{'e' if k is EMB else 'g'}-{client}-{n}"
            spec = self._spec(k, Tokens.seeded(seed_of(n), row["input_tokens"]),
                              row["output_tokens"], rid, client, phase, t)
            yield Send(spec, wait=False)

    def _trace_pool(self, pool: Pool, tag: str, start: float, until: float | None) -> Client:
        name = f"p{tag}t"
        w = pool.replay(self.workload.rate_scale)
        rows = w.rows
        kind = None if pool.kind == "mixed" else pool.kind
        self.notes.append(
            f"pool {tag} replays {len(rows)} requests of {pool.trace} (trace seconds "
            f"{w.start_s:g} to {w.start_s + w.length_s:g}), time compressed x{w.speedup:.3g}: "
            f"{w.rate:.3g} requests/s" + (f" as {kind}s" if kind else ""))
        if kind != "generation":
            limit = embedding_limit(self.scenario)
            rows = embeddings_cut(rows, kind, limit)
            cut = sum(a is not b for a, b in zip(rows, w.rows))
            if cut:
                self.warnings.append(
                    f"pool {tag}: {cut} of {len(rows)} embedding inputs of {pool.trace} "
                    f"cut to {limit} tokens (the embedding model's max length)")
        seed = self._client_seed(name)
        yield from self._replay(rows, name, lambda n: mix_on(seed, (n,)), start, until, kind)

    def _workflow(self, rng: np.random.Generator, client: str, n: int, phase: int | None) -> Client:
        """Iter-RetGen: embed(question + last answer), retrieve, generate(docs + question)."""
        cfg = self.workload.iter_retgen
        wf = next(self._workflow_ids)
        record = WorkflowRecord(wf, self.clock())
        self.workflows.append(record)
        base = mix(self.seed, *map(ord, client), n)
        question = Tokens.seeded(mix(base, 0), cfg.question_tokens.sample(rng))
        answer = Tokens()
        corpus = self.corpus()
        outcome = None
        for step in range(cfg.iterations):
            emb = self._spec(EMB, question + answer, 0, f"e-{client}-{n}.{step}", client, phase,
                             workflow=wf)
            record.request_ids.append(emb.request_id)
            outcome = yield Send(emb)
            if outcome.state != "finished":
                record.failed = outcome.reason or outcome.state
                return outcome
            if cfg.retrieval_latency_s:
                yield Wait(cfg.retrieval_latency_s)
            k = min(cfg.docs_per_query.sample(rng), len(corpus))
            docs = tuple(int(d) for d in rng.choice(len(corpus), size=k, replace=False))
            if cfg.retrieval == "vector":
                docs = tuple((yield Retrieve(outcome.embedding, k, docs)))
            prompt = Tokens()
            for d in docs:
                prompt = prompt + corpus[d]
            prompt = prompt + question
            if cfg.max_prompt_tokens:
                prompt = prompt.tail(cfg.max_prompt_tokens)
            gen = self._spec(GEN, prompt, cfg.output_tokens.sample(rng), f"g-{client}-{n}.{step}",
                             client, phase, workflow=wf)
            record.request_ids.append(gen.request_id)
            outcome = yield Send(gen)
            if outcome.state != "finished":
                record.failed = outcome.reason or outcome.state
                return outcome
            answer = Tokens.seeded(mix(base, step + 1), outcome.num_generated)
            record.iterations_done += 1
        record.end = self.clock()
        return outcome
