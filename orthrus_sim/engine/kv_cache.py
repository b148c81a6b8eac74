"""Paged KV-cache accounting: which blocks each request holds.

Block ids are real (a free list), so the PyTorch engine indexes its cache tensors with the very
tables this class keeps, and the simulator gets the same admission and preemption behaviour.
``virtual``: blocks the simulator's decode cohort holds without table entries yet
(``engine/cohort.py``); they count as used, and ``grow`` leaves them alone. Real executors
never set it.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: lowest ids are handed out first, which keeps traces readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.virtual = 0

    @property
    def num_free(self) -> int:
        return len(self._free) - self.virtual

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) + self.virtual

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def held(self, request_id: str) -> int:
        table = self.tables.get(request_id)
        return len(table) if table else 0

    def extra_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request must still get to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - self.held(request_id))

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Make the request hold enough blocks for ``num_tokens`` tokens; False if they don't fit."""
        table = self.tables.get(request_id)
        extra = -(-num_tokens // self.block_size) - (len(table) if table else 0)
        if extra <= 0:
            return True
        free = self._free
        if extra > len(free) - self.virtual:
            return False
        if table is None:
            table = self.tables[request_id] = []
        taken = free[-extra:]  # the blocks pop() would give, in that order
        taken.reverse()
        table.extend(taken)
        del free[-extra:]
        return True

    def free(self, request_id: str) -> int:
        """Return every block of the request to the pool; returns how many were freed."""
        table = self.tables.pop(request_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)
