"""The KV cache tensors: one contiguous buffer, viewed per layer in HND layout (E7).

buffer: [num_layers, 2, num_pages, kv_heads, page_size, head_dim]   (2 = K, V)
Per layer, K and V pools are [num_pages, kv_heads, page_size, head_dim]: a page is contiguous, a
tensor-parallel shard of a page (a range of kv heads) is contiguous, and consecutive page ids are
adjacent in memory, so a run of pages is one contiguous byte range (D13). One buffer means one
memory registration for the fabric.

Allocation: by default a CPU pool is a fresh anonymous mapping on transparent huge pages
(pdserve.engine.cache.hostmem, standard library only): decode attention reads it faster than
4 KiB pages (fewer TLB misses, commit 5a48399), and the fabric registers the same memory (shm
transfers are faster from and to huge pages: bench/results/fabric/fabric.md).
Seam: `PagedKVCache(..., allocate=fn)` takes the buffer from `fn(dims, dtype)` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.cache.hostmem import alloc_tensor

# allocate(dims, dtype) -> a contiguous CPU tensor of exactly `dims` and `dtype`, zero-filled (or
# at least finite: slots beyond a sequence's length are read under a mask), that stays where it is
# for its lifetime (it is registered with the fabric by address).
KVAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_pages: int
    kv_heads: int
    page_size: int
    head_dim: int

    @property
    def page_nbytes_per_elem(self) -> int:
        return self.kv_heads * self.page_size * self.head_dim

    def block_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one block: one K and one V page in every layer."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.page_nbytes_per_elem * elem


class PagedKVCache:
    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device | str = "cpu",
                 allocate: KVAllocator | None = None, prefault: bool = False) -> None:
        self.shape = shape
        self.dtype = dtype
        dims = (shape.num_layers, 2, shape.num_pages, shape.kv_heads, shape.page_size, shape.head_dim)
        # buffer: [layers, 2, pages, kv_heads, page_size, head_dim]
        if allocate is None:
            self.buffer = _default_allocate(dims, dtype, torch.device(device), populate=prefault)
        else:
            self.buffer = allocate(dims, dtype)
            _check_buffer(self.buffer, dims, dtype, torch.device(device), allocate)
            if prefault and self.buffer.device.type == "cpu":
                _touch_pages(self.buffer)
        # k[l], v[l]: [pages, kv_heads, page_size, head_dim]
        self.k = [self.buffer[layer, 0] for layer in range(shape.num_layers)]
        self.v = [self.buffer[layer, 1] for layer in range(shape.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page (one layer, K or V)."""
        return self.shape.page_nbytes_per_elem * self.buffer.element_size()

    def page_offset(self, layer: int, kv: int, page: int) -> int:
        """Byte offset of page `page` of layer `layer` (kv: 0 = K, 1 = V) inside the buffer."""
        s = self.shape
        return ((layer * 2 + kv) * s.num_pages + page) * self.page_nbytes


def _touch_pages(buf: torch.Tensor) -> None:
    """Fault in every 4 KiB page of a CPU buffer by rewriting one byte of each with its own value
    (a custom allocator's memory: its content is left as it was)."""
    flat = buf.view(-1).view(torch.uint8)                                 # [nbytes]
    flat[:: 4096].add_(0)


def _default_allocate(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      populate: bool = False) -> torch.Tensor:
    """The default allocator. On the CPU: a fresh anonymous mapping, 2 MiB aligned and advised
    onto transparent huge pages (pdserve.engine.cache.hostmem; the fabric registers this memory),
    so it reads as zeros and nothing is committed before it is written.

    Decode attention streams every sequence's pages from DRAM; on 4 KiB pages each 4 KiB costs a
    TLB entry, so the same kernel runs faster on 2 MiB pages (30 layers of batch-32 decode
    pools, commit 5a48399). Shared-memory fabric transfers from and to huge pages are faster too
    (bench/results/fabric/fabric.md). Where the kernel has no THP the pool stays on normal pages (logged once).
    A fresh mapping rather than torch.empty + madvise: torch's allocator may hand back heap memory
    that is already faulted in on small pages, which madvise does not convert.
    """
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    return alloc_tensor(dims, dtype, huge_pages=True, populate=populate)  # the tensor keeps its mapping alive


def _check_buffer(buf: object, dims: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  allocate: KVAllocator) -> None:
    """A custom allocator's tensor must be exactly what the cache views and registers."""
    name = getattr(allocate, "__qualname__", type(allocate).__name__)
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"KV allocator {name} returned {type(buf).__name__}, expected a torch.Tensor")
    if tuple(buf.shape) != dims or buf.dtype != dtype:
        raise ValueError(f"KV allocator {name} returned a tensor of shape {tuple(buf.shape)} and dtype {buf.dtype}; "
                         f"the pool needs shape {dims} ([layers, 2, pages, kv_heads, page_size, head_dim]) "
                         f"and dtype {dtype}")
    if buf.device != device:
        raise ValueError(f"KV allocator {name} returned a tensor on {buf.device}; the pool lives on {device}")
    if not buf.is_contiguous():
        raise ValueError(f"KV allocator {name} returned a non-contiguous tensor (strides {buf.stride()}); "
                         f"the pool must be one contiguous buffer (one fabric registration, D13)")
