"""The block pool: which block ids are free, which are in use, and how many holders each has.

A block is one page per layer; its id indexes the page axis of every layer's K and V pool.
Block ids 0..num_padding_blocks-1 are reserved: requests never get them, and attention kernels
point padded block-table entries at them.

The pool knows nothing of requests; `KVCacheManager` keeps the per-request tables.
`allocate` returns None for "not now" (not enough free blocks) and raises for invalid input.
"""

from __future__ import annotations

import logging
from collections import deque

logger = logging.getLogger(__name__)


class CacheIntegrityError(RuntimeError):
    """The pool's books do not balance (a leak or a double free)."""


class BlockPool:
    def __init__(self, num_blocks: int, num_padding_blocks: int = 1) -> None:
        if num_blocks <= num_padding_blocks:
            raise ValueError(f"num_blocks={num_blocks} must exceed num_padding_blocks={num_padding_blocks}")
        self.num_blocks = num_blocks
        self.num_padding_blocks = num_padding_blocks
        self._free: deque[int] = deque(range(num_padding_blocks, num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self.num_padding_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """Take n free blocks (lowest ids first from a fresh pool), or None if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref_counts[b] = 1
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder of each block; blocks nobody holds go back to the free list.

        Freed blocks join the back of the list, so recently used ids are reused last.
        """
        for b in block_ids:
            if b < self.num_padding_blocks or b >= self.num_blocks:
                raise ValueError(f"block id {b} is not a usable block (pool has {self.num_blocks}, "
                                 f"{self.num_padding_blocks} reserved)")
            if self._ref_counts[b] <= 0:
                raise CacheIntegrityError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        """free + used == total, and the free list holds exactly the blocks nobody references."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise CacheIntegrityError(f"free list has duplicates: {len(self._free)} entries, {len(free_set)} unique")
        referenced = sum(1 for b in range(self.num_padding_blocks, self.num_blocks) if self._ref_counts[b] > 0)
        if referenced + len(free_set) != self.num_usable_blocks:
            raise CacheIntegrityError(
                f"free ({len(free_set)}) + used ({referenced}) != total ({self.num_usable_blocks})"
            )
        for b in free_set:
            if self._ref_counts[b] != 0:
                raise CacheIntegrityError(f"block {b} is on the free list with ref count {self._ref_counts[b]}")
