"""The paged KV cache: block pool (ids, reference counts, prefix hashes), per-request block
tables per attention group, the tensors, and the CPU swap pool."""

from pdserve.cache.block_pool import BlockPool, CacheIntegrityError
from pdserve.cache.groups import FULL, PADDING_BLOCK, AttentionGroup
from pdserve.cache.kv_cache import PagedKVCache
from pdserve.cache.manager import KVCacheManager, RequestTables
from pdserve.cache.prefix_cache import BlockHash, PrefixHit

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
