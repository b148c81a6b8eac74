"""What any placement could serve: an upper bound on the normalised throughput of every way of
placing a demand's work on the replicas within the TPOT target, beside the best static split,
both under the placement planner's steady-state prediction (its cost model, its references).

A placement gives each replica some decodes (at most its slots) and some chunk tokens per
iteration beside them (prompt chunks and embedding riders), within the target; or no decodes
and a whole budget of chunks (embeddings, prompts, or both). It is free to:

* **cap** a replica's decodes below the generations it is given, the rest waiting for a slot
  (a closed loop's decodes add up to at most its generations in flight, not exactly);
* **offload prompts** to other replicas (Disagg-PD: prefill replicas co-batch prompts with
  embeddings, decoding replicas run decodes alone), as long as every prompt is prefilled
  somewhere: each decode ends after ``output_len`` iterations and brings a ``prompt_len``-token
  prompt.

The bound relaxes what couples the replicas and is exact in the rest. Prompt conservation gets
a price ``lambda`` per prompt token/s: each replica is paid for the prompts it prefills and
charged for the prompts its decodes bring, and since a placement prefills every prompt, for any
``lambda >= 0`` the best relaxed placement serves at least the best real one (weak duality);
the bound is the least over ``lambda`` (a convex function of it: a golden-section search).
Kinds whose demand is capped (the embeddings asked for, an open load's generation rate) are
weighed the same way: ``min(x, cap) <= w x + (1 - w) cap`` for every weight ``w``, the least
over ``WEIGHTS + 1`` weights. A replica's prompt and rider tokens are pooled as its chunk tokens,
priced at the cheaper of all-prompt and all-rider (the dearer where a replica's term is
negative), and paid at the better of the two rates; a closed loop's decodes are shared out by
dynamic programming over the replicas, exactly. A replica embedding with its whole budget is
priced with its adapter merged (``merged``: as the simulator's embedding side runs; the real
gateway's engines keep it unmerged, pass False).

The best static split is priced exactly (no relaxation): ``k`` replicas decoding, the
generations spread evenly, the rest embedding with their whole budget; each as it is (every
generation in flight decodes, or the split does not hold), capped at the most decodes that hold
the target, with its prompts offloaded to the embedding side, or both; ``k`` from 0 to all."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from orthrus_sim.routing.placement import Assignment, Demand, chunk_rate, chunk_shape

if TYPE_CHECKING:
    from orthrus_sim.routing.placement import PlacementPlanner

WEIGHTS = 10  # the weights on capped kinds: 0, 1/10, ..., 1
PRICE_STEPS = 24  # golden-section steps over the prompts' price (to ~1e-5 of its range)


@dataclass(frozen=True)
class Bound:
    """The most normalised throughput any placement of the replicas is predicted to serve for
    one demand within the target (``bound``), beside the best static split's under the same
    prediction: what co-serving could add to the split at most."""

    # an upper bound over placements (nan: in a closed loop, none decodes anything within it)
    objective: float
    # the best static split's (nan: none serves), and which it is (``Assignment.label``)
    best_split: float
    best_split_label: str = ""
    best_split_cap: int | None = None  # its decodes per replica, where capped
    # the relaxation's placement at the bound: per replica, decodes (None: a whole budget of
    # chunks) and chunk tokens per iteration (prompts and riders, pooled)
    placement: tuple[tuple[int | None, int], ...] = ()
    asked: float = math.nan  # an open load's whole demand, normalised (nan: a closed loop)

    @property
    def serves_demand(self) -> bool | None:
        """Whether some placement may serve an open load's whole demand (None: closed loop)."""
        if not math.isfinite(self.asked):
            return None
        return math.isfinite(self.objective) and self.objective >= self.asked * (1 - 1e-6)

    @property
    def headroom(self) -> float:
        """The bound over the best split: 1.0 means no placement serves more than the split
        (nan where either is missing or the split serves nothing)."""
        if not (math.isfinite(self.objective) and math.isfinite(self.best_split)) \
                or self.best_split <= 0:
            return math.nan
        return self.objective / self.best_split

    def as_dict(self) -> dict:
        out = asdict(self)
        out["placement"] = [list(r) for r in self.placement]
        out["serves_demand"] = self.serves_demand
        for key in ("objective", "best_split", "asked"):  # JSON has no nan
            if not math.isfinite(out[key]):
                out[key] = None
        out["headroom"] = self.headroom if math.isfinite(self.headroom) else None
        return out


@dataclass(frozen=True)
class _Options:
    """Every way one replica may be used, as arrays grouped by decode count (``counts``, each
    group from ``starts``; 0: a whole budget of chunks): chunk tokens per iteration, and the
    iteration's seconds at the cheaper and the dearer pricing of those tokens."""

    decodes: np.ndarray
    tokens: np.ndarray
    t_lo: np.ndarray
    t_hi: np.ndarray
    counts: np.ndarray
    starts: np.ndarray
    # a row's tokens are prompts or riders, pooled (offload: its prompts priced by the price);
    # else riders beside its own decodes' prompts, priced exactly in its time
    pooled: np.ndarray


def bound(planner: PlacementPlanner, d: Demand, merged: bool = True, riders: bool = True,
          offload: bool = True) -> Bound:
    """The bound on any placement of ``planner``'s replicas for ``d`` (module docstring).
    Without ``offload`` each replica prefills its own decodes' prompts, without ``riders``
    (and ``offload``) no embedding rides beside decodes: what the decodes' spread alone, then
    riders, then offloaded prompts add over the best split (the parts of a gain)."""
    if offload and not riders:
        raise ValueError("a bound without riders is one without offloaded prompts too")
    planner.set_piece(d)
    gen_ref, emb_ref = planner.references(d)
    emb_len = max(d.embedding_len, 1.0)
    out_len = max(d.output_len, 1.0)
    prompt = max(d.prompt_len, 0.0)
    emb_cap = embeddings_asked(planner, d, planner.replicas, merged)
    gen_cap = math.inf if d.closed_loop else d.generation_rps
    opts = _options(planner, d, merged, riders, offload)
    need = min(planner.in_flight(d), planner.replicas * planner.slots(d)) if d.closed_loop else 0
    # the fewest decodes a replica that leaves generations waiting holds: the most that fit
    # within the target beside their own prompts (with the prompts offloaded, more fit)
    full = planner.decode_cap(d) if d.closed_loop and d.asks_generation else 1

    def values(w_gen: float, w_emb: float, price: float) -> np.ndarray:
        """Each option's relaxed value at these weights and this prompt price."""
        per_gen = w_gen / gen_ref if gen_ref > 0 else 0.0
        per_token = w_emb / emb_ref / emb_len
        num = opts.decodes * per_gen / out_len + np.where(
            opts.pooled, max(per_token, price) * opts.tokens - opts.decodes * price * prompt
            / out_len, per_token * opts.tokens)
        return np.where(num >= 0, num / opts.t_lo, num / opts.t_hi)

    def dual(w_gen: float, w_emb: float, price: float) -> float:
        """The best relaxed placement's value."""
        per_count = np.maximum.reduceat(values(w_gen, w_emb, price), opts.starts)
        return _best(per_count, opts.counts, planner.replicas, need, d.closed_loop, full)[0]

    weights = [i / WEIGHTS for i in range(WEIGHTS + 1)]
    # a cap above what every replica could serve binds no placement: weight 1 alone is least
    most_emb = planner.replicas * float(np.max(opts.tokens / opts.t_lo)) / emb_len
    most_gen = planner.replicas * float(np.max(opts.decodes / opts.t_lo)) / out_len
    best, at = math.inf, None
    for w_emb in weights if emb_cap < most_emb else [1.0]:
        for w_gen in weights if gen_cap < most_gen and gen_ref > 0 else [1.0]:
            fixed = (1 - w_emb) * emb_cap / emb_ref
            if gen_cap < math.inf and gen_ref > 0:
                fixed += (1 - w_gen) * gen_cap / gen_ref
            top = 4 * max(w_emb / emb_ref / emb_len, w_gen / gen_ref / max(prompt, 1.0)
                          if gen_ref > 0 else 0.0) if offload else 0.0
            price, value = _least(lambda x, g=w_gen, e=w_emb: dual(g, e, x), top)
            if value + fixed < best:
                best, at = value + fixed, (w_gen, w_emb, price)
    placement = ()
    if at is not None and math.isfinite(best):  # the relaxed placement at the least
        value = values(*at)
        per_count = np.maximum.reduceat(value, opts.starts)
        counts = _best(per_count, opts.counts, planner.replicas, need, d.closed_loop, full)[1]
        placement = tuple(_chosen(opts, value, n) for n in counts)
    split, label, cap = _best_split(planner, d, merged, gen_ref, emb_ref, gen_cap)
    asked = math.nan if d.closed_loop else (
        (d.generation_rps / gen_ref if gen_ref > 0 else 0.0) + d.embedding_rps / emb_ref)
    return Bound(best if math.isfinite(best) else math.nan, split, label, cap, placement, asked)


def _options(planner: PlacementPlanner, d: Demand, merged: bool, riders: bool = True,
             offload: bool = True) -> _Options:
    """Each decode count with each number of chunk tokens (multiples of ``min_chunk_tokens``,
    and the most that fit) within the target, and the whole-budget replica's chunk counts:
    pooled prompts and riders (``offload``), or riders beside the decodes' own prompts."""
    mid = planner.mid(d)
    out = max(d.output_len, 1.0)
    step, budget = planner.min_chunk, planner.budget
    rows: list[tuple[int, float, float, float, bool]] = []
    for tokens in range(step, budget + 1, step):  # no decodes: a budget of chunks, no target
        as_riders = _embedding_s(planner, tokens, merged)
        as_prompts = planner.iteration_s(0, 0, tokens) if offload else as_riders
        rows.append((0, tokens, min(as_prompts, as_riders), max(as_prompts, as_riders), offload))
    most = min(planner.slots(d), planner.in_flight(d)) if d.closed_loop else planner.slots(d)

    def priced(n: int, tokens: int) -> tuple[float, float]:
        if not offload:  # riders beside the decodes' own prompts
            t = prompts_s(planner, d, n, n * d.prompt_len / out, tokens)
            return t, t
        as_prompts = planner.iteration_s(n, n * mid, tokens)
        as_riders = planner.iteration_s(n, n * mid, 0, tokens)
        return min(as_prompts, as_riders), max(as_prompts, as_riders)

    for n in range(1, most + 1 if d.asks_generation else 1):
        if offload:  # a replica prefilling its own decodes' prompts, as a split's does
            own = n * d.prompt_len / out
            own_s = prompts_s(planner, d, n, own)
            if own_s <= planner.target_s:
                rows.append((n, own, own_s, own_s, True))
        last = None
        for tokens in range(0, budget - n + 1 if riders else 1, step):
            lo, hi = priced(n, tokens)
            if lo > planner.target_s:
                break
            rows.append((n, tokens, lo, hi, offload))
            last = tokens
        if last is None:  # more decodes fit no better
            break
        if not offload:  # riders come in multiples of min_chunk_tokens
            continue
        # the most chunk tokens that fit, to the token (a prompt is cut anywhere): a value
        # (a + b c) / t(c) with t near affine in c is largest at an end of what fits
        low, high = last, min(last + step, budget - n + 1) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if priced(n, middle)[0] <= planner.target_s:
                low = middle
            else:
                high = middle - 1
        if low > last:
            rows.append((n, low, *priced(n, low), True))
    decodes = np.array([r[0] for r in rows], dtype=int)
    counts, starts = np.unique(decodes, return_index=True)  # rows are in decode order
    a = np.array([r[1:4] for r in rows], dtype=float)
    return _Options(decodes, a[:, 0], a[:, 1], a[:, 2], counts, starts,
                    np.array([r[4] for r in rows], dtype=bool))


def prompts_s(planner: PlacementPlanner, d: Demand, n: int, tokens: float,
              riders: int = 0) -> float:
    """Seconds of an iteration of ``n`` decodes at mid-output beside ``tokens`` prompt tokens
    (and ``riders`` embedding tokens), a mean that need not be whole (a steady state's prompts
    arrive ``prompt_len / output_len`` per decode per iteration): between the whole counts
    around it."""
    kv = n * planner.mid(d)
    low = math.floor(tokens)
    t = planner.iteration_s(n, kv, low, riders)
    if tokens > low:
        t += (tokens - low) * (planner.iteration_s(n, kv, low + 1, riders) - t)
    return t


def _chosen(opts: _Options, value: np.ndarray, n: int) -> tuple[int | None, int]:
    """A replica's placement: its decodes (None: a whole budget of chunks) and the chunk
    tokens of its best option with that many."""
    rows = np.flatnonzero(opts.decodes == n)
    tokens = int(opts.tokens[rows[np.argmax(value[rows])]])
    return (n or None, tokens)


def embeddings_asked(planner: PlacementPlanner, d: Demand, replicas: int, merged: bool) -> float:
    """The most embeddings/s ``d`` asks of ``replicas`` replicas: an open load's rate; a closed
    loop's embeddings in flight, each answered no sooner than the iteration that holds it. That
    iteration is at fastest one of embeddings alone, their share of those in flight spread evenly
    (a replica's embeddings/s grows ever slower with its batch, so an even spread serves the
    most), at most a whole budget. The planner's estimate (one whole-budget iteration each) is
    no bound: 8 clients on an embedding replica of a 2-replica split were served 95/s against
    its 49/s, each in an iteration of their 1,024 tokens."""
    asked = planner.embedding_demand(d)[1]
    if not d.closed_loop or d.embeddings <= 0 or replicas <= 0:
        return asked
    tokens = min(d.embeddings * max(d.embedding_len, 1.0) / replicas, planner.budget)
    return max(asked, d.embeddings / _embedding_s(planner, max(1, math.floor(tokens)), merged))


def _embedding_s(planner: PlacementPlanner, tokens: int, merged: bool) -> float:
    """Seconds of an iteration of ``tokens`` embedding tokens alone, the adapter merged or
    not."""
    shape = chunk_shape(planner.replica, 0, 0, tokens, piece=planner.piece,
                        adapter=False if merged else None)
    return planner.replica.cost.shape_time(shape)


def _best(per_count: np.ndarray, counts: np.ndarray, replicas: int, need: int,
          closed: bool, full: int = 1) -> tuple[float, list[int]]:
    """The highest sum over the replicas of one option's value each (``per_count``: the best
    option's with each decode count in ``counts``), and each replica's decode count. A closed
    loop's decodes add up to ``need``, or to fewer where every replica that decodes holds at
    least ``full`` (a cap: generations wait for a slot only where the decoding replicas have
    none left within the target) and one does (nothing starves them)."""
    if not closed:  # no coupling: every replica takes the best option
        i = int(np.argmax(per_count))
        return float(per_count[i]) * replicas, [int(counts[i])] * replicas
    keep = (counts <= need) & np.isfinite(per_count)
    ns, vs = counts[keep], per_count[keep]
    at_full = (ns == 0) | (ns >= full)  # a count a replica may hold while generations wait
    # max-plus over the replicas, all counts at once: ``gather[i, s]`` is the state ``s`` came
    # from with ``ns[i]`` more decodes; states are the decodes placed so far, each with every
    # decoding replica full so far (``at_cap``) or not (``any_n``)
    gather = np.arange(need + 1)[None, :] - ns[:, None]
    valid = gather >= 0
    gather = np.where(valid, gather, 0)
    at_cap = np.full(need + 1, -np.inf)
    any_n = np.full(need + 1, -np.inf)
    at_cap[0] = 0.0
    steps = []
    for _ in range(replicas):
        from_cap = np.where(valid, at_cap[gather] + vs[:, None], -np.inf)
        from_any = np.where(valid, any_n[gather] + vs[:, None], -np.inf)
        cap_only = np.where(at_full[:, None], from_cap, -np.inf)
        i_cap = cap_only.argmax(0)
        both = np.maximum(from_cap, from_any)
        i_any = both.argmax(0)
        cols = np.arange(need + 1)
        steps.append((ns[i_cap], ns[i_any], from_cap[i_any, cols] >= from_any[i_any, cols]))
        at_cap, any_n = cap_only[i_cap, cols], both[i_any, cols]
    ends = [(float(any_n[need]), need, False)] + [
        (float(at_cap[s]), s, True) for s in range(1, need + 1)]
    value, end, capped = max(ends)
    if not np.isfinite(value):
        return -math.inf, []
    placed = []
    for took_cap, took_any, came_from_cap in reversed(steps):
        n = int(took_cap[end] if capped else took_any[end])
        if not capped:
            capped = bool(came_from_cap[end])
        placed.append(n)
        end -= n
    return value, placed


def _least(f, top: float) -> tuple[float, float]:
    """Where a convex ``f`` is least over ``[0, top]``, and its value there: golden-section
    search, the ends included."""
    if top <= 0:
        return 0.0, f(0.0)
    seen = {0.0: f(0.0), top: f(top)}
    ratio = (math.sqrt(5) - 1) / 2
    lo, hi = 0.0, top
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(PRICE_STEPS):
        seen[a], seen[b] = fa, fb
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = f(b)
    seen[a], seen[b] = fa, fb
    x = min(seen, key=seen.get)
    return x, seen[x]


def _best_split(planner: PlacementPlanner, d: Demand, merged: bool, gen_ref: float,
                emb_ref: float, gen_cap: float) -> tuple[float, str, int | None]:
    """The best static split's normalised throughput, its label and its cap (module
    docstring), each priced exactly."""
    n_rep = planner.replicas
    emb_len = max(d.embedding_len, 1.0)
    out_len = max(d.output_len, 1.0)
    whole = (chunk_rate(planner.replica, 0, 0, None, planner.piece, adapter=False) if merged
             else planner.full_rate(emb_len))  # an embedding replica's tokens/s
    prefill = planner.full_rate(emb_len)  # a prefill replica's (prompts beside embeddings)
    most = min(planner.slots(d), planner.in_flight(d)) if d.closed_loop else planner.slots(d)

    def per_replica(offload: bool) -> dict[int, float]:
        """Generations/s of one replica holding ``n`` decodes within the target."""
        rates = {}
        for n in range(1, most + 1):
            t = prompts_s(planner, d, n, 0 if offload else n * d.prompt_len / out_len)
            if t > planner.target_s * (1 + 1e-6):
                break
            rates[n] = n / (out_len * t)
        return rates

    def normalised(gen: float, emb: float, others: int) -> float:
        counted = min(gen, gen_cap) / gen_ref if gen_ref > 0 else 0.0
        return counted + min(emb, embeddings_asked(planner, d, others, merged)) / emb_ref

    best, label, best_cap = -math.inf, "", None
    for offload in (False, True):
        rates = per_replica(offload)
        cap = max(rates, default=0)
        for k in range(n_rep + 1):
            others = n_rep - k
            if offload and not 0 < k < n_rep:
                continue
            for capped in (False, True):
                if capped and (not k or not cap):
                    continue
                gen = _split_generations(d, k, rates, cap if capped else None)
                if gen is None:
                    continue
                if offload:  # the other side prefills the prompts beside its embeddings
                    gen = min(gen, others * prefill / max(d.prompt_len, 1.0))
                    emb = (others * prefill - gen * d.prompt_len) / emb_len
                else:
                    emb = others * whole / emb_len
                if not d.asks_generation:
                    gen = 0.0
                value = normalised(gen, emb, others)
                if value > best:
                    best, label = value, Assignment(k, False, capped, offload).label(n_rep)
                    best_cap = cap if capped else None
    return (best if math.isfinite(best) else math.nan), label, best_cap


def _split_generations(d: Demand, k: int, rates: dict[int, float], cap: int | None
                       ) -> float | None:
    """Generations/s of ``k`` replicas decoding a split's generations evenly (``cap``: at most
    that many each, the rest waiting); None where a closed loop's generations do not all fit
    uncapped (a split that leaves them waiting unbidden does not hold)."""
    if not d.asks_generation:
        return 0.0
    if k == 0:
        return None if d.closed_loop else 0.0
    most = cap if cap is not None else max(rates, default=0)
    if d.closed_loop:
        q, extra = divmod(math.ceil(d.generations - 1e-9), k)
        if cap is None and q + (extra > 0) > most:
            return None
        low, high = min(q, most), min(q + 1, most)
        return extra * rates.get(high, 0.0) + (k - extra) * rates.get(low, 0.0)
    if not rates:
        return 0.0
    return k * min(d.generation_rps / k, rates[most])
