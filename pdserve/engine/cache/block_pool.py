"""The block pool: which block ids are free, which are in use, how many holders each has, and
which freed blocks still hold reusable content (the prefix cache, E12, E13).

A block is one page per layer; its id indexes the page axis of every layer's K and V pool.
Block ids 0..num_padding_blocks-1 are reserved: requests never get them, and attention kernels
point padded block-table entries at them.

Every usable block is in exactly one of three states:

- empty: never used, or demoted; no content worth keeping. Handed out first, oldest first.
- used: held by one or more requests (reference count >= 1).
- cached: nobody holds it, but it keeps its content and its hash, so a later request with the
  same prefix can take it back (`acquire`). It is still allocatable: when the empty list cannot
  cover an allocation, the most recently freed cached block is demoted (hash dropped) and handed
  out (lazy eviction, E13). Requests free their tables head first, so a request's tail is demoted
  before its head, and a chain of hashes stays usable from its start.

`num_free_blocks` counts what an allocation can take (empty + cached); the books balance as
empty + used + cached == usable, checked by `check_integrity`.

The pool knows nothing of requests; `KVCacheManager` keeps the per-request tables.
`allocate` returns None for "not now" (not enough free blocks) and raises for invalid input.

Threading: owned by the engine thread.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable

from pdserve.engine.cache.block_hash import BlockHash

logger = logging.getLogger(__name__)


class CacheIntegrityError(RuntimeError):
    """The pool's books do not balance (a leak or a double free)."""


class BlockPool:
    def __init__(self, num_blocks: int, num_padding_blocks: int = 1) -> None:
        if num_blocks <= num_padding_blocks:
            raise ValueError(f"num_blocks={num_blocks} must exceed num_padding_blocks={num_padding_blocks}")
        self.num_blocks = num_blocks
        self.num_padding_blocks = num_padding_blocks
        self._empty: deque[int] = deque(range(num_padding_blocks, num_blocks))
        # Freed blocks with a hash, oldest free first; the last one is demoted first.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._ref_counts: list[int] = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0  # cached blocks demoted to empty (monotonic)

    # --- counts -------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - self.num_padding_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: empty ones plus cached ones (demoted on demand)."""
        return len(self._empty) + len(self._cached)

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks without reusable content (never used, or demoted)."""
        return len(self._empty)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that keep their content and hash for the prefix cache."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._cached

    # --- allocation ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """Take n free blocks, or None if fewer are free (nothing taken then).

        Empty blocks go first (lowest ids first from a fresh pool); when they run out, cached
        blocks are demoted, most recently freed first.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > self.num_free_blocks:
            return None
        out = [self._empty.popleft() for _ in range(min(n, len(self._empty)))]
        while len(out) < n:
            b, _ = self._cached.popitem(last=True)
            self._drop_hash(b)
            self.num_evictions += 1
            out.append(b)
        for b in out:
            self._ref_counts[b] = 1
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block, in the order given.

        A block nobody holds any more joins the cached list if it has a hash (content kept), else
        the back of the empty list, so recently used ids are reused last.
        """
        for b in block_ids:
            self._check_usable(b)
            if self._ref_counts[b] <= 0:
                raise CacheIntegrityError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if self._hash_of[b] is not None:
                    self._cached[b] = None
                else:
                    self._empty.append(b)

    # --- the prefix cache ---------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block that holds content with this hash (used or cached), if any."""
        return self._block_of.get(block_hash)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block (a prefix-cache hit); cached blocks become used again."""
        for b in block_ids:
            self._check_usable(b)
            if self._hash_of[b] is None:
                raise CacheIntegrityError(f"block {b} has no hash: only cached content can be shared")
            if self._ref_counts[b] == 0:
                del self._cached[b]
            self._ref_counts[b] += 1

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that a used block's content is complete and has this hash.

        Returns False (and records nothing) when another block already holds that content, or
        when this block already has a hash: the first copy stays the one lookups find.
        """
        self._check_usable(block_id)
        if self._ref_counts[block_id] <= 0:
            raise CacheIntegrityError(f"block {block_id} is free: only a used block can be registered")
        if self._hash_of[block_id] is not None or block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def _drop_hash(self, block_id: int) -> None:
        h = self._hash_of[block_id]
        if h is not None:
            del self._block_of[h]
            self._hash_of[block_id] = None

    def _check_usable(self, b: int) -> None:
        if b < self.num_padding_blocks or b >= self.num_blocks:
            raise ValueError(f"block id {b} is not a usable block (pool has {self.num_blocks}, "
                             f"{self.num_padding_blocks} reserved)")

    # --- invariants ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """empty + used + cached == usable; free lists hold exactly the unreferenced blocks;
        the hash map and the per-block hashes agree."""
        empty, cached = set(self._empty), set(self._cached)
        if len(empty) != len(self._empty):
            raise CacheIntegrityError(f"empty list has duplicates: {len(self._empty)} entries, {len(empty)} unique")
        if empty & cached:
            raise CacheIntegrityError(f"blocks both empty and cached: {sorted(empty & cached)[:10]}")
        used = sum(1 for b in range(self.num_padding_blocks, self.num_blocks) if self._ref_counts[b] > 0)
        if len(empty) + used + len(cached) != self.num_usable_blocks:
            raise CacheIntegrityError(
                f"empty ({len(empty)}) + used ({used}) + cached ({len(cached)}) != total ({self.num_usable_blocks})"
            )
        for b in empty | cached:
            if self._ref_counts[b] != 0:
                raise CacheIntegrityError(f"block {b} is on a free list with ref count {self._ref_counts[b]}")
        for b in empty:
            if self._hash_of[b] is not None:
                raise CacheIntegrityError(f"empty block {b} still has a hash")
        for b in cached:
            if self._hash_of[b] is None:
                raise CacheIntegrityError(f"cached block {b} has no hash")
        for h, b in self._block_of.items():
            if self._hash_of[b] != h:
                raise CacheIntegrityError(f"hash map points at block {b}, which holds another hash")
        hashed = sum(1 for h in self._hash_of if h is not None)
        if hashed != len(self._block_of):
            raise CacheIntegrityError(f"{hashed} blocks have a hash but the hash map has {len(self._block_of)}")
