"""Per-request block tables on top of the block pool, one table per attention group (E7, E8, E10,
E12).

The scheduler asks `allocate_slots(request, n)` before it schedules n more tokens of a request;
every group's table grows (and a sliding group recycles what left its window) so that the chunk
[num_computed, num_computed + n) can run. None means "not now" (pool too full); nothing is
allocated in that case (E10). At admission, `lookup_prefix` finds the blocks of the prefix cache
the request can reuse; passing that hit to `allocate_slots` takes them (reference-counted) along
with the new ones. After a step, `commit` publishes the request's newly completed blocks.
Pages a KV transfer may still touch after their request let go of them (held requests,
quarantines) live in the `holds` component (pdserve.engine.cache.holds), counted in the balance.

Prefix caching is off when any group slides (E12): sliding blocks drop their content.

Threading: owned by the engine thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.cache.block_pool import BlockPool, CacheIntegrityError
from pdserve.engine.cache.groups import (
    FULL,
    PADDING_BLOCK,
    AttentionGroup,
    FullAttentionTables,
    GroupTables,
    GrowthPlan,
    max_blocks_per_request,
)
from pdserve.engine.cache.holds import PageHolds
from pdserve.engine.cache.prefix_cache import NO_HIT, PrefixCache, PrefixHit
from pdserve.engine.cache.sliding import SlidingWindowTables
from pdserve.engine.request import Request


@dataclass(frozen=True)
class RequestTables:
    """A request's tables, one per group in `group_names` order (padding entries included)."""

    tables: tuple[tuple[int, ...], ...]

    @property
    def real_blocks(self) -> list[int]:
        return [b for t in self.tables for b in t if b != PADDING_BLOCK]


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        page_size: int,
        groups: Sequence[AttentionGroup] = (FULL,),
        enable_prefix_caching: bool = False,
    ) -> None:
        if pool.num_padding_blocks < 1 and any(g.sliding_window is not None for g in groups):
            raise ValueError("a sliding-window group needs a padding block (num_padding_blocks >= 1)")
        names = [g.name for g in groups]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"attention groups must be distinct and non-empty, got {names}")
        self.pool = pool
        self.page_size = page_size
        self.groups: tuple[GroupTables, ...] = tuple(
            SlidingWindowTables(g, page_size) if g.sliding_window is not None else FullAttentionTables(g, page_size)
            for g in groups
        )
        self._by_name = {g.name: g for g in self.groups}
        # Attention groups: layers of one kind share one block table per request. A full-attention
        # model has ("full",); a hybrid model ("full", "sliding").
        self.group_names: tuple[str, ...] = tuple(names)
        sliding = any(g.sliding_window is not None for g in groups)
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(pool, page_size) if enable_prefix_caching and not sliding else None
        )
        self._registered: dict[str, int] = {}  # request id -> blocks already offered to the prefix cache
        # pages a transfer may still read or write that no request owns: held requests, quarantines
        self.holds = PageHolds(pool, self.groups)

    # --- sizes ---------------------------------------------------------------------------------

    def num_blocks_for(self, num_tokens: int) -> int:
        """Pages that num_tokens positions span (one group's full table)."""
        return -(-num_tokens // self.page_size)

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of num_tokens tokens ever holds, over every group."""
        return max_blocks_per_request(tuple(g.group for g in self.groups), self.page_size, num_tokens, max_chunk)

    def num_held_blocks(self, request_id: str) -> int:
        return sum(len(g.real_blocks(request_id)) for g in self.groups)

    def num_freeable_blocks(self, request: Request) -> int:
        """Blocks that become allocatable again if the request lets go of its tables (those that
        no other request shares)."""
        return sum(1 for g in self.groups for b in g.real_blocks(request.request_id) if self.pool.ref_count(b) == 1)

    # --- allocation ----------------------------------------------------------------------------

    def _plans(self, request: Request, start: int, num_new_tokens: int) -> list[GrowthPlan]:
        end = start + num_new_tokens
        return [g.plan(request.request_id, start, end, keep_all=request.prefill_only) for g in self.groups]

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Net blocks the pool must supply so that num_computed + num_new_tokens positions fit."""
        plans = self._plans(request, request.num_computed_tokens, num_new_tokens)
        return max(0, sum(p.net_blocks for p in plans))

    def lookup_prefix(self, request: Request) -> PrefixHit:
        """Cached blocks a request that holds nothing yet can start from (nothing taken)."""
        if self.prefix_cache is None or request.remote_prefill or self.has(request.request_id):
            return NO_HIT
        return self.prefix_cache.lookup(request)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> list[int] | None:
        """Grow the request's tables for num_new_tokens more tokens; return the new block ids, or
        None (nothing changed) when the pool cannot supply them.

        hit: a prefix-cache hit from `lookup_prefix` for a request that holds nothing yet; its
        blocks become the head of the full table and the new tokens start at hit.num_tokens
        (the caller then sets num_computed_tokens to it).
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens} for {request!r}")
        rid = request.request_id
        first = not self.has(rid)
        if hit.num_blocks and (not first or request.num_computed_tokens != 0):
            raise ValueError(f"a prefix hit applies only to a request that holds nothing yet: {request!r}")
        start = hit.num_tokens if hit.num_blocks else request.num_computed_tokens
        if hit.num_blocks:
            self._by_name["full"].tables[rid] = list(hit.block_ids)  # planned against, undone on failure
        plans = self._plans(request, start, num_new_tokens)
        need = sum(p.num_new for p in plans)
        recycled = sum(len(p.recycle) for p in plans)
        hits_cached = sum(1 for b in hit.block_ids if self.pool.is_cached(b))
        if need - recycled > self.pool.num_free_blocks - hits_cached:
            if hit.num_blocks:
                del self._by_name["full"].tables[rid]
            return None
        if hit.num_blocks:
            self.pool.acquire(hit.block_ids)
        if self.prefix_cache is not None and first and not request.remote_prefill:
            self.prefix_cache.record(request, hit)
        for g, plan in zip(self.groups, plans, strict=True):  # recycle first: those blocks count as free above
            self.pool.free(g.apply(rid, GrowthPlan(num_new=0, recycle=plan.recycle), []))
        new_all: list[int] = []
        for g, plan in zip(self.groups, plans, strict=True):
            new = self.pool.allocate(plan.num_new)
            if new is None:  # cannot happen: checked above with the recycled blocks counted back
                raise CacheIntegrityError(f"pool ran out mid-allocation for {request!r}: {plan}")
            g.apply(rid, GrowthPlan(num_new=plan.num_new), new)
            new_all.extend(new)
        return new_all

    def truncate(self, request: Request, num_tokens: int) -> int:
        """Free every group's trailing pages past the first `num_tokens` positions (speculative
        lookahead that was rejected or not used, E20); returns how many blocks were freed.

        Only pages allocated for positions >= num_tokens go: they hold no committed KV (commit
        publishes complete blocks below num_computed_tokens <= num_tokens) and no other request
        shares them, which is checked."""
        if num_tokens < request.num_computed_tokens:
            raise ValueError(f"truncate {request!r} to {num_tokens} tokens: below its computed tokens")
        rid = request.request_id
        keep = self.num_blocks_for(num_tokens)
        freed: list[int] = []
        for g in self.groups:
            table = g.tables.get(rid)
            if table is None or len(table) <= keep:
                continue
            tail = [b for b in table[keep:] if b != PADDING_BLOCK]
            shared = [b for b in tail if self.pool.ref_count(b) != 1]
            if shared:
                raise CacheIntegrityError(f"truncate {request!r}: lookahead blocks {shared} are shared")
            del table[keep:]
            freed.extend(tail)
        self.pool.free(freed)
        return len(freed)

    def commit(self, request: Request) -> None:
        """The request's KV is valid up to num_computed_tokens: publish its complete full-table
        blocks to the prefix cache (no-op when prefix caching is off)."""
        if self.prefix_cache is None:
            return
        rid = request.request_id
        table = self._by_name["full"].tables.get(rid)
        if table is None:
            return
        self._registered[rid] = self.prefix_cache.register(request, table, self._registered.get(rid, 0))

    # --- tables --------------------------------------------------------------------------------

    def block_table(self, request_id: str, group: str = "full") -> list[int]:
        """A request's table in `group`: a running one's, else its held pages' (holds), else []."""
        g = self._by_name.get(group)
        if g is None:
            raise KeyError(f"unknown attention group {group!r}; this cache has {self.group_names}")
        if request_id not in g.tables:
            held = self.holds.held_table(request_id, self.groups.index(g))
            if held is not None:
                return held
        return g.table(request_id)

    def has(self, request_id: str) -> bool:
        return any(request_id in g.tables for g in self.groups)

    def export_tables(self, request_id: str) -> RequestTables:
        return RequestTables(tables=tuple(tuple(g.table(request_id)) for g in self.groups))

    def install_tables(self, request: Request, layout: RequestTables) -> list[tuple[int, int]] | None:
        """Give a request that holds nothing new blocks laid out like `layout` (real entries get
        fresh blocks, padding entries stay padding); returns (old block, new block) pairs in
        `layout.real_blocks` order, or None when the pool cannot supply them."""
        rid = request.request_id
        if self.has(rid):
            raise ValueError(f"request {rid!r} already holds blocks")
        if len(layout.tables) != len(self.groups):
            raise ValueError(f"layout has {len(layout.tables)} tables but this cache has groups {self.group_names}")
        new = self.pool.allocate(len(layout.real_blocks))
        if new is None:
            return None
        pairs: list[tuple[int, int]] = []
        it = iter(new)
        for g, old in zip(self.groups, layout.tables, strict=True):
            table = []
            for b in old:
                if b == PADDING_BLOCK:
                    table.append(PADDING_BLOCK)
                else:
                    nb = next(it)
                    pairs.append((b, nb))
                    table.append(nb)
            g.replace(rid, table)
        self._registered.pop(rid, None)
        return pairs

    def hold(self, request: Request) -> int:
        """Keep a finished request's blocks out of the pool, in `holds`, until
        `holds.free_request`; returns how many it held."""
        self._registered.pop(request.request_id, None)
        return self.holds.hold_request(request.request_id)

    def quarantine(self, request: Request, hold_id: str) -> int:
        """Move a request's blocks (it keeps running without any) into quarantine `hold_id`."""
        self._registered.pop(request.request_id, None)
        return self.holds.quarantine(request.request_id, hold_id)

    def free(self, request: Request) -> int:
        """Release every block the request holds; returns how many it held."""
        rid = request.request_id
        self._registered.pop(rid, None)
        n = 0
        for g in self.groups:
            # Head first: under lazy eviction the most recently freed block is demoted first, so a
            # request's tail goes before its head and a cached prefix stays usable from its start.
            blocks = g.pop(rid)
            self.pool.free(blocks)
            n += len(blocks)
        return n

    @property
    def num_requests(self) -> int:
        return len({rid for g in self.groups for rid in g.tables})

    def check_integrity(self) -> None:
        """The pool balances, and every block's reference count equals the number of table
        entries (over all requests and groups, held requests and quarantines) that hold it."""
        self.pool.check_integrity()
        holders: Counter[int] = Counter(b for g in self.groups for t in g.tables.values() for b in t
                                        if b != PADDING_BLOCK)
        holders.update(self.holds.table_blocks())
        held = sum(holders.values())
        refs = sum(self.pool.ref_count(b) for b in range(self.pool.num_padding_blocks, self.pool.num_blocks))
        if held != refs:
            raise CacheIntegrityError(
                f"block tables hold {held} blocks but the pool has {refs} references "
                f"({self.pool.num_used_blocks} blocks in use, {self.num_requests} requests)"
            )
        for b, n in holders.items():
            if self.pool.ref_count(b) != n:
                raise CacheIntegrityError(f"block {b} is in {n} table entries but has ref count "
                                          f"{self.pool.ref_count(b)}")
