"""How many KV blocks the pool gets (E9).

    budget = available x max_memory_percent - weights - activations
    blocks = min(budget // block_nbytes, max_useful_blocks)

`available` is measured before the weights load: the system's available memory on CPU
(MemAvailable), the device's free memory on GPU (`torch.cuda.mem_get_info`). `activations` is an
estimate of one forward pass's peak working set (`activation_bytes`). An explicit `num_blocks`
overrides all of it. The engine logs the decision once at start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.cache.groups import AttentionGroup, max_blocks_per_request
from pdserve.engine.config import CacheConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int    # including the padding blocks
    block_nbytes: int
    reason: str


@dataclass(frozen=True)
class MemoryBudget:
    """What the pool is sized from (bytes)."""

    available: int     # free memory before the weights load
    weights: int       # the model's parameters and buffers
    activations: int   # estimated peak working set of one forward pass


def available_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Memory the KV pool could take on `device`: MemAvailable on CPU (what the kernel can hand
    out without swapping), the free memory of the device on GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("/proc/meminfo has no MemAvailable line")
    raise ValueError(f"cannot measure free memory on device type {device.type!r} (cpu and cuda are supported)")


def module_nbytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def activation_bytes(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    max_batch_tokens: int,
    max_requests_per_batch: int,
    max_model_len: int,
    dtype: torch.dtype,
) -> int:
    """Peak working set of one forward pass, estimated from the shapes (one layer at a time):

    - per token: residual and normed hidden (2H), q and attention output (2 Hq D), k and v
      (2 Hkv D), o_proj and down outputs (2H), gate, up and their product (3I);
    - attention scores of one prefill chunk, float32: Hq x chunk x max_model_len (a backend that
      materializes them; fused kernels need less);
    - logits of the sampled rows, float32, twice (logits and the sampler's probabilities).
    """
    elem = torch.empty((), dtype=dtype).element_size()
    T = max_batch_tokens
    per_token = 4 * hidden_size + 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim + 3 * intermediate_size
    scores = num_heads * min(T, max_model_len) * max_model_len * 4
    logits = 2 * min(max_requests_per_batch, T) * vocab_size * 4
    return T * per_token * elem + scores + logits


def size_pool(cache: CacheConfig, block_nbytes: int, max_useful_blocks: int, budget: MemoryBudget | None) -> PoolSize:
    """Blocks from `num_blocks`, else from the memory budget, capped at what
    max_requests_per_batch sequences of max_model_len tokens could ever use."""
    if cache.num_blocks is not None:
        return PoolSize(cache.num_blocks, block_nbytes, "num_blocks set explicitly")
    if budget is None:
        raise ValueError("num_blocks is not set, so the pool needs a memory budget to be sized from")
    share = int(budget.available * cache.max_memory_percent)
    kv_bytes = share - budget.weights - budget.activations
    by_memory = max(0, kv_bytes) // block_nbytes
    if by_memory < 1:
        raise RuntimeError(
            f"not enough memory for a KV cache: {budget.available / 2**30:.2f} GiB available x "
            f"max_memory_percent={cache.max_memory_percent} = {share / 2**30:.2f} GiB, minus weights "
            f"{budget.weights / 2**30:.2f} GiB and activations {budget.activations / 2**30:.2f} GiB, "
            f"leaves less than one block of {block_nbytes} bytes; raise max_memory_percent or set num_blocks"
        )
    n = min(by_memory, max_useful_blocks) + cache.num_padding_blocks
    why = (
        f"{budget.available / 2**30:.1f} GiB available x {cache.max_memory_percent} = {share / 2**30:.2f} GiB, "
        f"minus weights {budget.weights / 2**20:.0f} MiB and activations {budget.activations / 2**20:.0f} MiB "
        f"-> {by_memory} blocks, capped at {max_useful_blocks} (max_requests_per_batch x max_model_len)"
    )
    return PoolSize(n, block_nbytes, why)


def fit_max_model_len(
    groups: tuple[AttentionGroup, ...],
    page_size: int,
    usable_blocks: int,
    max_model_len: int,
    explicit: bool,
    max_chunk: int,
) -> int:
    """max_model_len when one request of that length fits in usable_blocks; otherwise, when the
    length was not set explicitly, the longest that fits (logged); when it was, a ValueError."""
    need = max_blocks_per_request(groups, page_size, max_model_len, max_chunk)
    if need <= usable_blocks:
        return max_model_len
    if explicit:
        raise ValueError(
            f"the KV cache has {usable_blocks} usable blocks of {page_size} tokens, but one request of "
            f"max_model_len={max_model_len} tokens needs {need} blocks (attention groups "
            f"{tuple(g.name for g in groups)}); raise num_blocks or max_memory_percent, or lower max_model_len"
        )
    lo, hi = 0, max_model_len  # the longest length whose request fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if max_blocks_per_request(groups, page_size, mid, max_chunk) <= usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    if lo < 2:
        raise ValueError(f"the KV cache has {usable_blocks} usable blocks of {page_size} tokens: "
                         "too few for any request")
    logger.warning("KV cache of %d blocks holds at most %d tokens per request: max_model_len %d -> %d",
                   usable_blocks, lo, max_model_len, lo)
    return lo
