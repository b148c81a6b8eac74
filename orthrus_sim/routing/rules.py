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
* ``adaptive`` (unified replicas with ``scheduler.tpot_target_s``): the placement planner
  (``placement.py``) picks, from the demand observed, how many replicas decode and whether
  embeddings ride beside their decodes, re-planning as the demand moves; generations spread
  over the decoding side, embeddings go where they finish soonest (``AdaptivePlacement``,
  docs/scheduler.md "Adaptive placement").

A kind goes only to replicas whose role serves it (``ROLES_FOR``): that is the routing by kind of
the split placements (Dedicated N:M, Disagg-PD), whatever the rule.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from orthrus_sim.engine.request import Request, RequestKind
from orthrus_sim.routing.placement import (
    Assignment,
    Demand,
    DemandWindow,
    PlacementPlanner,
    Prediction,
    chunk_rate,
    decode_shape,
)

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
            rate = self._rates[key] = chunk_rate(replica, decodes, decode_kv, target_s)
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
                    + request.expected_output_tokens) / cfg.kv_tokens)
        step = replica.cost.shape_time(decode_shape(slots, kv))
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
    """Co-serving placed by the planner (``placement.PlacementPlanner``): every ``REPLAN_S`` of
    the requests' clock the demand it observed (work in flight and arrivals over
    ``WINDOW_S`` per kind) picks how many replicas decode and whether embeddings ride beside
    their decodes; the static splits are among the assignments it weighs, so it places work at
    least as well as the best of them, as predicted by the replicas' cost model.

    * A generation goes to the decoding replica with the fewest generations that has a decode
      slot and KV blocks for every placed generation's expected final length (else the one
      with the fewest).
    * An embedding goes where it is predicted to finish first among the embedding side, and
      the decoding side too when the plan lets embeddings ride (the queued embedding tokens,
      in whole token budgets, over the replica's embedding rate: a full budget with no
      decodes, the chunk tokens that fit beside its decodes within the target otherwise);
      ties go round the replicas in turn. Counted in whole budgets, embedding replicas whose
      queues all go with their next iteration tie, and taking them in turn keeps their
      batches as full as a split's round-robin does (the lowest index first made batches
      ~10 % smaller on a closed loop, and 0.5 % fewer embeddings).

    Role changes: a replica joins the decoding side at once (draining ones first, else the
    embedding replica with the least outstanding work) and leaves it only by *draining*: it
    takes no new generation and embeds once its last one leaves, so no generation moves.
    Stability: the plan changes when the current one no longer holds the target (at once),
    or when another assignment predicts more than ``PlacementPlanner.HYSTERESIS`` above it at
    the same demand and has done so at every plan for ``DWELL_S``; a demand wavering at a
    boundary between two assignments moves nothing, or at most once per ``DWELL_S``. On an
    open load a plan fails only on evidence: it, or its split with riders toggled, holding at
    the window's count of generations less ``NOISE_SD`` Poisson sds is kept (``_kept``), and a
    burst past the decoding side waits within the stray of its count in flight
    (``_burst_slack``) rather than grow it (docs/scheduler.md, "Role changes and stability").
    Decisions are kept in ``decisions`` (plans that changed the assignment), ``role_changes``
    (per replica) and ``demand_log`` (the demand and assignment at every plan) for the
    results.
    """

    REPLAN_S = 1.0
    WINDOW_S = 10.0
    DWELL_S = 3.0
    NOISE_SD = 3.0  # an open load's plan holding at its count less this many Poisson sds stays

    def __init__(self, replicas: list[Any], target_s: float | None, pack: float = 1.0,
                 closed_loop: bool = False, slo: dict[str, dict[str, float]] | None = None,
                 caps: bool = True) -> None:
        super().__init__(replicas, "adaptive")
        if target_s is None:
            raise ValueError("cluster.router 'adaptive' needs scheduler.tpot_target_s: it packs "
                             "generations onto replicas up to that iteration time")
        if not 0 < pack <= 1:
            raise ValueError(f"cluster.adaptive_pack must be in (0, 1], got {pack!r}")
        self.target_s = target_s
        self.pack = pack
        self.closed_loop = closed_loop
        # a cap on a decoding replica's running generations needs replicas whose scheduler
        # takes one (the simulator's; a real engine behind the gateway does not)
        can_cap = caps and bool(replicas) and all(
            callable(getattr(r.policy, "cap_running", None)) for r in replicas)
        # and an embedding-side replica merged, where the replicas merge (``_resize``)
        merges = bool(replicas) and all(callable(getattr(r, "merge_adapter", None))
                                        for r in replicas)
        self.planner = (PlacementPlanner(replicas[0], len(replicas), pack * target_s, slo,
                                         can_cap, merges) if replicas else None)
        self.plan: Prediction | None = None
        self.active: list[Any] = []  # the decoding side, taking new generations
        self.draining: list[Any] = []  # leaving it: no new generation until empty
        self.decisions: list[dict] = []
        self.role_changes: list[dict] = []
        self.demand_log: list[dict] = []  # at every plan: the demand and the assignment
        self._next_plan = float("-inf")
        self._pending_since: float | None = None  # since when a better plan than the current
        self.window = DemandWindow(self.WINDOW_S, self.REPLAN_S, closed_loop)
        self._embeddings = 0
        self._embedding_turn = 0  # ties among the embedding side go round from here
        self.cap: int | None = None  # a capped plan's decodes per decoding replica

    # ----- the two sides --------------------------------------------------------------------
    def decoding(self) -> list[Any]:
        """Replicas holding generations, as the router counts them."""
        return [r for r in self.replicas if self.load[r.index].generations]

    def demand(self, now: float, arriving: Request | None = None) -> Demand:
        """What the router observed by ``now``: in flight (``arriving`` counted), arrivals per
        second over the window, mean lengths."""
        gens = sum(x.generations for x in self.load.values())
        return self.window.demand(now, gens, self._embeddings, arriving)

    def _low(self, d: Demand) -> Demand:
        """``d`` at the low end of the generation rates the window's count of arrivals allows
        (``NOISE_SD`` Poisson sds below it): a 10 s count of a steady stream strays by 1-2 sds
        often, and a plan dropped for that drains a replica for a generation's lifetime, which
        an embedding side near its capacity does not survive."""
        span = self.window.span
        n = d.generation_rps * span
        return replace(d, generation_rps=max(0.0, n - self.NOISE_SD * math.sqrt(n)) / span)

    def _holds(self, a: Assignment, d: Demand) -> bool:
        """Whether ``a`` holds the target at the low end of ``d`` (``_low``)."""
        return self.planner.predict(a, self._low(d)).feasible

    def _kept(self, current: Assignment, d: Demand) -> Prediction | None:
        """The plan to keep under ``d`` without a role change (None: a role change is due): the
        current one if it holds the target; on an open load also if it holds at the low end of
        ``d``, or else the current split with riders toggled if that holds (at ``d`` or its low
        end) with the margin a planned move needs."""
        p = self.planner.predict(current, d)
        if p.feasible or not self.closed_loop and self._holds(current, d):
            return p
        toggled = replace(current, riders=not current.riders)
        if self.closed_loop or not toggled.decoding:
            return None
        p = self.planner.predict(toggled, d)
        margin = p.decode_s <= self.planner.target_s * (1 - self.planner.HYSTERESIS)
        return p if margin and (p.feasible or self._holds(toggled, d)) else None

    def _better(self, plan: Prediction, kept: Prediction, d: Demand) -> bool:
        """Whether ``plan`` (predicted at ``d``) predicts more than ``kept`` by the planner's
        hysteresis, and, where ``kept`` holds only at the low end of ``d``, there too."""
        more = 1 + self.planner.HYSTERESIS
        if plan.objective <= kept.objective * more:
            return False
        if kept.feasible:
            return True
        low = self._low(d)
        return (self.planner.predict(plan.assignment, low).objective
                > self.planner.predict(kept.assignment, low).objective * more)

    def _observe(self, request: Request) -> None:
        now = request.arrival_time
        self.window.observe(request)
        if now >= self._next_plan:
            self._next_plan = now + self.REPLAN_S
            self._replan(now, request)

    def _replan(self, now: float, arriving: Request | None = None) -> None:
        current = self.plan.assignment if self.plan is not None else None
        demand = self.demand(now, arriving)
        plan = self.planner.plan(demand, current)
        if current is None or plan.assignment == current:
            self._pending_since = None  # nothing better
        elif (kept := self._kept(current, demand)) is not None:
            # the current plan still holds; or it fails at the window's count of generations
            # but it, or it with riders toggled (no role changes), holds at the low end of what
            # that count allows: no evidence the demand moved (a side short of room grows in
            # _choose). Then it stays unless another plan predicts more by the planner's
            # hysteresis (``_better``; the planner's pick already beat a current plan that holds)
            by_choice = (kept.assignment == current and kept.feasible) or (
                self._better(plan, kept, demand))
            if not by_choice:
                plan = kept
                self._pending_since = None
            else:
                # a move by choice: only once another plan has been better for DWELL_S, so a
                # demand wavering at a boundary moves nothing
                if self._pending_since is None:
                    self._pending_since = now
                if now - self._pending_since < self.DWELL_S:
                    plan = kept
                else:
                    self._pending_since = None
        self.plan = plan
        self.demand_log.append({"time_s": now, "generations": demand.generations,
                                "embeddings": demand.embeddings,
                                "generation_rps": demand.generation_rps,
                                "embedding_rps": demand.embedding_rps,
                                "decoding": plan.assignment.decoding,
                                "riders": plan.assignment.riders,
                                "capped": plan.assignment.capped})
        if plan.assignment != current:
            self.decisions.append({"time_s": now, **plan.as_dict(len(self.replicas)),
                                   "demand": asdict(demand)})
        self._resize(plan.assignment.decoding, now)
        self._cap(demand)

    def _resize(self, k: int, now: float) -> None:
        """Grow the decoding side to ``k`` at once, or shrink it by draining."""
        for r in [r for r in self.draining if not self.load[r.index].generations]:
            self.draining.remove(r)
            self._role(r, "embedding", now)
        while len(self.active) > k:
            leaving = min(self.active, key=lambda r: (self.load[r.index].generations, -r.index))
            self.active.remove(leaving)
            if self.load[leaving.index].generations:
                self.draining.append(leaving)
            self._role(leaving, "draining" if leaving in self.draining else "embedding", now)
        while len(self.active) < k:
            back = [r for r in self.draining]
            idle = [r for r in self.replicas if r not in self.active]
            joining = (max(back, key=lambda r: (self.load[r.index].generations, -r.index)) if back
                       else min(idle, key=lambda r: (r.outstanding_work, r.index)))
            if joining in self.draining:
                self.draining.remove(joining)
            self.active.append(joining)
            self._role(joining, "decoding", now)
        for r in self.replicas:  # the embedding side runs its adapter merged, where it can
            merge = getattr(r, "merge_adapter", None)
            if merge is not None:
                merge(r not in self.active and r not in self.draining)

    def _role(self, replica: Any, role: str, now: float) -> None:
        self.role_changes.append({"time_s": now, "replica": replica.index, "role": role})

    def _cap(self, d: Demand) -> None:
        """A capped plan: each decoding replica runs at most the decodes that hold the target
        at ``d`` (the generations past them wait there); any other plan, no cap."""
        if not self.planner.can_cap:
            return
        cap = (self.planner.decode_cap(d) if self.plan is not None and self.plan.assignment.capped
               else None)
        self.cap = cap
        for r in self.replicas:
            r.policy.cap_running(cap if r in self.active else None)

    def _choose(self, request: Request, candidates: list[Any]) -> Any:
        self._observe(request)
        if request.is_embedding:
            riders = self.plan is not None and self.plan.assignment.riders
            side = [r for r in candidates if riders or (r not in self.active and not
                                                         self.load[r.index].generations)]
            n, turn = len(self.replicas), self._embedding_turn
            chosen = min(side or candidates, key=lambda r: (self._embedding_finish(r, request),
                                                           (r.index - turn) % n))
            self._embedding_turn = chosen.index + 1
            return chosen
        if not self.active:  # a generation with no decoding side: one replica joins at once
            self._resize(1, request.arrival_time)
        side = [r for r in self.active if r in candidates] or candidates
        roomy = [r for r in side if self._has_room(r, self.load[r.index], request, self.cap)]
        if not roomy and self.cap is not None and self.closed_loop:
            # a capped plan's generations past the caps wait for a slot, by design
            return min(side, key=lambda r: (self.load[r.index].generations, r.index))
        if not roomy:  # the side is full before the next plan: plan now, and grow it at once
            now = request.arrival_time
            self._replan(now, request)
            side = [r for r in self.active if r in candidates] or candidates
            roomy = [r for r in side if self._has_room(r, self.load[r.index], request, self.cap)]
            if not roomy and len(self.active) < len(self.replicas):
                demand = self.demand(now, request)
                kept = self.planner.predict(self.plan.assignment, demand)
                # one more decoding replica, embeddings riding or not as predicts better (over
                # the last embedding replica, riding keeps the embeddings a replica to go to)
                bigger = max((self.planner.predict(Assignment(len(self.active) + 1, riders),
                                                   demand) for riders in (False, True)),
                             key=lambda p: p.objective)
                grown = bigger.assignment
                least = min(side, key=lambda r: (self._overbooked(r, request), r.index))
                if self._burst_waits(least, side, request, demand, kept, grown):
                    return least
                self.plan = bigger
                self.decisions.append({"time_s": now, **self.plan.as_dict(len(self.replicas)),
                                       "demand": asdict(demand),
                                       "why": "no decoding replica had room"})
                self._resize(grown.decoding, now)
                self._cap(demand)
                side = [r for r in self.active if r in candidates] or candidates
                roomy = [r for r in side
                         if self._has_room(r, self.load[r.index], request, self.cap)]
        return min(roomy or side, key=lambda r: (self.load[r.index].generations, r.index))

    def _placed_here(self, request: Request, replica: Any, sign: int) -> None:
        super()._placed_here(request, replica, sign)
        if request.is_embedding:
            self._embeddings += sign

    def _burst_waits(self, replica: Any, side: list[Any], request: Request, d: Demand,
                     kept: Prediction, grown: Assignment) -> bool:
        """Whether a generation no decoding replica has room for waits in ``replica`` instead
        of growing the side to ``grown`` (a burst is not a new demand, and a grown side drains
        back for a generation's lifetime). Closed loop: ``replica`` at most
        ``CLOSED_LOOP_BURST_SLACK`` past its slots or KV, the plan holding, the grown side
        predicting a lower objective. Open load: at most ``_burst_slack`` past, embeddings
        asked for, the plan holding at the window's count or its low end, and the grown side
        predicting no more than the planner's hysteresis above it (weighed at the low end when
        the plan holds only there: at the count it cannot serve what it is asked)."""
        over = self._overbooked(replica, request)
        if self.closed_loop:
            return (kept.feasible and over <= CLOSED_LOOP_BURST_SLACK
                    and self.planner.predict(grown, d).objective < kept.objective)
        if not d.asks_embedding or over > self._burst_slack(side, d):
            return False
        if kept.feasible:
            at, held = d, kept
        else:
            at = self._low(d)
            held = self.planner.predict(self.plan.assignment, at)
            if not held.feasible:
                return False
        return (self.planner.predict(grown, at).objective
                < held.objective * (1 + self.planner.HYSTERESIS))

    def _burst_slack(self, side: list[Any], d: Demand) -> float:
        """How far past a replica's slots or KV a burst may go before the side grows: the
        stray of a steady stream's count in flight (``NOISE_SD`` Poisson sds of the side's
        capacity in generations of the demand's mean lengths), at most ``BURST_SLACK`` (past
        it, a slot's wait is a tenth of a generation's lifetime)."""
        final = max(1, round(d.prompt_len + d.output_len))
        capacity = sum(min(r.policy.config.max_num_seqs, r.policy.config.kv_tokens // final)
                       for r in side)
        return min(BURST_SLACK, self.NOISE_SD / math.sqrt(max(capacity, 1)))

    def _overbooked(self, replica: Any, request: Request) -> float:
        """How far past its decode slots or KV cache a replica would be with ``request``
        placed (0: within both), as a fraction of them."""
        cfg = replica.policy.config
        load = self.load[replica.index]
        kv = (load.final_kv + request.input_len + request.expected_output_tokens) / cfg.kv_tokens
        return max(0.0, (load.generations + 1) / cfg.max_num_seqs - 1, kv - 1)

    @staticmethod
    def _has_room(replica: Any, load: _Load, request: Request, cap: int | None = None) -> bool:
        """A decode slot (``max_num_seqs``, or a capped plan's cap) and KV blocks for every
        placed generation's expected final length, this one's included: packing past either
        leaves requests queued on one replica while another has room."""
        cfg = replica.policy.config
        slots = cfg.max_num_seqs if cap is None else min(cap, cfg.max_num_seqs)
        return (load.generations < slots and load.final_kv + request.input_len
                + request.expected_output_tokens <= cfg.kv_tokens)

    # ----- predictions ----------------------------------------------------------------------
    def _embedding_finish(self, replica: Any, request: Request) -> float:
        """When ``request`` would be embedded on ``replica``: its queue's tokens and its own,
        in whole token budgets, over the replica's embedding rate. On an embedding replica a
        budget is an iteration, so a queue of less than one ahead finishes with the next
        iteration wherever it goes (a tie); a rider replica, whose decodes leave a fraction of
        a budget per iteration, is priced by whole budgets too, so embeddings ride only where
        the embedding side is a budget or more behind (counted in iterations there instead,
        riders took more and the phased mix ran 2 % slower)."""
        load = self.load[replica.index]
        budget = replica.policy.config.token_budget
        tokens = -(-(load.embed_tokens + request.input_len) // budget) * budget
        return tokens / self._embedding_rate(replica, load)

    def _embedding_rate(self, replica: Any, load: _Load) -> float:
        """Embedding tokens per second the replica gives beside its generations."""
        return self._rate(replica, load.generations, load.decode_kv, self.target_s)


BURST_SLACK = 0.10  # an open load's generation never waits further past the decoding side
CLOSED_LOOP_BURST_SLACK = 0.05  # a closed loop's burst (its clients bound the count in flight)


def closed_loop(scenario: Any) -> bool:
    """Whether a scenario's clients wait for their answers (a closed loop): the planner then
    counts a faster decode as more generations served, not only as shorter TPOT."""
    w = scenario.workload
    return w.kind != "trace" and all(p.process == "closed-loop" for p in w.default_pools())


def one_pool(scenario: Any) -> bool:
    """Whether a closed loop's clients each send both kinds (one mixed pool, or workflows):
    there a generation waiting for a slot holds its client, who sends no embedding meanwhile,
    so a cap on the decoding side trades generations for embeddings that never come (capped
    plans churned eleven times in 180 s on the mix sweep's mixed pool and served less of both)."""
    return closed_loop(scenario) and any(p.kind in ("mixed", "workflow")
                                         for p in scenario.workload.default_pools())


def slo_bounds(scenario: Any) -> dict[str, dict[str, float]] | None:
    """The SLO bounds per kind the planner holds to with ``cluster.objective: goodput`` (a
    kind with none: finishing is enough); None for the throughput objective."""
    if scenario.cluster.objective != "goodput":
        return None
    return {kind: scenario.slo.bounds(kind) for kind in ("embedding", "generation")}


@dataclass(frozen=True)
class RouterRule:
    """How a cluster routes: ``cluster.router`` and, for ``adaptive``, the iteration-time
    target it packs to, the packing, whether clients wait for answers and the goodput
    objective's SLO bounds. The simulated cluster and the gateway serving a scenario (``serve
    --scenario``, Ray Serve's ingress) all take theirs from ``of``, so a measured cluster is
    placed by the rule its simulation ran."""

    rule: str = "round-robin"
    target_s: float | None = None
    pack: float = 1.0
    closed_loop: bool = False
    slo: dict[str, dict[str, float]] | None = None
    caps: bool = True  # capped plans weighed (not where one pool's clients send both kinds)

    @classmethod
    def of(cls, scenario: Any, target_s: float | None) -> RouterRule:
        """The scenario's rule, with the unified replicas' iteration-time target."""
        return cls(scenario.cluster.router, target_s, scenario.cluster.adaptive_pack,
                   closed_loop(scenario), slo_bounds(scenario), not one_pool(scenario))

    def make(self, replicas: list[Any]) -> Router:
        return make_router(self.rule, replicas, self.target_s, self.pack, self.closed_loop,
                           self.slo, self.caps)


def make_router(rule: str, replicas: list[Any], target_s: float | None = None,
                pack: float = 1.0, closed_loop: bool = False,
                slo: dict[str, dict[str, float]] | None = None, caps: bool = True) -> Router:
    """The router for ``cluster.router``. ``adaptive`` places work on unified replicas; a split
    placement (Dedicated, Disagg-PD) already fixes each replica's kind, so there it routes by
    kind, round-robin within a side."""
    if rule == "adaptive" and any(r.role != "unified" for r in replicas):
        return Router(replicas, "round-robin")
    if rule == "adaptive":
        return AdaptivePlacement(replicas, target_s, pack, closed_loop, slo, caps)
    if rule == "least-predicted-time":
        return LeastPredictedTime(replicas)
    return Router(replicas, rule)
