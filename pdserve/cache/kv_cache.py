"""The KV cache tensors: one contiguous buffer, viewed per layer in HND layout (E7).

buffer: [num_layers, 2, num_pages, kv_heads, page_size, head_dim]   (2 = K, V)
Per layer, K and V pools are [num_pages, kv_heads, page_size, head_dim]: a page is contiguous, a
tensor-parallel shard of a page (a range of kv heads) is contiguous, and consecutive page ids are
adjacent in memory, so a run of pages is one contiguous byte range (D13). One buffer means one
memory registration for the fabric.

Allocation seam: `PagedKVCache(..., allocate=fn)` takes the buffer from `fn(dims, dtype)` instead of
torch (the nodes pass the fabric's huge-page allocator, kv_messenger.wiring.HugePageKVAllocator, so that
the registered pool sits on 2 MiB pages: shm transfers are ~2x faster from and to huge pages). The
engine never imports the fabric; without an allocator the buffer is plain torch memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# allocate(dims, dtype) -> a contiguous CPU tensor of exactly `dims` and `dtype`, zero-filled (or
# at least finite: slots beyond a sequence's length are read under a mask), that stays where it is
# for its lifetime (it is registered with the fabric by address).
KVAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]

_ZERO_FILL_LIMIT = 256 * 1024 * 1024


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
                 allocate: KVAllocator | None = None) -> None:
        self.shape = shape
        self.dtype = dtype
        dims = (shape.num_layers, 2, shape.num_pages, shape.kv_heads, shape.page_size, shape.head_dim)
        # buffer: [layers, 2, pages, kv_heads, page_size, head_dim]
        if allocate is None:
            self.buffer = _torch_allocate(dims, dtype, torch.device(device))
        else:
            self.buffer = allocate(dims, dtype)
            _check_buffer(self.buffer, dims, dtype, torch.device(device), allocate)
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


def _torch_allocate(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The default allocator: plain torch memory.

    Slots beyond a sequence's length are read under a mask, so they must hold finite values.
    Small pools are zeroed; a large one comes straight from mmap (zero pages the kernel hands out
    on first touch), so zeroing it would only commit gigabytes up front."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    for d in dims:
        nbytes *= d
    if nbytes <= _ZERO_FILL_LIMIT or device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


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
