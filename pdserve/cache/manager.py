"""Per-request block tables on top of the block pool (the full-attention allocator).

The scheduler asks `allocate_slots(request, n)` before it schedules n more tokens of a request;
the manager grows the request's table so that positions [0, num_computed + n) have pages.
None means "not now" (pool too full); nothing is allocated in that case (E10).
"""

from __future__ import annotations

from pdserve.cache.block_pool import BlockPool, CacheIntegrityError
from pdserve.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._tables: dict[str, list[int]] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks the request needs to hold num_computed + num_new_tokens positions."""
        have = len(self._tables.get(request.request_id, ()))
        return max(0, self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - have)

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's table for num_new_tokens more tokens; return the new block ids or None."""
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens} for {request!r}")
        need = self.blocks_needed(request, num_new_tokens)
        new = self.pool.allocate(need)
        if new is None:
            return None
        self._tables.setdefault(request.request_id, []).extend(new)
        return new

    # Attention groups: layers of one kind share one block table per request. A full-attention
    # model has the one group "full"; a hybrid model (issue 4) adds "sliding", whose tables keep
    # logical indexing (entry i covers positions [i*P, (i+1)*P)) with recycled entries pointing
    # at the padding block.
    group_names: tuple[str, ...] = ("full",)

    def block_table(self, request_id: str, group: str = "full") -> list[int]:
        if group not in self.group_names:
            raise KeyError(f"unknown attention group {group!r}; this cache has {self.group_names}")
        return self._tables.get(request_id, [])

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def free(self, request: Request) -> int:
        """Release every block the request holds; returns how many."""
        blocks = self._tables.pop(request.request_id, [])
        # Free in reverse so that the tail blocks (least likely to be shared later) are reused last.
        self.pool.free(list(reversed(blocks)))
        return len(blocks)

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held = sum(len(t) for t in self._tables.values())
        if held != self.pool.num_used_blocks:
            raise CacheIntegrityError(
                f"block tables hold {held} blocks but the pool has {self.pool.num_used_blocks} in use "
                f"({len(self._tables)} requests)"
            )
