"""The placement planner: which replicas decode, which embed, and whether embeddings ride beside
the decodes, chosen by predicting every assignment with the replicas' cost model.

Every unified replica can serve both kinds, so co-serving can always *be* a static split
(``k`` replicas decoding, ``N - k`` embedding) and then let embeddings ride in what the TPOT
target leaves beside the decodes. The planner enumerates those assignments, predicts each
one's throughput per kind and its TPOT from the demand it is given, and takes the one with the
highest normalised throughput whose TPOT holds the target. The static splits are among the
candidates, predicted by the same function, so the plan's predicted throughput is never below a
split's (``tests/test_placement.py``). The router (``routing.AdaptivePlacement``) observes the
demand, re-plans, and places work by the plan.

The prediction is a steady state, per replica of a side (replicas of one arrangement are alike):

* decoding side, ``k`` replicas: ``d`` decodes each (the generations in flight over ``k``,
  at most ``max_num_seqs``), each at mid-output context, beside the prompt tokens that arrive
  per iteration (``generation rate / k x prompt length x iteration``); with riders, embedding
  chunks fill the iteration up to the target in the proportion the embedding side leaves over;
* embedding side, ``N - k`` replicas: a full token budget of embedding chunks per iteration;
* generation throughput: closed loop, ``generations in flight / (output tokens x TPOT)`` (a
  client waits for its answer); open loop, the arrival rate the side can hold;
* embedding throughput: the demand (the arrival rate, or what the embeddings in flight would
  fill in one full iteration, whichever is more) up to the capacity of both sides;
* normalised throughput: each kind's throughput over one dedicated replica's, the generation
  reference being the split that gives generations all replicas but one (Dedicated-1:3 on four,
  the brief's reference).

With ``cluster.objective: goodput`` (and the scenario's ``slo`` section) the objective is
normalised *goodput*: a kind counts only where its predicted latencies hold every bound the
SLOs give it, and among assignments of equal goodput the most normalised throughput wins. A
kind whose SLOs no assignment holding the TPOT target meets counts by its throughput, as under
the throughput objective: an SLO out of reach steers nothing (it would otherwise starve the
kind, every request of it missing anyway). The
latencies are steady-state means (``latencies``): an embedding's by Little's law over the
embeddings in flight (closed loop) or one full-budget iteration over the idle share of its
capacity (open loop); a generation's TTFT as the iteration it arrives in plus its prompt's
chunks, TPOT the decoding side's iteration, e2e TTFT plus one iteration per further token, and
every one unbounded where the demand exceeds what the assignment serves. A mean within a bound
counts the kind in full: the planner chooses between assignments, it does not predict the
attainment's fraction (``results``' ``slo`` section measures that).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.engine.batch import ItemKind

# iteration time <-> decodes held, prompt tokens per iteration and rider share: at most this
# many rounds, stopping where a round changes nothing (6 fixed rounds left an open load near
# its decode slots unconverged: 63 generations/s predicted where 58.5 are held); a state that
# alternates between two (whole decodes priced, ~0.1 % apart) runs to the cap, deterministically
FIXED_POINT_ROUNDS = 50


@dataclass(frozen=True)
class Demand:
    """What the router observed over its window: work in flight and arrival rates per kind,
    and the mean lengths of what arrived."""

    generations: float = 0.0  # in flight (placed, not left)
    embeddings: float = 0.0
    generation_rps: float = 0.0
    embedding_rps: float = 0.0
    prompt_len: float = 128.0
    output_len: float = 128.0
    embedding_len: float = 128.0
    closed_loop: bool = True  # generation throughput follows TPOT (clients wait for answers)

    @property
    def asks_generation(self) -> bool:
        return self.generations > 0 or self.generation_rps > 0

    @property
    def asks_embedding(self) -> bool:
        return self.embeddings > 0 or self.embedding_rps > 0


class DemandWindow:
    """The demand a router observes: arrivals per kind over the last ``window_s`` and the mean
    lengths of all that arrived (the adaptive router's and the re-planning split's alike)."""

    def __init__(self, window_s: float, replan_s: float, closed_loop: bool) -> None:
        self.window_s, self.replan_s, self.closed_loop = window_s, replan_s, closed_loop
        self._arrivals: dict[bool, deque[float]] = {True: deque(), False: deque()}  # is_embedding
        self._lengths = {"prompt": [0, 0], "output": [0, 0], "embedding": [0, 0]}  # sum, count
        self._since: float | None = None  # the first arrival observed
        self.span = window_s  # the time the last demand's rates were counted over

    def observed_s(self, now: float) -> float:
        """Seconds since the first arrival observed (0 before it)."""
        return 0.0 if self._since is None else now - self._since

    def observe(self, request: Any) -> None:
        now = request.arrival_time
        if self._since is None:
            self._since = now
        self._arrivals[request.is_embedding].append(now)
        if request.is_embedding:
            _add(self._lengths["embedding"], request.input_len)
        else:
            _add(self._lengths["prompt"], request.input_len)
            _add(self._lengths["output"], request.expected_output_tokens)

    def demand(self, now: float, generations: int, embeddings: int,
               arriving: Any | None = None) -> Demand:
        """The demand at ``now`` with ``generations`` and ``embeddings`` in flight
        (``arriving`` counted too)."""
        rates = {}
        # over the time observed so far when that is shorter than the window: a full window's
        # denominator a second into a run reads a tenth of the rate, and plans for it
        span = self.window_s if self._since is None else min(
            self.window_s, max(now - self._since, self.replan_s))
        self.span = span
        for kind, times in self._arrivals.items():
            while times and times[0] < now - self.window_s:
                times.popleft()
            rates[kind] = len(times) / span

        def mean(name: str) -> float:
            total, n = self._lengths[name]
            return total / n if n else 128.0

        gens, embs = generations, embeddings
        if arriving is not None:
            gens, embs = (gens, embs + 1) if arriving.is_embedding else (gens + 1, embs)
        return Demand(generations=gens, embeddings=embs, generation_rps=rates[False],
                      embedding_rps=rates[True], prompt_len=mean("prompt"),
                      output_len=mean("output"), embedding_len=mean("embedding"),
                      closed_loop=self.closed_loop)


def _add(acc: list[int], value: int) -> None:
    acc[0] += value
    acc[1] += 1


@dataclass(frozen=True)
class Assignment:
    """``decoding`` replicas take generations; the others embed with their whole budget.
    ``riders``: embeddings also ride beside the decodes, within the TPOT target. ``capped``:
    each decoding replica runs at most the decodes that hold the target (``decode_cap``); in a
    closed loop the generations past them wait, their wait in the TTFT. ``offload``: the prompts
    are prefilled on the other side, beside its embeddings, and their KV moves to the decoding
    side (Disagg-PD's placement: its decoding replicas run decodes alone)."""

    decoding: int
    riders: bool = False
    capped: bool = False
    offload: bool = False

    def label(self, replicas: int) -> str:
        split = f"{replicas - self.decoding}:{self.decoding}"
        return " ".join([split] + [word for word, on in (
            ("+ riders", self.riders), ("capped", self.capped), ("offload", self.offload)) if on])


@dataclass(frozen=True)
class Prediction:
    assignment: Assignment
    embedding_rps: float
    generation_rps: float
    tpot_s: float  # the decoding side's iteration time (0 without generations)
    objective: float  # normalised throughput, or goodput (``cluster.objective``)
    feasible: bool  # TPOT within the target (or no generation to decode)
    decode_s: float = 0.0  # the decoding side's iteration before embeddings ride in it
    throughput: float = 0.0  # normalised throughput (the objective's, when that is throughput)
    # the most used of the decode slots, the decode iteration against the target and the
    # embedding capacity: an open load's plans that hold all serve the demand, this says which
    # has room for its strays
    peak_use: float = 0.0
    # goodput objective: the predicted mean latencies (s) the SLOs bound, and the kinds meeting
    latencies: dict[str, float] = field(default_factory=dict)
    meets: tuple[str, ...] = ()

    def as_dict(self, replicas: int) -> dict:
        out = asdict(self)
        out["assignment"] = self.assignment.label(replicas)
        if not math.isfinite(self.peak_use):  # JSON has no infinity
            out["peak_use"] = None
        if not self.latencies:  # the throughput objective: the objective says it all
            for key in ("throughput", "latencies", "meets"):
                del out[key]
        else:  # JSON has no infinity: an unbounded latency is null
            out["latencies"] = {k: v if math.isfinite(v) else None
                                for k, v in self.latencies.items()}
            out["meets"] = list(self.meets)
        return out


def _use(demand: float, capacity: float) -> float:
    """``demand`` over ``capacity`` (0 with no demand, unbounded with none to serve it)."""
    if demand <= 0:
        return 0.0
    return demand / capacity if capacity > 0 else math.inf


def decode_shape(decodes: int, decode_kv: int) -> BatchShape:
    """``decodes`` one-token decodes reading ``decode_kv`` KV rows."""
    return BatchShape(tokens=decodes, num_seqs=decodes, decodes=decodes, decode_kv=decode_kv,
                      sample_rows=decodes)


def chunk_shape(replica: Any, decodes: int, decode_kv: int, tokens: int,
                kind: ItemKind = ItemKind.EMBED_CHUNK, piece: int | None = None,
                adapter: bool | None = None, shape: BatchShape | None = None) -> BatchShape:
    """An iteration of ``decodes`` decodes and ``tokens`` chunk tokens, cut into chunks of
    the replica's ``chunk_size`` (or of ``piece`` tokens, one request's, when smaller), with
    LoRA rows where the replica has an adapter (``adapter=False``: merged into the weights);
    added to ``shape`` when given."""
    cfg = replica.policy.config
    chunk = cfg.chunk_size or cfg.token_budget
    if piece:
        chunk = min(chunk, piece)
    if adapter is None:
        adapter = replica.cost.lora is not None
    s = shape if shape is not None else (decode_shape(decodes, decode_kv) if decodes
                                         else BatchShape())
    left = tokens
    while left > 0:
        n = min(chunk, left)
        s.add_item(kind, n, 0, False, adapter)
        left -= n
    return s


def chunk_rate(replica: Any, decodes: int, decode_kv: int, target_s: float | None,
               piece: int | None = None, adapter: bool | None = None) -> float:
    """Chunk tokens per second a replica runs: a full budget of chunks with no decodes, or
    beside them with no target (what the budget leaves them), else the most chunk tokens (a
    multiple of ``min_chunk_tokens``) that fit beside the decodes within the target, per
    target period (a small floor keeps the rate positive); ``adapter``: ``chunk_shape``'s."""
    cfg = replica.policy.config
    step = cfg.min_chunk_tokens
    if not decodes or target_s is None:
        budget = max(cfg.token_budget - decodes, 1)
        return budget / replica.cost.shape_time(
            chunk_shape(replica, decodes, decode_kv, budget, piece=piece, adapter=adapter))
    lo, hi = 0, cfg.token_budget // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        shape = chunk_shape(replica, decodes, decode_kv, mid * step, piece=piece)
        if replica.cost.shape_time(shape) <= target_s:
            lo = mid
        else:
            hi = mid - 1
    return max(lo * step, 1) / target_s


class PlacementPlanner:
    """Predicts assignments of ``replicas`` alike replicas (``replica``: one of them, for its
    cost model and scheduler config) and picks the best within ``target_s``."""

    HYSTERESIS = 0.03  # a new plan must predict this much more than the current one

    def __init__(self, replica: Any, replicas: int, target_s: float,
                 slo: dict[str, dict[str, float]] | None = None, can_cap: bool = False,
                 merges: bool = False) -> None:
        self.replica = replica
        self.replicas = replicas
        self.target_s = target_s
        self.slo = slo  # bounds per kind (``slo_bounds``): the goodput objective; None: throughput
        self.can_cap = can_cap  # the router can cap a decoding replica's running generations
        # an embedding-side replica runs its adapter merged (the simulator's router merges it)
        self.merges = merges
        # goodput objective: the last demand's raw predictions and the kinds some feasible one
        # meets (``plan`` asks for every assignment under one demand: each predicted once)
        self._demand_for: tuple[Demand, dict[Assignment, tuple[Prediction, dict]], set[str]] | None \
            = None
        cfg = replica.policy.config
        self.max_seqs = cfg.max_num_seqs
        self.min_chunk = cfg.min_chunk_tokens
        self.budget = cfg.token_budget
        self.piece: int | None = None  # the embedding length of the demand being predicted
        self.kv_tokens = cfg.kv_tokens
        self._full: dict[int, float] = {}  # embedding length -> tokens/s with the whole budget
        self._merged: dict[int, float] = {}  # the same, the adapter merged
        self._times: dict[tuple, float] = {}
        self._riders: dict[tuple[int, int, int | None], float] = {}

    def candidates(self) -> list[Assignment]:
        """What the adaptive router can run: ``k`` decoding, with or without riders, capped
        where it can cap a replica's running generations (the prompts stay where they decode:
        unified replicas move no KV between them)."""
        return [Assignment(k, riders, capped) for k in range(self.replicas + 1)
                for capped in ((False, True) if self.can_cap else (False,))
                for riders in (False, True) if not ((riders or capped) and k == 0)]

    def splits(self) -> list[Assignment]:
        """The static splits co-serving is weighed against: ``k`` replicas decoding and the
        rest embedding, each as it is, capped, with the prompts offloaded (Disagg-PD), or both."""
        return [Assignment(k, False, capped, offload) for k in range(self.replicas + 1)
                for capped in (False, True) for offload in (False, True)
                if (k or not capped) and (not offload or 0 < k < self.replicas)]

    # ----- one assignment -------------------------------------------------------------------
    def predict(self, a: Assignment, d: Demand, margin: bool = False) -> Prediction:
        """``a``'s prediction under ``d``; with the goodput objective and ``margin``, a kind
        meets its SLOs only with the planner's ``HYSTERESIS`` to spare on every bound (as a
        move needs on the TPOT target: a plan whose latency sits at a bound would flip in and
        out of meeting it with the demand's strays)."""
        if self.slo is None:
            return self._predict(a, d)[0]
        raw, meetable = self._for_demand(d)
        p, normalised = raw[a] if a in raw else self._predict(a, d)
        meets = p.meets
        if margin:
            room = 1 - self.HYSTERESIS
            meets = tuple(kind for kind in meets if all(
                p.latencies[name] <= bound * room for name, bound in self.slo[kind].items()))
        # goodput: the kinds meeting their SLOs, and those whose SLOs no assignment holding
        # the target meets (they steer nothing: counted by their throughput, not dropped)
        counted = set(meets) | (set(self.slo) - meetable)
        return replace(p, objective=sum(normalised[kind] for kind in counted), meets=meets)

    def set_piece(self, d: Demand) -> None:
        """Price rider and embedding chunks at ``d``'s embedding length from here on."""
        self.piece = max(1, round(d.embedding_len))

    def _predict(self, a: Assignment, d: Demand) -> tuple[Prediction, dict[str, float]]:
        """The prediction with normalised throughput as its objective (and, with SLOs, its
        latencies and the kinds meeting them), and each kind's normalised throughput."""
        self.set_piece(d)
        emb, gen, tpot, holds, alone, peak = self._throughputs(a, d)
        gen_ref, emb_ref = self.references(d)
        normalised = {"embedding": emb / emb_ref, "generation": gen / gen_ref if gen_ref > 0 else 0.0}
        throughput = normalised["embedding"] + normalised["generation"]
        if self.slo is None:
            return (Prediction(a, emb, gen, tpot, throughput, holds, alone, throughput, peak),
                    normalised)
        latencies = self.latencies(a, d, emb, gen, tpot)
        meets = tuple(kind for kind, bounds in self.slo.items()
                      if all(latencies[name] <= bound for name, bound in bounds.items()))
        return (Prediction(a, emb, gen, tpot, throughput, holds, alone, throughput, peak,
                           latencies, meets), normalised)

    def _for_demand(self, d: Demand) -> tuple[dict[Assignment, tuple[Prediction, dict]], set[str]]:
        """Every assignment's raw prediction under ``d``, and the kinds whose SLOs some
        assignment holding the target meets (kept for the last demand asked)."""
        if self._demand_for is None or self._demand_for[0] != d:
            raw = {a: self._predict(a, d) for a in self.candidates()}
            meetable = {kind for p, _ in raw.values() if p.feasible for kind in p.meets}
            self._demand_for = (d, raw, meetable)
        return self._demand_for[1], self._demand_for[2]

    def latencies(self, a: Assignment, d: Demand, emb: float, gen: float,
                  tpot: float) -> dict[str, float]:
        """The steady-state mean latencies (s) of assignment ``a`` serving ``emb`` embeddings/s
        and ``gen`` generations/s at iteration time ``tpot`` (the module docstring says how;
        ``inf`` where the demand exceeds what it serves)."""
        inf = math.inf
        full, emb_demand = self.embedding_demand(d)
        if emb_demand <= 0:
            latency = 0.0
        elif emb <= 0 or emb < emb_demand * (1 - 1e-6) and not d.closed_loop:
            latency = inf
        elif d.closed_loop and d.embeddings > 0:
            latency = d.embeddings / emb  # Little's law: clients wait for their answers
        else:
            capacity = self._throughputs(a, replace(d, embedding_rps=math.inf))[0]
            busy = d.embedding_rps / capacity if capacity > 0 else 1.0
            latency = self.budget / full / (1 - busy) if busy < 1 else inf
        out = {"latency_s": latency}
        if not d.asks_generation:
            return out | {"ttft_s": 0.0, "tpot_s": 0.0, "e2e_s": 0.0}
        if gen <= 0 or not d.closed_loop and gen < d.generation_rps * (1 - 1e-6):
            return out | dict.fromkeys(("ttft_s", "tpot_s", "e2e_s"), inf)
        cfg = self.replica.policy.config
        chunk = cfg.chunk_size or cfg.token_budget
        chunks = 1 + math.ceil(max(d.prompt_len, 1.0) / chunk)
        if a.offload:  # prefilled in the other side's full iterations, then its KV moves
            cost = self.replica.cost
            ttft = chunks * self.budget / full + (
                d.prompt_len * cost.model.kv_bytes_per_token / cost.hardware.interconnect_bw)
        else:
            ttft = tpot * chunks
        if a.capped and d.closed_loop:  # the generations past the caps wait for a slot
            waiting = d.generations - a.decoding * self.decode_cap(d, a.offload)
            ttft += max(0.0, waiting) / gen
        return out | {"ttft_s": ttft, "tpot_s": tpot,
                      "e2e_s": ttft + max(d.output_len - 1, 0.0) * tpot}

    def _throughputs(self, a: Assignment, d: Demand
                     ) -> tuple[float, float, float, bool, float, float]:
        """(embeddings/s, generations/s, TPOT s, the decoding side holds the target, its
        iteration before riders, the peak use: ``Prediction.peak_use``) of assignment ``a``
        under demand ``d``."""
        k = a.decoding
        wants_gen = d.asks_generation
        emb_len = max(d.embedding_len, 1.0)
        full, emb_demand = self.embedding_demand(d)
        side = (self.replicas - k) * self.side_rate(emb_len) / emb_len
        if k == 0 or not wants_gen:
            if a.riders:  # riders with no decodes: the decoding side embeds too
                side += k * full / emb_len
            return (min(emb_demand, side), 0.0, 0.0, not wants_gen, 0.0,
                    _use(emb_demand, side))
        out = max(d.output_len, 1.0)
        mid = self.mid(d)
        limit = self.target_s
        t, gen, riding, holds, alone = self.iteration_s(1, mid, 0), 0.0, 0.0, True, 0.0
        slots = self.slots(d)
        if a.capped:
            slots = min(slots, self.decode_cap(d, a.offload))
        # offloaded prompts: the other side's budget prefills them, at most all of it
        prefill = (self.replicas - k) * full if a.offload else math.inf
        uncapped, cap = t, 0.0
        last = None
        for _ in range(FIXED_POINT_ROUNDS):
            if last == (t, gen):
                break
            last = (t, gen)
            want = d.generations / k if d.closed_loop else d.generation_rps / k * out * t
            running = min(want, slots)
            gen = min(k * running / (out * t), prefill / max(d.prompt_len, 1.0))
            if not d.closed_loop:
                gen = min(d.generation_rps, gen)
            prompt_rate = gen / k * d.prompt_len  # prompt tokens/s per decoding replica
            decodes = max(1, round(running))  # in the iteration priced
            kv = decodes * mid
            # the mean iteration: the decodes and the prompt tokens arriving per iteration
            # (offloaded: the decodes alone)
            t = uncapped = self.iteration_s(decodes, kv, 0 if a.offload else int(prompt_rate * t))
            alone = min(t, limit)
            riding, cap = 0.0, 0.0
            if not a.riders:  # as a split's generation servers: the mean iteration within it
                holds = t <= limit * (1 + 1e-6)
                t = min(t, limit)  # the target cuts the prompts that would exceed it
                continue
            # with riders the target applies: it cuts chunks to fit, which holds while the
            # decodes alone fit and the prompts' rate fits the room beside them
            room = self._room(decodes, kv)
            holds = self.iteration_s(decodes, kv, 0) <= limit and room >= prompt_rate
            t = min(t, limit)
            if t < limit:
                cap = k * max(0.0, room - prompt_rate) / emb_len
                over = max(0.0, emb_demand - side)
                if cap > 0 and over > 0:
                    share = min(1.0, over / cap)
                    riding = share * cap
                    t += share * (limit - t)
        if a.offload:  # the other side's budget less the prompts it prefills
            side = max(0.0, prefill - gen * d.prompt_len) / emb_len
        # generations beyond the side's decode slots or KV cache would queue: it does not hold,
        # but in a capped closed loop they wait by design (their clients wait for a slot)
        queued = a.capped and d.closed_loop
        peak = max(0.0 if queued else want / slots, uncapped / limit, _use(emb_demand, side + cap))
        return (min(emb_demand, side + riding), gen, t,
                holds and (queued or want <= slots * (1 + 1e-6)), alone, peak)

    def decode_cap(self, d: Demand, offload: bool = False) -> int:
        """The most decodes one replica runs within the target less the planner's
        ``HYSTERESIS`` (a capped plan's iteration sits at its cap: with no margin a demand at
        that edge would move it): with the prompts that arrive beside them in steady state (one
        per ``output_len`` decodes' steps, ``prompt_len`` tokens each), or alone where the
        prompts are offloaded; at least 1, at most its slots."""
        out = max(d.output_len, 1.0)
        mid = self.mid(d)
        within = self.target_s * (1 - self.HYSTERESIS)

        def fits(n: int) -> bool:
            prompt = 0 if offload else int(n * d.prompt_len / out)
            return self.iteration_s(n, n * mid, prompt) <= within

        lo, hi = 1, self.slots(d)
        while lo < hi:
            m = (lo + hi + 1) // 2
            if fits(m):
                lo = m
            else:
                hi = m - 1
        return lo

    def _generation_reference(self, d: Demand) -> float:
        """Generations/s per replica of the split giving generations all replicas but one."""
        if not d.asks_generation:
            return 0.0
        k = max(self.replicas - 1, 1)
        gen = self._throughputs(Assignment(k, False), d)[1]
        return gen / k

    def embedding_demand(self, d: Demand) -> tuple[float, float]:
        """(embedding tokens/s of a replica with its whole budget, embeddings/s asked: the
        arrival rate, or what the embeddings in flight fill in one full iteration)."""
        full = self.full_rate(max(d.embedding_len, 1.0))
        return full, max(d.embedding_rps, d.embeddings * full / self.budget)

    def side_rate(self, embedding_len: float) -> float:
        """Embedding tokens/s of a replica on the embedding side: with its whole budget, its
        adapter merged where the router merges it (``merges``)."""
        if not self.merges:
            return self.full_rate(embedding_len)
        piece = max(1, round(embedding_len))
        rate = self._merged.get(piece)
        if rate is None:
            rate = self._merged[piece] = chunk_rate(self.replica, 0, 0, None, piece, adapter=False)
        return rate

    def full_rate(self, embedding_len: float) -> float:
        """Embedding tokens/s of a replica embedding with its whole budget."""
        piece = max(1, round(embedding_len))
        rate = self._full.get(piece)
        if rate is None:
            rate = self._full[piece] = chunk_rate(self.replica, 0, 0, None, piece)
        return rate

    def iteration_s(self, decodes: int, decode_kv: int, prompt_tokens: int, riders: int = 0) -> float:
        """Seconds of an iteration of decodes, prompt chunks and rider (embedding) chunks of
        the demand's embedding length."""
        key = (decodes, decode_kv >> 8, prompt_tokens, riders, riders and self.piece)
        t = self._times.get(key)
        if t is None:
            shape = chunk_shape(self.replica, decodes, decode_kv, prompt_tokens,
                                ItemKind.PREFILL_CHUNK)
            if riders:
                shape = chunk_shape(self.replica, 0, 0, riders, piece=self.piece, shape=shape)
            t = self._times[key] = self.replica.cost.shape_time(shape)
        return t

    def _room(self, decodes: int, decode_kv: int) -> float:
        """Chunk tokens/s that fit beside ``decodes`` decodes within the target."""
        key = (decodes, decode_kv >> 8, self.piece)
        r = self._riders.get(key)
        if r is None:
            r = self._riders[key] = chunk_rate(self.replica, decodes, decode_kv, self.target_s,
                                               self.piece)
        return r

    def references(self, d: Demand) -> tuple[float, float]:
        """What one replica dedicated to each kind serves (generations/s, embeddings/s): the
        units of normalised throughput."""
        emb_len = max(d.embedding_len, 1.0)
        return self._generation_reference(d), self.full_rate(emb_len) / emb_len

    @staticmethod
    def mid(d: Demand) -> int:
        """A decode's context at mid-output: what the decodes hold on average."""
        return int(d.prompt_len + max(d.output_len, 1.0) / 2)

    @staticmethod
    def in_flight(d: Demand) -> int:
        """A closed loop's generations in flight, whole (a fractional count rounded up)."""
        return math.ceil(d.generations - 1e-9)

    def slots(self, d: Demand) -> int:
        """Decodes one replica holds: ``max_num_seqs``, or its KV cache with every decode at
        mid-output."""
        return min(self.max_seqs, max(1, self.kv_tokens // self.mid(d)))

    # ----- the choice -----------------------------------------------------------------------
    def plan(self, d: Demand, current: Assignment | None = None) -> Prediction:
        """The best assignment for ``d``: the highest objective among those holding the target
        (when none does, the one serving the most generations), near-ties going to the lower
        peak use on an open load (``Prediction.peak_use``), then to the lower TPOT, then to fewer
        decoding replicas (more, when no embedding is asked for); with the goodput objective,
        near-ties in goodput go first to the most normalised throughput. The current assignment
        stays unless the best predicts an objective more than ``HYSTERESIS`` above it (or as
        high, with a peak use on an open load, a TPOT on a closed one, or a normalised
        throughput that much better), or it no longer holds the target; an assignment it moves
        to must hold the target with ``HYSTERESIS`` to spare."""
        # a move needs its SLOs met with margin, as its TPOT (below)
        preds = [self.predict(a, d, margin=current is not None and a != current)
                 for a in self.candidates()]
        # a move needs margin under the target as well as a better objective: a demand at the
        # boundary where an assignment stops holding the target does not flip it in and out
        margin = self.target_s * (1 - self.HYSTERESIS)
        feasible = [p for p in preds if p.feasible and (
            current is None or p.assignment == current or p.decode_s <= margin)]
        if feasible:
            top = max(p.objective for p in feasible)
            near = [p for p in feasible if p.objective >= top * (1 - 1e-6)]
            # with no embedding asked for, an embedding side only idles: spread the decodes
            idle = 1 if d.asks_embedding else -1
            if self.slo is not None:  # goodput alike: the most throughput among them
                most = max(p.throughput for p in near)
                near = [p for p in near if p.throughput >= most * (1 - 1e-6)]
            # an open load's plans that hold serve the same demand: the one with the most room
            # for its strays first (a closed loop's lower TPOT is more throughput)
            best = min(near, key=lambda p: (0.0 if d.closed_loop else p.peak_use, p.tpot_s,
                                            idle * p.assignment.decoding, p.assignment.riders))
        else:  # none holds: the one that serves the most generations (most decode slots)
            best = max((p for p in preds if p.assignment.decoding),
                       key=lambda p: (p.generation_rps, -p.tpot_s, p.objective))
        if current is not None and current != best.assignment:
            now = self.predict(current, d)
            # (as high, with that much more throughput: the goodput objective's tie-break; under
            # the throughput objective the first test already covers it)
            # (open loop: as high, with that much less peak use, in place of the lower TPOT)
            lower = ((best.peak_use, now.peak_use) if not d.closed_loop
                     else (best.tpot_s, now.tpot_s))
            better = best.objective > now.objective * (1 + self.HYSTERESIS) or (
                best.objective >= now.objective * (1 - 1e-6)
                and (lower[0] < lower[1] * (1 - self.HYSTERESIS)
                     or best.throughput > now.throughput * (1 + self.HYSTERESIS)))
            if now.feasible and not better:
                return now
        return best
