"""Prefix cache (E12): complete blocks are named by the chained hash of their tokens
(`block_hash.BlockHash`, `hash_block`: equal hashes mean equal prefixes up to and including that
block), and this module turns those names into reuse.

`PrefixCache` turns a request's tokens into hits on the block pool (lookup) and publishes a
request's complete blocks once their KV is valid (register). It never writes into a block: a hit
covers whole blocks before the request's last target token, so the request's first computed
position starts a block of its own, and the last prompt token (whose logits are needed) is always
computed.

`BlockHash` and `hash_block` moved to the leaf `pdserve.engine.cache.block_hash` (issue 30); they
stay importable from here for old importers (deprecated: import them from block_hash).

Threading: owned by the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.cache.block_hash import BlockHash, hash_block
from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.request import Request

__all__ = ["NO_HIT", "BlockHash", "PrefixCache", "PrefixHit", "hash_block", "request_block_hashes"]


def request_block_hashes(request: Request, num_blocks: int, page_size: int) -> list[BlockHash]:
    """The hashes of the request's first num_blocks complete blocks (kept on the request, extended
    on demand: its tokens only ever grow)."""
    if num_blocks * page_size > request.num_tokens:
        raise ValueError(f"{request!r} has {request.num_tokens} tokens: fewer than {num_blocks} blocks of {page_size}")
    hashes = request.block_hashes
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, request.token_slice(i * page_size, (i + 1) * page_size)))
    return hashes[:num_blocks]


@dataclass(frozen=True)
class PrefixHit:
    """Blocks whose KV a request can reuse, in table order: positions [0, num_tokens)."""

    block_ids: tuple[int, ...]
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


NO_HIT = PrefixHit(block_ids=(), num_tokens=0)


class PrefixCache:
    """Lookups and registrations over one block pool; counts queried and hit tokens."""

    def __init__(self, pool: BlockPool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self.num_queried_tokens = 0  # tokens looked up (monotonic)
        self.num_hit_tokens = 0      # of those, tokens whose KV was reused (monotonic)

    def lookup(self, request: Request) -> PrefixHit:
        """The longest run of cached blocks from the start of the request's tokens.

        Only blocks that end before the request's last target token qualify: that token must be
        computed (its logits or hidden state are the point of the pass). Takes nothing: the
        caller acquires the blocks when it admits the request.
        """
        P = self.page_size
        limit = (request.target_computed_tokens - 1) // P
        ids: list[int] = []
        for h in request_block_hashes(request, limit, P):
            b = self.pool.lookup(h)
            if b is None:
                break
            ids.append(b)
        return PrefixHit(block_ids=tuple(ids), num_tokens=len(ids) * P)

    def record(self, request: Request, hit: PrefixHit) -> None:
        """Count one admitted lookup (the hit rate is over admitted requests' target tokens)."""
        self.num_queried_tokens += request.target_computed_tokens
        self.num_hit_tokens += hit.num_tokens

    def register(self, request: Request, table: list[int], num_registered: int) -> int:
        """Publish the request's blocks that are complete and computed, from index num_registered
        on; returns the new number of blocks considered (pass it back next time)."""
        P = self.page_size
        done = min(request.num_computed_tokens // P, len(table))
        if done <= num_registered:
            return num_registered
        hashes = request_block_hashes(request, done, P)
        for i in range(num_registered, done):
            self.pool.register(table[i], hashes[i])
        return done
