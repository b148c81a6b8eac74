"""A replica: one model instance on one GPU, as a SimPy process.

Its loop is the brief's three stages: ask the shared policy for a batch unit, hold for the cost
model's iteration time, then complete the items. A request that arrives while an iteration is in
flight enters the policy when that iteration ends, as in a real engine, whose thread takes new
requests in between steps (``orthrus_real/server/engine_thread.py``, vLLM's engine core): a policy whose
choice depends on when work became ready (Unified-Homo) then sees what the real one sees.

Its policy keeps the running decodes as a decode cohort (``engine/cohort.py``), so an
iteration costs the same however many decodes ride in it; and when only identical decode
iterations can follow (nobody finishes, nothing new can be admitted, the KV cache can grow), it
advances the whole run in one step, cut short at the first iteration boundary after a new
request arrives, so the result is what stepping one iteration at a time gives.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import simpy
from simpy.events import Timeout

from orthrus_sim.costmodel.factors import padded
from orthrus_sim.costmodel.shape import BatchShape
from orthrus_sim.engine.decode_run import complete_decode_run, decode_run_length, run_on
from orthrus_sim.engine.policy import Policy
from orthrus_sim.engine.request import Request
from orthrus_sim.sim.front_end import FrontEnd


@dataclass(slots=True)
class ReplicaStats:
    """Cumulative counters of one replica (a window is the difference of two copies)."""

    iterations: int = 0
    busy_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    tokens: int = 0
    budget_fill_sum: float = 0.0
    embed_tokens: int = 0
    gen_tokens: int = 0
    decode_runs: int = 0

    def copy(self) -> ReplicaStats:
        # positional, field by field: the monitor copies every replica's counters each interval
        return ReplicaStats(self.iterations, self.busy_s, self.flops, self.bytes, self.tokens,
                            self.budget_fill_sum, self.embed_tokens, self.gen_tokens,
                            self.decode_runs)

    def minus(self, earlier: ReplicaStats) -> ReplicaStats:
        return ReplicaStats(self.iterations - earlier.iterations, self.busy_s - earlier.busy_s,
                            self.flops - earlier.flops, self.bytes - earlier.bytes,
                            self.tokens - earlier.tokens,
                            self.budget_fill_sum - earlier.budget_fill_sum,
                            self.embed_tokens - earlier.embed_tokens,
                            self.gen_tokens - earlier.gen_tokens,
                            self.decode_runs - earlier.decode_runs)


# decode steps priced at once in a run of identical iterations: the first segment is short (an
# arrival cuts most runs within a few steps), and each next one twice as long, up to the cap
FIRST_RUN_SEGMENT, MAX_RUN_SEGMENT = 8, 256


def _delay_to(now: float, target: float) -> float:
    """The delay that lands SimPy's clock (``now + delay``) exactly on ``target``, so a run of
    iterations ends at the very float that stepping them one by one reaches."""
    delay = target - now
    if now + delay == target:  # the usual case
        return delay
    while now + delay < target:
        delay = math.nextafter(delay, math.inf)
    while now + delay > target:
        delay = math.nextafter(delay, -math.inf)
    return delay


class Replica:
    """One replica's SimPy process. Its hot path reads the clock as ``env._now`` (SimPy's
    ``now`` is a property over it: a Python call per read, ~150,000 reads in a 10,000-request
    run), as it already reaches into ``Process`` to move a wait (``_cut_run``)."""

    def __init__(self, env: simpy.Environment, index: int, role: str, policy: Policy, cost,
                 on_leave: Callable[[Request, Replica], None], fast_forward: bool = True,
                 factors=None, front_end: bool = True) -> None:
        self.env = env
        self.index = index
        self.role = role
        self.policy = policy
        self.cost = cost
        self.on_leave = on_leave
        self.fast_forward = fast_forward
        self.stats = ReplicaStats()
        self.adapter = getattr(cost, "lora", None) is not None
        self.merged = False  # the embedding adapter merged into the weights (merge_adapter)
        self._merge_s = 0.0  # a merge or unmerge to run before the next iteration
        self._wake: simpy.Event | None = None  # what an idle replica waits on: work
        self._arrived = False  # work arrived during the decode run in flight
        self._segment = False  # waiting out a decode run's segment: an arrival cuts it
        self._cut_steps = 0  # the steps of the segment that ran when an arrival cut it
        self._stepping = False  # an iteration (or decode run) is in flight
        self._inbox: list[Request] = []  # arrived while it was: they enter when it ends
        self._run: tuple | None = None  # a decode run in flight: shape, start, ends
        # the iteration (or run) in flight: start, end, its shape and steps (work priced lazily)
        self._in_flight: tuple[float, float, BatchShape, int] | None = None
        self.outstanding_work = 0  # tokens routed here and not finished (least-work router)
        self._work: dict[str, int] = {}
        # seconds a request spends in the server before the scheduler sees it, one at a time
        # (``CostFactors``' per-request overheads: they occupy the server, not the device).
        # With factors, every request passes the front end, even at 0 s: a fit moves the
        # overheads from 0 without the simulation changing its path there
        # (``front_end`` False: the cluster's shared front end takes them instead)
        # (a split's embedding GPU is a stock embedding server: its role read at each request,
        # as a re-planning split's GPU changes it)
        self._factors = factors
        self._front = FrontEnd(env, lambda kind: factors.overhead_s(kind, self.role == "embedding"),
                               self._admit) \
            if factors is not None and front_end and role != "decode" else None
        self._padding = self._stock_padding()
        if fast_forward and policy.decode_runs:
            policy.use_cohort()
        # a role change asked for (``change_role``): what to become once drained
        self._next_role: tuple[str, Policy, object, float, Callable[[Replica], None]] | None = None
        self.process = env.process(self.run())

    def change_role(self, role: str, policy: Policy, cost, pause_s: float,
                    ready: Callable[[Replica], None]) -> None:
        """Become a ``role`` replica running ``policy`` on ``cost``: once the requests here
        have drained (the router sends no new one), serve nothing for ``pause_s`` (the new
        server starting), then take the new role and call ``ready``."""
        self._next_role = (role, policy, cost, pause_s, ready)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _drained(self) -> bool:
        front = self._front
        return not self._work and not self._inbox and (front is None or not front.inside)

    def _become(self):
        role, policy, cost, pause_s, ready = self._next_role
        self._next_role = None
        if pause_s:
            yield Timeout(self.env, pause_s)
        self.role, self.policy, self.cost = role, policy, cost
        self.adapter = getattr(cost, "lora", None) is not None
        self.merged = False
        self._padding = self._stock_padding()
        if self.fast_forward and policy.decode_runs:
            policy.use_cohort()
        ready(self)

    def _stock_padding(self) -> float:
        """A stock embedding server prices its batches padded to their longest input (a
        share of the padding): a split's embedding GPU only."""
        if self._factors is None or self.role != "embedding":
            return 0.0
        return self._factors.stock_embedding_padding

    def merge_adapter(self, merged: bool) -> None:
        """Run embeddings with the adapter merged into the weights (as a dedicated embedding
        server does: no LoRA rows), or take it out again; each change costs a pass over the
        weights it targets, run before the next iteration. A router asks for it on a replica
        it sends only embeddings; a generation arriving unmerges it first."""
        if merged == self.merged or getattr(self.cost, "lora", None) is None:
            return
        self.merged = merged
        self.adapter = not merged
        self._merge_s += self.cost.adapter_merge_s()

    def submit(self, request: Request) -> None:
        if self._front is not None:
            self._front.submit(request)
            return
        self._admit(request)

    def _admit(self, request: Request) -> None:
        if self.merged and not request.is_embedding:
            self.merge_adapter(False)
        work = request.remaining_work(True)
        self._work[request.request_id] = work
        self.outstanding_work += work
        if self._stepping:
            self._inbox.append(request)
        else:
            self._enter(request)
        self._arrived = True
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        elif self._segment:
            self._segment = False
            self._cut_run()

    def _cut_run(self) -> None:
        """Work arrived during a decode run's segment: the run ends with the iteration in
        flight, so the replica's wait moves from the segment's end to that iteration's end.
        This is what SimPy's ``Process.interrupt`` does to the waiting process (unhook it from
        the event it waits on) without its two extra events (the interruption, and the timeout
        the interrupted process would then start): one event per arrival instead of three."""
        ends = self._run[2]
        k = bisect_right(ends, self.env._now)  # the step in flight (one that ends now is done)
        if k == len(ends):
            return  # the segment's end is now: the wait ends with it
        self._cut_steps = k + 1
        process = self.process
        process._target.callbacks.remove(process._resume)
        wake = Timeout(self.env, _delay_to(self.env._now, ends[k]))
        wake.callbacks.append(process._resume)
        process._target = wake

    def _enter(self, request: Request) -> None:
        """Hand ``request`` to the policy now (it becomes ready now)."""
        if not self.policy.add(request, self.env._now):
            self.outstanding_work -= self._work.pop(request.request_id, 0)
            self.on_leave(request, self)

    def _take_inbox(self) -> None:
        """Between iterations: the requests that arrived during the last one enter, in the
        order they arrived."""
        inbox, self._inbox = self._inbox, []
        for request in inbox:
            self._enter(request)

    def _leave(self, requests: list[Request]) -> None:
        for req in requests:
            self.outstanding_work -= self._work.pop(req.request_id, 0)
            self.on_leave(req, self)

    def progress(self) -> ReplicaStats:
        """The counters so far as stepping has them: of a decode run in flight, the iterations
        that ended before now count whole and the one in flight pro rata (its busy time, FLOPs
        and bytes), as a single iteration in flight does. What monitors and windows read."""
        out = self.stats.copy()
        if self._in_flight is None:
            return out
        start, end, shape, steps = self._in_flight
        now = self.env.now
        out.busy_s += now - start
        done, step_start, step_end = 0, start, end
        if self._run is not None:
            ends = self._run[2]
            done = min(bisect_left(ends, now), steps)  # the steps that ended before now
            step_start = ends[done - 1] if done else start
            step_end = ends[done] if done < steps else step_start
        cost = self.cost
        flops, bytes_ = cost.shape_work(shape, done) if done else (0.0, 0.0)
        if done < steps and step_end > step_start:
            frac = min(1.0, (now - step_start) / (step_end - step_start))
            f_next, b_next = cost.shape_work(shape, done + 1)
            flops += frac * (f_next - flops)
            bytes_ += frac * (b_next - bytes_)
        out.flops += flops
        out.bytes += bytes_
        if done:
            self._count_steps(out, shape, done)
        return out

    def _account(self, shape: BatchShape, steps: int, seconds: float, flops: float,
                 bytes_: float) -> None:
        self._in_flight = None
        s = self.stats
        s.busy_s += seconds
        s.flops += flops
        s.bytes += bytes_
        self._count_steps(s, shape, steps)

    def _count_steps(self, s: ReplicaStats, shape: BatchShape, steps: int) -> None:
        s.iterations += steps
        s.tokens += shape.tokens * steps
        s.budget_fill_sum += steps * shape.tokens / self.policy.config.token_budget
        s.embed_tokens += shape.pooled_rows * steps
        s.gen_tokens += (shape.tokens - shape.pooled_rows) * steps

    def run(self):
        env, policy, cost = self.env, self.policy, self.cost
        while True:
            self._stepping = False
            if self._inbox:
                self._take_inbox()
            now = env._now
            batch = policy.schedule(now)
            if not (batch.items or batch.cohort_decodes):  # ``not batch``, without the call
                if self._next_role is not None and self._drained():
                    yield from self._become()
                    policy, cost = self.policy, self.cost
                    continue
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            self._stepping = True
            shape = BatchShape.from_batch(batch, self.adapter)
            steps = decode_run_length(policy, batch) if self.fast_forward and not self._merge_s \
                else 0
            if steps > 1:
                yield from self._decode_run(shape, steps)
                continue
            seconds = cost.shape_time(self._padded(shape, batch) if self._padding else shape)
            if self._merge_s:
                seconds, self._merge_s = seconds + self._merge_s, 0.0
            flops, bytes_ = cost.shape_work(shape)
            self._in_flight = (now, now + seconds, shape, 1)
            yield Timeout(env, seconds)
            self._account(shape, 1, seconds, flops, bytes_)
            self._leave(policy.complete(batch, env._now))

    def _padded(self, shape: BatchShape, batch) -> BatchShape:
        """The batch's shape with its inputs padded to the longest (a stock embedding server's
        batch: whole inputs)."""
        longest = max(it.start + it.num_tokens for it in batch.items)
        return padded(shape, longest, self._padding)

    def _cohort_shape(self) -> BatchShape:
        """The shape of an iteration of the decode cohort alone."""
        cohort = self.policy._cohort
        shape = BatchShape()
        shape.add_decodes(len(cohort), cohort.decode_kv())
        return shape

    def _decode_run(self, shape: BatchShape, steps: int):
        """Wait out a run of ``steps`` decode iterations (``engine.decode_run``), or fewer when
        work arrives, and apply them; members that finish at its end leave then, and while
        nothing waits the run goes on without them (``run_on_after_finish``).

        Each phase of the run prices and waits out up to ``steps`` identical decode iterations,
        fewer when work arrives (the iteration in flight then ends the run). Step times are
        priced a segment at a time (``FIRST_RUN_SEGMENT`` steps, doubling): an arrival usually
        cuts a run long before its end, and pricing steps that never run was most of the cost
        of an open-loop simulation. Each step is priced on its own, so the segments change
        nothing in the result. (One generator for the whole run: a phase is waited out in
        this frame, not a nested one.)
        """
        self.stats.decode_runs += 1
        self._arrived = False
        env, policy, step_times = self.env, self.policy, self.cost.decode_step_times
        while True:
            start = t = env._now
            ends: list[float] = []
            self._run = (shape, start, ends)
            kv0 = shape.decode_kv
            segment = FIRST_RUN_SEGMENT
            priced = 0  # len(ends)
            while priced < steps:
                n = steps - priced
                if n > segment:
                    n = segment
                segment = 2 * segment if 2 * segment < MAX_RUN_SEGMENT else MAX_RUN_SEGMENT
                shape.decode_kv = kv0 + shape.decodes * priced
                times = accumulate(step_times(shape, n), initial=t)
                next(times)  # t itself: the step ends follow, summed in order as stepping sums them
                ends.extend(times)
                priced += n
                t = ends[-1]
                shape.decode_kv = kv0
                self._in_flight = (start, t, shape, priced)
                # the segment's end, or the end of the step in flight when work arrives first
                # (``_admit`` moves the wait there: ``_cut_run``)
                self._segment = True
                yield Timeout(env, _delay_to(env._now, t))
                self._segment = False
                if env._now < t or self._arrived:
                    break  # work arrived: the iteration in flight ended, reschedule
            done, self._cut_steps = self._cut_steps, 0  # the steps up to the one in flight
            if not done:  # when work arrived; else the phase ran out
                done = priced
                if env._now < ends[-1]:  # the clock could not land on the segment's end (rounding)
                    done = bisect_right(ends, env._now) + 1
                    if ends[done - 1] > env._now:
                        yield Timeout(env, _delay_to(env._now, ends[done - 1]))
            self._account_phase(done)
            left = complete_decode_run(policy, env._now, start,
                                       ends if done == priced else ends[:done])
            self._leave(left)
            if done < steps or not left or self._arrived:
                return  # work arrived (or a leaving request sent more), or the KV cache is full
            steps = run_on(policy)
            if steps < 1:
                return
            shape = self._cohort_shape()

    def _account_phase(self, done: int) -> None:
        """Count the first ``done`` iterations of the run in flight."""
        shape, start, ends = self._run
        self._run = None
        flops, bytes_ = self.cost.shape_work(shape, done)
        self._account(shape, done, ends[done - 1] - start, flops, bytes_)

    def snapshot(self):
        """The policy's snapshot now; during a decode run, with the KV blocks of the iteration
        in flight (stepping grows them when each iteration is scheduled)."""
        if self._run is not None:
            _, _, ends = self._run
            cohort = self.policy._cohort
            cohort.set_blocks(cohort.steps + bisect_right(ends, self.env.now))
        return self.policy.snapshot()

    def flush(self) -> None:
        """At the end of a simulation: apply to the requests the iterations of a decode run
        that ended before now, as stepping one at a time would have (an iteration ending
        exactly now is not; ``progress`` counts them, and the one in flight), and write the
        decode cohort's progress into its requests."""
        if self._run is not None:
            _, start, ends = self._run
            done = bisect_left(ends, self.env.now)
            if done:
                self._leave(complete_decode_run(self.policy, ends[done - 1], start, ends[:done]))
        if self.policy._cohort is not None:
            self.policy._cohort.sync()
