"""The decode cohort: a replica's running decodes advanced together, their progress kept as
one step counter and applied to each request only when something reads it.

Every iteration moves every running decode one token on; stepping does that with a pass over
the decodes when the batch is scheduled (each one's item and KV growth) and another when it
completes. The simulator's fast path (``Policy.use_cohort``, set by ``sim/replica.py``; real
executors step) keeps the decodes here instead: a member joins with its counts at the step it
became a decode, and at step ``S`` it has ``S - joined`` more tokens. What an iteration needs
of the decodes is kept in aggregate, so scheduling, completing and fast-forwarding them costs
the same for 5 decodes as for 250:

* their number and the KV rows they read (the batch's cost);
* the KV blocks they hold at any step, from the residues of their lengths modulo the block
  size (``virtual_at``), written to the block manager as ``virtual`` blocks: admission and
  snapshots see what stepping would have allocated, without a table growing per token;
* who finishes when (a heap by finishing step, ties in ``_running`` order, as stepping's
  items are).

A member's fields are written back (``settle``) when it finishes, is aborted, or anything
reads the running requests through the policy's views; ``settle_all`` does all of them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from orthrus_sim.engine.kv_cache import BlockManager
from orthrus_sim.engine.request import Request


@dataclass(slots=True, eq=False)  # compared by identity (``_fresh.remove``)
class Member:
    request: Request
    computed: int  # num_computed when it joined
    generated: int  # num_generated when it joined
    joined: int  # the cohort's step count then
    held: int  # KV blocks in its table (its real ones; the rest are the cohort's virtual)
    order: int  # its place in the policy's running order (admission)


class DecodeCohort:
    """The members, their aggregates and the step counter (see the module docstring)."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.bs = blocks.block_size
        self.steps = 0  # iterations the cohort has completed
        self.last_end = 0.0  # when the last of them ended: every member's ready_since
        self.members: dict[str, Member] = {}
        self._finishes: list[tuple[int, int, str]] = []  # (step it finishes at, order, id)
        # sum over members of (computed - joined): KV rows read at step S are this + n*(S+1)
        self._kv_base = 0
        # blocks a member needs at step S (for its next token) are ceil((a + S) / bs), with
        # a = computed - joined + 1; kept as sum(u) and the counts of r, a + bs - 1 = u*bs + r
        self._units = 0
        self._residues = [0] * self.bs
        self._held = 0  # real blocks of the members
        # the step whose blocks ``virtual`` holds: ``steps`` once it is scheduled, and
        # ``steps - 1`` after it completed
        self.blocks_step = -1
        # for ``ready_key``: members that joined since the last step (their own ready_since
        # stands), and the least FCFS key of the others (None: to be found again)
        self._fresh: list[Member] = []
        self._stale_order: tuple[float, int] | None = None

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.members

    # ----- membership -------------------------------------------------------------------------
    def can_join(self, request: Request) -> bool:
        """A decode whose table holds exactly its computed tokens' blocks (the usual case; one
        holding more, reserved ahead, would break the aggregate and steps on its own)."""
        return len(self.blocks.tables.get(request.request_id, ())) == \
            -(-request.num_computed // self.bs)

    def join(self, request: Request, order: int) -> None:
        rid = request.request_id
        held = len(self.blocks.tables.get(rid, ()))
        m = Member(request, request.num_computed, request.num_generated, self.steps, held, order)
        self.members[rid] = m
        self._fresh.append(m)
        a = m.computed - m.joined + 1
        u, r = divmod(a + self.bs - 1, self.bs)
        self._units += u
        self._residues[r] += 1
        self._kv_base += m.computed - m.joined
        self._held += held
        finish = self.steps + request.max_output_tokens - request.num_generated
        heapq.heappush(self._finishes, (finish, order, rid))

    def _leave(self, m: Member) -> None:
        del self.members[m.request.request_id]
        if m.joined == self.steps:
            self._fresh.remove(m)
        elif m.request.order == self._stale_order:
            self._stale_order = None
        a = m.computed - m.joined + 1
        u, r = divmod(a + self.bs - 1, self.bs)
        self._units -= u
        self._residues[r] -= 1
        self._kv_base -= m.computed - m.joined
        self._held -= m.held

    # ----- aggregates ---------------------------------------------------------------------------
    def virtual_at(self, step: int) -> int:
        """The blocks the members need at ``step`` (each its tokens so far plus the next one)
        less their real ones: what the cohort holds as virtual blocks then."""
        bs = self.bs
        part = step % bs
        total = self._units + len(self.members) * (step // bs) - self._held
        if part:
            total += sum(self._residues[bs - part:])
        return total

    def decode_kv(self) -> int:
        """KV rows the members' decodes read at the next step (context + the token)."""
        return self._kv_base + len(self.members) * (self.steps + 1)

    def next_finish(self) -> int | None:
        """The step count at which the next member finishes."""
        return self._finishes[0][0] if self._finishes else None

    def set_blocks(self, step: int) -> None:
        """Hold the blocks of ``step`` (what scheduling it grows), as virtual blocks."""
        self.blocks_step = step
        self.blocks.virtual = self.virtual_at(step)

    def take_blocks(self, step: int) -> bool:
        """``set_blocks(step)`` if they fit what the cache has free beside the members."""
        virtual = self.virtual_at(step)
        if virtual > len(self.blocks._free):
            return False
        self.blocks_step = step
        self.blocks.virtual = virtual
        return True

    def fits(self, step: int) -> bool:
        """Whether the blocks of ``step`` fit what the cache has free beside the members."""
        return self.virtual_at(step) <= len(self.blocks._free)

    def steps_fitting(self, limit: int) -> int:
        """The most steps (up to ``limit``) from now whose KV growth fits, each step's blocks
        grown when it is scheduled: step ``steps + k - 1`` must fit."""
        if self.fits(self.steps + limit - 1):
            return limit
        lo, hi = 0, limit - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(self.steps + mid - 1):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ----- progress ----------------------------------------------------------------------------
    def advance(self, steps: int, now: float) -> list[Request]:
        """``steps`` iterations done, the last ending at ``now``; the members that finish then
        (settled, in running order: the caller finishes them)."""
        if steps and self._fresh:  # the members that joined have run: ready since ``now``
            order = min(m.request.order for m in self._fresh)
            if self._stale_order is not None or len(self._fresh) == len(self.members):
                self._stale_order = order if self._stale_order is None else min(
                    self._stale_order, order)
            self._fresh = []
        self.steps += steps
        self.last_end = now
        done: list[Request] = []
        finishes = self._finishes
        while finishes and finishes[0][0] <= self.steps:
            finish, _, rid = heapq.heappop(finishes)
            if finish < self.steps:
                raise RuntimeError(f"decode cohort: request {rid} ran past its last token")
            done.append(self.settle(self.members[rid]))
        return done

    def settle(self, m: Member) -> Request:
        """Write a member's progress into its request, give its table the blocks it holds,
        and take it out of the cohort."""
        req = m.request
        ahead = self.steps - m.joined
        req.num_computed = m.computed + ahead
        req.num_generated = m.generated + ahead
        if ahead:
            req.ready_since = self.last_end
        self._leave(m)
        need = -(-(m.computed - m.joined + 1 + self.blocks_step) // self.bs)
        if need > m.held:  # its virtual blocks become real ones
            self.blocks.virtual -= need - m.held
            if not self.blocks.grow(req.request_id, need * self.bs):
                raise RuntimeError(f"decode cohort: request {req.request_id} lost its blocks")
        return req

    def sync(self) -> None:
        """Write every member's progress into its request; they stay members (a view reads
        them; their blocks stay the cohort's)."""
        steps, end = self.steps, self.last_end
        for m in self.members.values():
            ahead = steps - m.joined
            if ahead:
                req = m.request
                req.num_computed = m.computed + ahead
                req.num_generated = m.generated + ahead
                req.ready_since = end

    def ready_key(self) -> tuple[float, tuple[float, int]] | None:
        """The least ``(ready_since, order)`` over the members as ``sync`` would leave them,
        without writing them: one that has run since it joined is ready since ``last_end``.
        (Unified-Homo's choice of side reads it every iteration; the least order of the
        members that have run is kept, and found again only when its member leaves.)"""
        keys = [(m.request.ready_since, m.request.order) for m in self._fresh]
        if len(self._fresh) < len(self.members):
            if self._stale_order is None:
                steps = self.steps
                self._stale_order = min(m.request.order for m in self.members.values()
                                        if m.joined < steps)
            keys.append((self.last_end, self._stale_order))
        return min(keys, default=None)

    def settle_one(self, request_id: str) -> Request | None:
        m = self.members.get(request_id)
        if m is None:
            return None
        self._finishes = [f for f in self._finishes if f[2] != request_id]
        heapq.heapify(self._finishes)
        return self.settle(m)

    def settle_all(self) -> None:
        """Every member settled (in running order) and the cohort emptied."""
        for m in sorted(self.members.values(), key=lambda m: m.order):
            self.settle(m)
        self._finishes.clear()
        self.blocks.virtual = 0
