"""Routing requests across a configuration's replicas: the one router of the simulator (and of
any executor that runs several replicas).

A replica, for a router, is anything with ``index``, ``role`` and ``outstanding_work`` (tokens
routed to it and not finished) and, for the rules that predict time (adaptive,
least-predicted-time), ``cost`` (the replica's cost model: ``shape_time(BatchShape)`` and
``lora``, e.g. ``calibrated_predictor(...).cost`` for a real replica) and ``policy.config`` (its
``SchedulerConfig``). The executor calls ``route(request)`` for the replica a request goes to
and ``release(request)`` when the request leaves it (finished, rejected or handed off), so the
router keeps its own counts and never walks a replica's queues.

Rules (``cluster.router``):

* ``round-robin``: each kind in turn over the replicas that serve it (the brief's dispatch);
* ``least-work``: the replica with the fewest outstanding tokens;
* ``least-predicted-time``: the replica on which the request is predicted to finish first by
  that replica's cost model: the prompt/embedding tokens queued there and its own as chunked
  iterations beside the replica's decodes, then (a generation) its output as decode steps
  shared with them (``LeastPredictedTime``, docs/routing.md);
* ``adaptive`` (unified replicas with ``scheduler.tpot_target_s``): generations are *packed*
  onto as few replicas as hold the target, embeddings go where they finish soonest: a split
  that follows the mix (``AdaptivePlacement``, docs/scheduler.md "Adaptive placement").

A kind goes only to replicas whose role serves it (``ROLES_FOR``): that is the routing by kind of
the split placements (Dedicated N:M, Disagg-PD), whatever the rule.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.engine.batch import ItemKind
from orthrus_sim.engine.request import Request, RequestKind

ROUTERS = ("round-robin", "least-work", "least-predicted-time", "adaptive")

ROLES_FOR = {
    RequestKind.EMBEDDING: ("unified", "embedding", "prefill"),
    RequestKind.GENERATION: ("unified", "generation", "prefill"),
}


class Router:
    """Round-robin per kind, or least outstanding work, over the replicas serving the kind."""

    def __init__(self, replicas: list[Any], rule: str = "round-robin") -> None:
        if rule not in ROUTERS:
            raise ValueError(f"cluster.router must be one of {', '.join(ROUTERS)}, got {rule!r}")
        self.rule = rule
        self.replicas = replicas
        self.eligible = {kind: [r for r in replicas if r.role in roles]
                         for kind, roles in ROLES_FOR.items()}
        self._turn = {kind: itertools.count() for kind in RequestKind}
        self._handoff_turn = itertools.count()

    def route(self, request: Request) -> Any | None:
        """The replica ``request`` goes to; None when no replica serves its kind."""
        candidates = self.eligible[request.kind]
        if not candidates:
            return None
        return self._choose(request, candidates)

    def release(self, request: Request) -> None:
        """``request`` left the replica it was routed to (rules that count what they placed
        keep their books here)."""

    def hand_off(self, request: Request) -> Any:
        """The decode replica a Disagg-PD prefill hands ``request`` to (by the same rule)."""
        decoders = [r for r in self.replicas if r.role == "decode"]
        if self.rule == "least-work":
            return min(decoders, key=lambda r: (r.outstanding_work, r.index))
        return decoders[next(self._handoff_turn) % len(decoders)]

    def _choose(self, request: Request, candidates: list[Any]) -> Any:
        if self.rule == "least-work":
            return min(candidates, key=lambda r: (r.outstanding_work, r.index))
        return candidates[next(self._turn[request.kind]) % len(candidates)]


@dataclass
class _Load:
    """What a router that keeps books placed on one replica and has not seen leave."""

    generations: int = 0  # generations that decode here
    decode_kv: int = 0  # sum over them of the context a decode reads mid-way through its output
    final_kv: int = 0  # sum over them of their expected final length (KV tokens held at the end)
    embed_tokens: int = 0
    # least-predicted-time: generations' prompts placed here and predicted not yet prefilled,
    # request id -> (when predicted done, tokens), in the order placed (and done)
    prompts: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)
    prompt_tokens: int = 0


class _Booked(Router):
    """A router that keeps, per replica, what it placed there (``_Load``): booked in
    ``route`` (and ``hand_off``), taken back in ``release``, never read from the replica.
    What a generation books depends on the replica's role: a prefill replica only prefills
    it, a decode replica only decodes it, the others do both."""

    def __init__(self, replicas: list[Any], rule: str) -> None:
        super().__init__(replicas, "round-robin")
        self.rule = rule
        self.load = {r.index: _Load() for r in replicas}
        self._placed: dict[str, Any] = {}
        self._rates: dict[tuple[int, int, int], float] = {}

    def route(self, request: Request) -> Any | None:
        replica = super().route(request)
        if replica is not None:
            self._book(request, replica)
        return replica

    def release(self, request: Request) -> None:
        replica = self._placed.pop(request.request_id, None)
        if replica is not None:
            self._placed_here(request, replica, -1)

    def _book(self, request: Request, replica: Any) -> None:
        self._placed[request.request_id] = replica
        self._placed_here(request, replica, +1)

    def _placed_here(self, request: Request, replica: Any, sign: int) -> None:
        load = self.load[replica.index]
        if request.is_embedding:
            load.embed_tokens += sign * request.input_len
        elif replica.role != "prefill":
            load.generations += sign
            load.decode_kv += sign * (request.input_len + request.expected_output_tokens // 2)
            load.final_kv += sign * (request.input_len + request.expected_output_tokens)

    def _rate(self, replica: Any, decodes: int, decode_kv: int, target_s: float | None) -> float:
        """Chunk tokens per second ``replica`` runs beside ``decodes`` decodes reading
        ``decode_kv`` (cached by the decode count and a coarse context, which is all it depends
        on)."""
        key = (replica.index, decodes, decode_kv >> 12)
        rate = self._rates.get(key)
        if rate is None:
            rate = self._rates[key] = _chunk_rate(replica, decodes, decode_kv, target_s)
        return rate


class LeastPredictedTime(_Booked):
    """Each request to the replica on which it is predicted to finish first, by that
    replica's cost model and scheduler config: what its queue will cost, not how many requests
    or tokens it holds.

    * Chunk part (an embedding, a generation's prompt; none on a decode replica): the
      embedding and prompt tokens queued there plus the request's own, at the chunk rate the
      replica's decodes leave (a ``token_budget`` of chunks beside them, within
      ``tpot_target_s`` where the replica has one).
    * Decode part (a generation; none on a prefill replica): its expected output as decode
      steps shared with the replica's decodes, each at mid-output context; when the
      generations placed there would outnumber ``max_num_seqs`` or outgrow the KV cache, the
      steps stretch by that factor (they wait for a slot).

    Not the time to drain the whole queue: a decode placed before does not hold a newcomer
    up, it lengthens every step they share and takes budget from the chunks, and that is what
    is counted. The router sees departures, not progress: an embedding counts until it
    leaves (it is all chunk work); a generation's prompt counts until it is predicted
    prefilled (placed in order, at the rate above), the clock being the routed requests'
    ``arrival_time``. Ties go to the lowest index; O(replicas) per request.
    """

    def __init__(self, replicas: list[Any]) -> None:
        super().__init__(replicas, "least-predicted-time")

    def hand_off(self, request: Request) -> Any:
        replica = self._choose(request, [r for r in self.replicas if r.role == "decode"])
        self._book(request, replica)
        return replica

    def _choose(self, request: Request, candidates: list[Any]) -> Any:
        for r in candidates:
            self._prefilled(self.load[r.index], request.arrival_time)
        return min(candidates, key=lambda r: (self.predicted_s(r, request), r.index))

    @staticmethod
    def _prefilled(load: _Load, now: float) -> None:
        """Take out the prompts predicted prefilled by ``now`` (the first placed are done
        first)."""
        prompts = load.prompts
        while prompts and next(iter(prompts.values()))[0] <= now:
            load.prompt_tokens -= prompts.popitem(last=False)[1][1]

    def predicted_s(self, replica: Any, request: Request) -> float:
        """Seconds until ``request`` would be done on ``replica`` (the rule's estimate)."""
        seconds = self._chunk_s(replica, request)
        if request.is_embedding or replica.role == "prefill":
            return seconds
        load = self.load[replica.index]
        cfg = replica.policy.config
        n = load.generations + 1
        slots = min(n, cfg.max_num_seqs)
        kv = (load.decode_kv + request.input_len + request.expected_output_tokens // 2) * slots // n
        waits = max(1.0, n / cfg.max_num_seqs, (load.final_kv + request.input_len
                    + request.expected_output_tokens) / (cfg.num_blocks * cfg.block_size))
        step = replica.cost.shape_time(_decode_shape(slots, kv))
        return seconds + request.expected_output_tokens * waits * step

    def _chunk_s(self, replica: Any, request: Request) -> float:
        """Seconds until the chunk work queued on ``replica`` and ``request``'s are done."""
        if replica.role == "decode":
            return 0.0
        load = self.load[replica.index]
        cfg = replica.policy.config
        running = min(load.generations, cfg.max_num_seqs)
        running_kv = load.decode_kv * running // load.generations if load.generations else 0
        queued = load.embed_tokens + load.prompt_tokens + request.input_len
        return queued / self._rate(replica, running, running_kv, cfg.tpot_target_s)

    def _book(self, request: Request, replica: Any) -> None:
        if not request.is_embedding and replica.role != "decode":
            load = self.load[replica.index]
            done = request.arrival_time + self._chunk_s(replica, request)
            if load.prompts:  # not before the prompts placed ahead of it
                done = max(done, load.prompts[next(reversed(load.prompts))][0])
            load.prompts[request.request_id] = (done, request.input_len)
            load.prompt_tokens += request.input_len
        super()._book(request, replica)

    def _placed_here(self, request: Request, replica: Any, sign: int) -> None:
        super()._placed_here(request, replica, sign)
        if sign < 0:
            load = self.load[replica.index]
            prompt = load.prompts.pop(request.request_id, None)
            if prompt is not None:
                load.prompt_tokens -= prompt[1]


class AdaptivePlacement(_Booked):
    """Generations on as few replicas as hold the target, embeddings where they finish first:
    co-serving that places work like the best split for the mix of the moment.

    Replicas on the *decoding* side take generations (embeddings ride in what the target leaves
    beside their decodes); the others embed with their whole budget.

    * A generation goes to the decoding replica on which the iteration with it is predicted
      shortest (the replica's decodes and the newcomer's, each at mid-output context, beside one
      ``min_chunk_tokens`` prompt chunk), among those where that iteration is within
      ``pack x tpot_target_s`` and a decode slot and KV blocks for every placed generation's
      expected final length remain. If none qualifies, the decoding side grows: a draining
      replica with room comes back first, else the embedding replica with the least outstanding
      work joins.
    * An embedding replica with less than one target period of embedding work queued joins
      the side even when the side has room (embeddings do not need it; spreading generations
      makes every decode step shorter).
    * The side shrinks when embeddings queue everywhere (more than ``SHRINK_BACKLOG`` target
      periods of work on every replica) and its generations would fit one replica fewer at
      ``SHRINK_AT`` of the limit: the decoding replica with the fewest generations *drains*
      (takes no new generation) and embeds again once its last one leaves.
    * An embedding goes to the replica where it is predicted to finish first: queued embedding
      tokens over the replica's embedding rate (a full budget of chunks with no decodes; the
      chunk tokens that fit beside its decodes within the target otherwise).

    Stability: the side grows when no decoding replica can take a generation within the limit
    or a replica has no embedding work, and shrinks only when embeddings queue everywhere and
    the rest would hold the generations at ``SHRINK_AT`` of the limit, bands wide enough
    that a mix sitting at a boundary does not move a replica back and forth; a replica
    leaves the side only by draining, so no generation is moved. A decode is predicted at
    mid-output context (``input_len + expected_output_tokens / 2``), the steady-state mean,
    so the estimate does not move with every token.
    """

    SHRINK_AT = 0.8
    SHRINK_BACKLOG = 10

    def __init__(self, replicas: list[Any], target_s: float | None, pack: float = 1.0) -> None:
        super().__init__(replicas, "adaptive")
        if target_s is None:
            raise ValueError("cluster.router 'adaptive' needs scheduler.tpot_target_s: it packs "
                             "generations onto replicas up to that iteration time")
        if not 0 < pack <= 1:
            raise ValueError(f"cluster.adaptive_pack must be in (0, 1], got {pack!r}")
        self.target_s = target_s
        self.pack = pack
        self.active: list[Any] = []  # the decoding side, taking new generations
        self.draining: list[Any] = []  # leaving it: no new generation until empty

    # ----- the two sides --------------------------------------------------------------------
    def decoding(self) -> list[Any]:
        """Replicas holding generations, as the router counts them."""
        return [r for r in self.replicas if self.load[r.index].generations]

    def _choose(self, request: Request, candidates: list[Any]) -> Any:
        if request.is_embedding:
            return min(candidates, key=lambda r: (self._embedding_finish(r, request), r.index))
        self.draining = [r for r in self.draining if self.load[r.index].generations]
        self._maybe_shrink(request)
        limit = self.pack * self.target_s
        idle = [r for r in candidates if r not in self.active and r not in self.draining]
        # an embedding replica with under one iteration of embedding work queued joins even
        # when the decoding side has room: embeddings do not need it, generations do
        spare = [r for r in idle if self._embedding_backlog(r) < self.target_s]
        fits = [(step, r.index, r) for r in self.active
                if self._has_room(r, self.load[r.index], request)
                and (step := self._admission_step(r, self.load[r.index], request)) <= limit]
        if fits and not spare:
            return min(fits)[2]
        back = [r for r in self.draining if self._has_room(r, self.load[r.index], request)]
        if spare:
            back, idle = [], spare
        if back or idle:
            joining = (min(back, key=lambda r: (self.load[r.index].generations, r.index)) if back
                       else min(idle, key=lambda r: (r.outstanding_work, r.index)))
            if joining in self.draining:
                self.draining.remove(joining)
            self.active.append(joining)
            return joining
        roomy = [r for r in candidates if self._has_room(r, self.load[r.index], request)]
        return min(roomy or candidates, key=lambda r: (
            self._admission_step(r, self.load[r.index], request), r.index))

    def _maybe_shrink(self, request: Request) -> None:
        """Drain the least loaded decoding replica when embeddings queue (everywhere more than
        ``SHRINK_BACKLOG`` target periods of work) and the others would hold every generation
        (this one's included) at ``SHRINK_AT`` of the limit."""
        if len(self.active) < 2:
            return
        if min(self._embedding_backlog(r) for r in self.replicas) < self.SHRINK_BACKLOG * self.target_s:
            return
        loads = [self.load[r.index] for r in self.active]
        n = sum(x.generations for x in loads) + 1
        kv = sum(x.decode_kv for x in loads) + request.input_len + request.expected_output_tokens // 2
        final = sum(x.final_kv for x in loads) + request.input_len + request.expected_output_tokens
        k = len(self.active) - 1
        each = -(-n // k)
        probe = _Load(generations=each - 1, decode_kv=kv * (each - 1) // n,
                      final_kv=final * (each - 1) // n)
        ref = self.active[0]
        if (self._has_room(ref, probe, request) and self._admission_step(ref, probe, request)
                <= self.SHRINK_AT * self.pack * self.target_s):
            leaving = min(self.active, key=lambda r: (self.load[r.index].generations, -r.index))
            self.active.remove(leaving)
            if self.load[leaving.index].generations:
                self.draining.append(leaving)

    @staticmethod
    def _has_room(replica: Any, load: _Load, request: Request) -> bool:
        """A decode slot (``max_num_seqs``) and KV blocks for every placed generation's
        expected final length, this one's included: packing past either leaves requests
        queued on one replica while another has room."""
        cfg = replica.policy.config
        return (load.generations < cfg.max_num_seqs and load.final_kv + request.input_len
                + request.expected_output_tokens <= cfg.num_blocks * cfg.block_size)

    # ----- predictions ----------------------------------------------------------------------
    @staticmethod
    def _admission_step(replica: Any, load: _Load, request: Request) -> float:
        """The predicted iteration of ``replica`` once ``request`` joins it: its decodes and the
        newcomer's (each at mid-output context) beside one minimum prompt chunk, so that
        prompts still find room under the target when the replica is full (a replica packed to
        its decodes alone leaves new prompts waiting for a decode to finish: TTFT grows)."""
        cfg = replica.policy.config
        mid = request.input_len + request.expected_output_tokens // 2
        shape = _decode_shape(load.generations + 1, load.decode_kv + mid)
        shape.add_item(ItemKind.PREFILL_CHUNK, min(request.input_len, cfg.min_chunk_tokens), 0,
                       True, replica.cost.lora is not None)
        return replica.cost.shape_time(shape)

    def _embedding_backlog(self, replica: Any) -> float:
        """Seconds of embedding work queued on ``replica`` at its embedding rate."""
        load = self.load[replica.index]
        return load.embed_tokens / self._embedding_rate(replica, load)

    def _embedding_finish(self, replica: Any, request: Request) -> float:
        load = self.load[replica.index]
        return (load.embed_tokens + request.input_len) / self._embedding_rate(replica, load)

    def _embedding_rate(self, replica: Any, load: _Load) -> float:
        """Embedding tokens per second the replica gives beside its generations."""
        return self._rate(replica, load.generations, load.decode_kv, self.target_s)


def _decode_shape(decodes: int, decode_kv: int) -> BatchShape:
    return BatchShape(tokens=decodes, num_seqs=decodes, decodes=decodes, decode_kv=decode_kv,
                      sample_rows=decodes)


def _chunk_rate(replica: Any, decodes: int, decode_kv: int, target_s: float | None) -> float:
    """Chunk tokens per second a replica runs: a full budget of chunks with no decodes, or
    beside them with no target (what the budget leaves them), else the most chunk tokens (a
    multiple of ``min_chunk_tokens``) that fit beside the decodes within the target, per
    target period (a small floor keeps the rate positive)."""
    cfg = replica.policy.config
    chunk = cfg.chunk_size or cfg.token_budget
    step = cfg.min_chunk_tokens

    adapter = replica.cost.lora is not None

    def shape(tokens: int) -> BatchShape:
        s = _decode_shape(decodes, decode_kv) if decodes else BatchShape()
        left = tokens
        while left > 0:
            n = min(chunk, left)
            s.add_item(ItemKind.EMBED_CHUNK, n, 0, False, adapter)
            left -= n
        return s

    if not decodes or target_s is None:
        budget = max(cfg.token_budget - decodes, 1)
        return budget / replica.cost.shape_time(shape(budget))
    lo, hi = 0, cfg.token_budget // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if replica.cost.shape_time(shape(mid * step)) <= target_s:
            lo = mid
        else:
            hi = mid - 1
    return max(lo * step, 1) / target_s


def make_router(rule: str, replicas: list[Any], target_s: float | None = None,
                pack: float = 1.0) -> Router:
    """The router for ``cluster.router``. ``adaptive`` places work on unified replicas; a split
    placement (Dedicated, Disagg-PD) already fixes each replica's kind, so there it routes by
    kind, round-robin within a side."""
    if rule == "adaptive" and any(r.role != "unified" for r in replicas):
        return Router(replicas, "round-robin")
    if rule == "adaptive":
        return AdaptivePlacement(replicas, target_s, pack)
    if rule == "least-predicted-time":
        return LeastPredictedTime(replicas)
    return Router(replicas, rule)
