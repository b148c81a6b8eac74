"""Requests: what a client asked for, how far it has got, and when each step happened.

A request is a sequence of tokens. Its first ``input_len`` tokens are the prompt (or the text to
embed); a generation request then grows by one sampled token per step. ``num_computed`` counts the
tokens whose keys/values are in the KV cache, so the next item of work always starts at
``num_computed`` and the tokens still to compute are ``seq_len - num_computed``. A decode is the
case where exactly one token (the last sampled one) is left.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

POOLING_HEADS = ("mean", "weighted-mean", "cls", "last", "buffer")


class RequestKind(enum.Enum):
    EMBEDDING = "embedding"
    GENERATION = "generation"

    # dict keys on the hot path (queues, routers): the identity hash, in C, not Enum's in
    # Python (equality is identity for members all the same)
    __hash__ = object.__hash__


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"

    __hash__ = object.__hash__  # as RequestKind's

    def __init__(self, value: str) -> None:
        # a plain attribute, read on every scheduling step (a property costs ~20x more)
        self.is_final = value in ("finished", "aborted", "rejected")


_GENERATION = RequestKind.GENERATION
# Members as module constants for the scheduling steps: a global read is several times
# cheaper than an enum class's attribute
WAITING, RUNNING, FINISHED = RequestState.WAITING, RequestState.RUNNING, RequestState.FINISHED
REJECTED = RequestState.REJECTED

# Legal state changes; anything else is a scheduler bug and raises.
_TRANSITIONS = {
    RequestState.WAITING: {RequestState.RUNNING, RequestState.ABORTED, RequestState.REJECTED},
    RequestState.RUNNING: {
        RequestState.WAITING,  # preempted (recompute) or handed to another replica
        RequestState.FINISHED,
        RequestState.ABORTED,
    },
    RequestState.FINISHED: set(),
    RequestState.ABORTED: set(),
    RequestState.REJECTED: set(),
}


def _output_left(expected: int, generated: int) -> int:
    """Expected decodes not yet run: the first token comes with the prompt's last chunk."""
    left = expected - (generated if generated > 1 else 1)
    return left if left > 0 else 0


def _kind_of(rid: str, kind: Any) -> RequestKind:
    """A request kind given as its name ('embedding', 'generation'); anything else is refused."""
    if isinstance(kind, RequestKind):
        return kind
    if isinstance(kind, str):
        try:
            return RequestKind(kind)
        except ValueError:
            pass
    raise ValueError(f"request {rid}: kind must be 'embedding' or 'generation', got {kind!r}")


def _count(rid: str, name: str, value: Any, minimum: int, what: str = "") -> int:
    """``value`` as a plain int >= ``minimum``; a bool, a float or a string is refused by name."""
    if type(value) is int and value >= minimum:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"request {rid}: {name} must be {bound}{' ' + what if what else ''}, "
                         f"got {value!r}")
    return int(value)


@dataclass(eq=False, slots=True)
class Request:
    """One embedding or generation request and its progress.

    ``max_output_tokens`` is the generation cap (0 for embeddings); ``expected_output_tokens``
    is what a scheduler may assume when it counts a waiting request's work (defaults to the cap).
    """

    request_id: str
    kind: RequestKind
    arrival_time: float
    input_len: int
    max_output_tokens: int = 0
    token_ids: list[int] | None = None
    pooling: str = "mean"
    normalize: bool = False
    adapter: str | None = None
    expected_output_tokens: int | None = None
    payload: Any = None  # free slot for an executor (sampling params, futures, ...)

    state: RequestState = field(default=RequestState.WAITING, init=False)
    num_computed: int = field(default=0, init=False)
    num_generated: int = field(default=0, init=False)
    chunks_done: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)
    reject_reason: str | None = field(default=None, init=False)
    ready_since: float = field(default=0.0, init=False)
    order: tuple[float, int] = field(default=(0.0, 0), init=False)  # FCFS key: arrival, then add
    admitted_at: float | None = field(default=None, init=False)
    first_chunk_at: float | None = field(default=None, init=False)
    first_token_at: float | None = field(default=None, init=False)
    finished_at: float | None = field(default=None, init=False)
    # ``kind is EMBEDDING``, kept as a field (read several times per request per step): derived
    # from ``kind`` at construction, so ``kind`` is not to be reassigned
    is_embedding: bool = field(default=False, init=False)
    # this decode's ticket in its replica's slack account (``DecodeSlack.began``; 0: none)
    slack_ticket: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        kind = self.kind
        if type(kind) is not RequestKind:
            kind = self.kind = _kind_of(rid, kind)
        arrival = self.arrival_time
        if type(arrival) is not float and (isinstance(arrival, bool)
                                           or not isinstance(arrival, numbers.Real)) \
                or not 0 <= arrival < math.inf:  # a NaN fails the comparison too
            raise ValueError(
                f"request {rid}: arrival_time must be a finite number >= 0, got {arrival!r}")
        arrival = self.arrival_time = float(arrival)
        self.ready_since = arrival
        n_in = self.input_len
        if type(n_in) is not int or n_in < 1:
            n_in = self.input_len = _count(rid, "input_len", n_in, minimum=1)
        if self.token_ids is not None and n_in != len(self.token_ids):
            raise ValueError(
                f"request {rid}: input_len={n_in} but {len(self.token_ids)} token_ids were given")
        if kind is _GENERATION:
            n_out = self.max_output_tokens
            if type(n_out) is not int or n_out < 1:
                n_out = self.max_output_tokens = _count(rid, "max_output_tokens", n_out,
                                                        minimum=1, what="for a generation request")
        else:
            self.is_embedding = True
            n_out = self.max_output_tokens
            if n_out != 0:
                raise ValueError(
                    f"request {rid}: max_output_tokens must be 0 for an embedding "
                    f"request, got {n_out!r}"
                )
            if self.pooling not in POOLING_HEADS:
                raise ValueError(
                    f"request {rid}: unknown pooling head {self.pooling!r}; "
                    f"known heads: {', '.join(POOLING_HEADS)}"
                )
        if self.expected_output_tokens is None:
            self.expected_output_tokens = n_out
        else:
            self.expected_output_tokens = _count(rid, "expected_output_tokens",
                                                 self.expected_output_tokens, minimum=0)

    # ----- derived progress -------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens in the sequence so far: the input plus every sampled token."""
        return self.input_len + self.num_generated

    @property
    def num_uncomputed(self) -> int:
        """Tokens not yet in the KV cache (1 for a decode)."""
        return self.input_len + self.num_generated - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_generated > 0 and self.num_uncomputed == 1

    def remaining_work(self, count_output: bool) -> int:
        """Tokens still to process: uncomputed tokens, plus expected decodes if asked."""
        work = self.input_len + self.num_generated - self.num_computed
        if count_output and not self.is_embedding:
            work += _output_left(self.expected_output_tokens, self.num_generated)
        return work

    def waiting_work(self, count_output: bool) -> int:
        """What this request weighs in IBS while it waits for prompt work (``we``/``wg``).

        An embedding weighs its uncomputed input. A generation request weighs its uncomputed
        tokens, but never more than its prompt: after a preemption it weighs what it weighed on
        arrival, not the recompute of the tokens it already generated (docs/scheduler.md).
        ``count_output`` adds the expected output not yet generated.
        """
        uncomputed = self.input_len + self.num_generated - self.num_computed
        if self.is_embedding:
            return uncomputed
        work = uncomputed if uncomputed < self.input_len else self.input_len
        if count_output:
            work += _output_left(self.expected_output_tokens, self.num_generated)
        return work

    # ----- state machine ------------------------------------------------------------------
    def transition(self, new: RequestState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(
                f"request {self.request_id}: illegal state change {self.state.value} -> {new.value}"
            )
        self.state = new

    def reject(self, reason: str) -> None:
        self.transition(RequestState.REJECTED)
        self.reject_reason = reason

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the cache; generated tokens are kept and re-prefilled."""
        self.num_computed = 0
        self.chunks_done = 0
        self.slack_ticket = 0
        self.num_preemptions += 1
