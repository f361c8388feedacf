"""The paged KV cache: block pool (ids, reference counts), per-request block tables, tensors."""

from pdserve.cache.block_pool import BlockPool, CacheIntegrityError
from pdserve.cache.kv_cache import PagedKVCache
from pdserve.cache.manager import KVCacheManager

__all__ = ["BlockPool", "CacheIntegrityError", "KVCacheManager", "PagedKVCache"]
