"""The paged KV cache: block pool (ids, reference counts, prefix hashes), per-request block
tables per attention group, the tensors, and the CPU swap pool."""

from pdserve.engine.cache.block_pool import BlockPool, CacheIntegrityError
from pdserve.engine.cache.groups import FULL, PADDING_BLOCK, AttentionGroup
from pdserve.engine.cache.kv_cache import PagedKVCache
from pdserve.engine.cache.manager import KVCacheManager, RequestTables
from pdserve.engine.cache.prefix_cache import BlockHash, PrefixHit

__all__ = [
    "FULL",
    "PADDING_BLOCK",
    "AttentionGroup",
    "BlockHash",
    "BlockPool",
    "CacheIntegrityError",
    "KVCacheManager",
    "PagedKVCache",
    "PrefixHit",
    "RequestTables",
]
