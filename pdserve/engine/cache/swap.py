"""The CPU swap pool (E15): where offloaded requests' KV waits until it fits in the pool again.

One preallocated buffer laid out like the device cache, with slots instead of pages:

    buffer: [num_layers, 2, num_slots, kv_heads, page_size, head_dim]   (pinned when the cache is
                                                                          on a GPU)

`offload` moves the KV of several requests out in one batched copy (one gather over the block
axis, one scatter into the slots) and frees their blocks; `restore` gives one request new blocks
laid out like its old tables and copies its KV back, so nothing is recomputed. Requests that do
not fit in the free slots are returned to the caller, which soft-resets them (E14).

A pool indexed by the same block ids (a draft model's, E20: pdserve/engine/spec_decode) can be
`attach`ed: it gets a host buffer with the same slots, and every offload and restore moves its
pages with the cache's, so the draft's KV of a restored request is not recomputed either. The
swap budget (CacheConfig.cpu_offload_space) sizes the cache's buffer; an attached pool's buffer
is on top of it (logged: a draft's pool is a fraction of the target's).

Threading: owned by the engine thread.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from pdserve.engine.cache.block_pool import CacheIntegrityError
from pdserve.engine.cache.kv_cache import PagedKVCache
from pdserve.engine.cache.manager import KVCacheManager, RequestTables
from pdserve.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadedKV:
    """One offloaded request: its tables as they were, and the slot of each real block."""

    layout: RequestTables
    slots: tuple[int, ...]  # slots[i] holds layout.real_blocks[i]


class SwapSpace:
    def __init__(self, kv_cache: PagedKVCache, cache: KVCacheManager, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"the swap pool needs num_slots >= 0, got {num_slots}")
        self.kv = kv_cache
        self.cache = cache
        self.num_slots = num_slots
        s = kv_cache.shape
        device = kv_cache.buffer.device
        # buffer: [layers, 2, slots, kv_heads, page_size, head_dim]; every slot is written before
        # it is read, so it is never zeroed (a large CPU buffer stays uncommitted until used).
        self.buffer = torch.empty(
            (s.num_layers, 2, num_slots, s.kv_heads, s.page_size, s.head_dim),
            dtype=kv_cache.dtype,
            pin_memory=device.type == "cuda",
        )
        self._free: deque[int] = deque(range(num_slots))
        self._held: dict[str, OffloadedKV] = {}
        # (device pool, host buffer) of each attached pool; the cache's own first
        self._pools: list[tuple[torch.Tensor, torch.Tensor]] = [(kv_cache.buffer, self.buffer)]

    def attach(self, kv_cache: PagedKVCache) -> None:
        """Move `kv_cache`'s pages (indexed by this cache's block ids) with every offload and restore."""
        s, mine = kv_cache.shape, self.kv.shape
        if (s.num_pages, s.page_size) != (mine.num_pages, mine.page_size):
            raise ValueError(f"an attached pool must have the cache's {mine.num_pages} pages of {mine.page_size} "
                             f"tokens, not {s.num_pages} of {s.page_size}")
        if self._held:
            raise ValueError(f"attach a pool before any offload ({len(self._held)} requests are offloaded)")
        device = kv_cache.buffer.device
        # host: [layers, 2, slots, kv_heads, page_size, head_dim] of the attached pool
        host = torch.empty((s.num_layers, 2, self.num_slots, s.kv_heads, s.page_size, s.head_dim),
                           dtype=kv_cache.dtype, pin_memory=device.type == "cuda")
        self._pools.append((kv_cache.buffer, host))
        logger.info("swap pool: an attached pool of %d layers moves with the cache (%.2f GiB more host memory)",
                    s.num_layers, host.numel() * host.element_size() / 2**30)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_offloaded(self) -> int:
        return len(self._held)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._held[request_id].slots)

    def offload(self, requests: list[Request]) -> list[Request]:
        """Copy the KV of each request (in the order given) that fits into free slots and free
        its blocks; returns the requests that did not fit (their blocks untouched)."""
        moved: list[tuple[Request, RequestTables]] = []
        src: list[int] = []
        unfit: list[Request] = []
        free = len(self._free)
        for r in requests:
            if r.request_id in self._held:
                raise ValueError(f"{r!r} is already offloaded")
            layout = self.cache.export_tables(r.request_id)
            blocks = layout.real_blocks
            if len(blocks) > free:
                unfit.append(r)
                continue
            free -= len(blocks)
            moved.append((r, layout))
            src.extend(blocks)
        if not moved:
            return unfit
        slots = [self._free.popleft() for _ in range(len(src))]
        for buf, host in self._pools:   # buf: [layers, 2, pages, kv_heads, page_size, head_dim]
            # One gather of every moved block on the pool's device, one copy to the host (blocking:
            # the blocks are handed out again right after), one scatter into the slots.
            # pages: [layers, 2, len(src), kv_heads, page_size, head_dim]
            pages = buf.index_select(2, torch.tensor(src, dtype=torch.int64, device=buf.device))
            host.index_copy_(2, torch.tensor(slots, dtype=torch.int64), pages.to("cpu"))
        i = 0
        for r, layout in moved:
            n = len(layout.real_blocks)
            self._held[r.request_id] = OffloadedKV(layout=layout, slots=tuple(slots[i : i + n]))
            i += n
            self.cache.free(r)
            r.num_offloads += 1
        logger.info("offloaded %d requests (%d blocks) to the swap pool; %d slots free",
                    len(moved), len(src), len(self._free))
        return unfit

    def restore(self, request: Request) -> bool:
        """Give an offloaded request new blocks and copy its KV back; False (nothing changed)
        when the pool cannot supply them."""
        held = self._held.get(request.request_id)
        if held is None:
            raise KeyError(f"request {request.request_id!r} is not offloaded")
        pairs = self.cache.install_tables(request, held.layout)
        if pairs is None:
            return False
        for buf, host in self._pools:
            dst = torch.tensor([new for _, new in pairs], dtype=torch.int64, device=buf.device)
            # data: [layers, 2, len(slots), kv_heads, page_size, head_dim]
            data = host.index_select(2, torch.tensor(held.slots, dtype=torch.int64))
            buf.index_copy_(2, dst, data.to(buf.device))
        self._free.extend(held.slots)
        del self._held[request.request_id]
        return True

    def drop(self, request_id: str) -> int:
        """Forget an offloaded request (it finished or was aborted while offloaded); returns the
        slots freed (0 if it held none)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return 0
        self._free.extend(held.slots)
        return len(held.slots)

    def check_integrity(self) -> None:
        held = sum(len(h.slots) for h in self._held.values())
        if held + len(self._free) != self.num_slots:
            raise CacheIntegrityError(
                f"swap pool: free ({len(self._free)}) + held ({held}) != total ({self.num_slots}) "
                f"({len(self._held)} requests offloaded)"
            )
