"""Incremental pooling (brief §2.2): fold each chunk's hidden states into O(d) state.

Works on numpy arrays and torch tensors alike without importing torch: it only uses ``.sum``,
``*``, ``+`` and ``/``, and finds the array's own module (numpy or torch, already imported by
whoever made the array) for the two constructors it needs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from orthrus_sim.engine.request import POOLING_HEADS

Array = Any


def _xp(x: Array):
    """The array library ``x`` belongs to (numpy or torch)."""
    return sys.modules[type(x).__module__.split(".")[0]]


def _as_float(x: Array) -> Array:
    """Accumulate in at least fp32 (bf16/fp16 hidden states would lose the sum)."""
    if hasattr(x, "float") and callable(x.float):  # torch
        return x.float() if x.dtype.is_floating_point and x.element_size() < 4 else x
    if x.dtype.kind == "f" and x.dtype.itemsize >= 4:
        return x
    return x.astype("float32")


def _own(x: Array) -> Array:
    """A copy of ``x`` that shares no memory with the caller's array: the caller may reuse its
    buffer, and a torch view would keep the whole batch's hidden states alive."""
    return x.clone() if hasattr(x, "clone") else x.copy()


def _positions(x: Array, start: int, n: int) -> Array:
    """Column vector ``start+1 .. start+n`` in ``x``'s library, dtype and device."""
    xp = _xp(x)
    if hasattr(x, "device") and hasattr(xp, "arange") and hasattr(x, "new_tensor"):
        col = xp.arange(start + 1, start + n + 1, dtype=x.dtype, device=x.device)
    else:
        col = xp.arange(start + 1, start + n + 1, dtype=x.dtype)
    return col.reshape(n, 1)


def _concat(chunks: list[Array]) -> Array:
    xp = _xp(chunks[0])
    return xp.cat(chunks, 0) if hasattr(xp, "cat") else xp.concatenate(chunks, 0)


def l2_normalize(v: Array, eps: float = 1e-12) -> Array:
    """``v / |v|`` computed in at least fp32 (an fp16 square overflows past 256); a zero vector
    stays zero."""
    v = _as_float(v)
    norm = float((v * v).sum()) ** 0.5
    return v / max(norm, eps)


class IncrementalPooler:
    """Pooling state of one embedding request.

    ``update(hidden)`` takes the (c_k x d) hidden states of the next chunk, in order;
    ``result()`` gives the embedding once the last chunk is in. ``head='buffer'`` keeps every
    chunk and applies ``fn`` to the full (L x d) matrix at the end (O(n*d) memory).
    """

    def __init__(
        self,
        head: str = "mean",
        normalize: bool = False,
        fn: Callable[[Array], Array] | None = None,
    ) -> None:
        if head not in POOLING_HEADS:
            raise ValueError(f"pooling: unknown head {head!r}; known heads: {', '.join(POOLING_HEADS)}")
        if head == "buffer" and fn is None:
            raise ValueError("pooling: head 'buffer' needs a function to apply after the last chunk")
        self.head = head
        self.normalize = normalize
        self.fn = fn
        self.num_tokens = 0
        self._sum: Array | None = None
        self._weight = 0.0
        self._kept: Array | None = None
        self._chunks: list[Array] = []

    def reset(self) -> None:
        """Forget everything (the request was preempted and will be recomputed)."""
        self.__init__(self.head, self.normalize, self.fn)

    def update(self, hidden: Array) -> None:
        n = hidden.shape[0]
        if n == 0:
            return
        head = self.head
        if head == "mean":
            part = _as_float(hidden).sum(0)
            self._weight += n
        elif head == "weighted-mean":
            h = _as_float(hidden)
            part = (h * _positions(h, self.num_tokens, n)).sum(0)
            o = self.num_tokens
            self._weight += n * o + n * (n + 1) / 2
        elif head == "cls":
            if self.num_tokens == 0:
                self._kept = _own(hidden[0])
            part = None
        elif head == "last":
            self._kept = _own(hidden[n - 1])
            part = None
        else:
            self._chunks.append(_own(hidden))
            part = None
        if part is not None:
            self._sum = part if self._sum is None else self._sum + part
        self.num_tokens += n

    def result(self) -> Array:
        if self.num_tokens == 0:
            raise ValueError("pooling: no hidden states were given")
        if self.head in ("mean", "weighted-mean"):
            out = self._sum / self._weight
        elif self.head in ("cls", "last"):
            out = self._kept
        else:
            out = self.fn(_concat(self._chunks))
        return l2_normalize(out) if self.normalize else out


def pool(hidden: Array, head: str = "mean", normalize: bool = False,
         fn: Callable[[Array], Array] | None = None, chunk_size: int | None = None) -> Array:
    """Pool a whole (L x d) matrix, in one pass or in chunks of ``chunk_size`` rows."""
    pooler = IncrementalPooler(head, normalize, fn)
    step = chunk_size or hidden.shape[0]
    for lo in range(0, hidden.shape[0], step):
        pooler.update(hidden[lo:lo + step])
    return pooler.result()
