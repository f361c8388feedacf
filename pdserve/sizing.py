"""How many KV blocks the pool gets (E9)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.config import CacheConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    block_nbytes: int
    reason: str


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel says can be allocated without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def size_pool(cache: CacheConfig, block_nbytes: int, max_useful_blocks: int) -> PoolSize:
    """Blocks from `num_blocks`, else from available memory x max_memory_percent, capped at what
    max_requests_per_batch sequences of max_model_len tokens could ever use."""
    if cache.num_blocks is not None:
        return PoolSize(cache.num_blocks, block_nbytes, "num_blocks set explicitly")
    avail = available_memory_bytes()
    by_memory = int(avail * cache.max_memory_percent) // block_nbytes
    n = min(by_memory, max_useful_blocks) + cache.num_padding_blocks
    if n <= cache.num_padding_blocks + 1:
        raise RuntimeError(
            f"not enough memory for a KV cache: {avail / 2**30:.2f} GiB available x "
            f"max_memory_percent={cache.max_memory_percent} < one block of {block_nbytes} bytes"
        )
    why = (
        f"{avail / 2**30:.1f} GiB available x {cache.max_memory_percent} -> {by_memory} blocks, "
        f"capped at {max_useful_blocks} (max_requests_per_batch x max_model_len)"
    )
    return PoolSize(n, block_nbytes, why)
