"""The KV cache tensors: one contiguous buffer, viewed per layer in HND layout (E7).

buffer: [num_layers, 2, num_pages, kv_heads, page_size, head_dim]   (2 = K, V)
Per layer, K and V pools are [num_pages, kv_heads, page_size, head_dim]: a page is contiguous, a
tensor-parallel shard of a page (a range of kv heads) is contiguous, and consecutive page ids are
adjacent in memory, so a run of pages is one contiguous byte range (D13). One buffer means one
memory registration for the fabric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        self.dtype = dtype
        dims = (shape.num_layers, 2, shape.num_pages, shape.kv_heads, shape.page_size, shape.head_dim)
        nbytes = torch.empty((), dtype=dtype).element_size()
        for d in dims:
            nbytes *= d
        # buffer: [layers, 2, pages, kv_heads, page_size, head_dim]
        # Slots beyond a sequence's length are read under a mask, so they must hold finite values.
        # Small pools are zeroed; a large one comes straight from mmap (zero pages the kernel
        # hands out on first touch), so zeroing it would only commit gigabytes up front.
        if nbytes <= _ZERO_FILL_LIMIT or torch.device(device).type != "cpu":
            self.buffer = torch.zeros(dims, dtype=dtype, device=device)
        else:
            self.buffer = torch.empty(dims, dtype=dtype, device=device)
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
