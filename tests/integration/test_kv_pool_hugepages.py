"""Every CPU KV pool sits on huge pages: the engine's default allocator (pdserve.engine.cache.kv_cache).

The pool is a fresh anonymous mapping, 2 MiB aligned, and where the kernel has transparent huge
pages (always or madvise) the kernel backs it with huge pages once it is written (AnonHugePages in
/proc/self/smaps for the pool's range; nothing is committed before). That holds for prefill nodes,
decode nodes (whose pools the fabric registers) and colocated decode nodes alike. A custom
allocator (PagedKVCache(allocate=...)) that returns the wrong tensor is refused by name.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.tiny_models import make_tiny_checkpoint

from pdserve.engine.cache.hostmem import (
    HUGE_PAGE_BYTES,
    alloc_tensor,
    anon_huge_bytes,
    resident_bytes,
    thp_mode,
)
from pdserve.engine.cache.kv_cache import KVCacheShape, PagedKVCache
from pdserve.engine.config import EngineConfig

MiB = 1 << 20
NUM_BLOCKS = 2048  # tiny llama: 2 layers x K/V x 2 kv heads x 16 tokens x 16 dims x 4 bytes = 8 KiB a block


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama") / "tiny"))


def _config(model: str) -> EngineConfig:
    return EngineConfig.from_options(model=model, num_blocks=NUM_BLOCKS, num_threads=1, max_batch_tokens=64)


def check_pool_on_huge_pages(buf: torch.Tensor) -> None:
    # buffer: [layers, 2, pages, kv_heads, page_size, head_dim]
    assert buf.is_contiguous() and buf.dtype == torch.float32
    assert int(buf.abs().sum()) == 0, "a fresh pool reads as zeros (its slots must be finite)"
    mode = thp_mode()
    if mode in ("never", "unavailable"):
        pytest.skip(f"transparent huge pages are {mode} on this kernel: the pool falls back to normal pages")
    start = buf.data_ptr()
    nbytes = buf.numel() * buf.element_size()
    assert start % HUGE_PAGE_BYTES == 0, f"KV pool at 0x{start:x} is not 2 MiB aligned"
    buf.fill_(0.0)  # first touch: the kernel backs the range now (nothing was committed before)
    huge = anon_huge_bytes(start, start + nbytes)
    # the kernel may refuse a huge page under memory pressure; most of the pool is backed here
    assert huge >= nbytes // 2, f"only {huge} of the pool's {nbytes} bytes are on huge pages (THP {mode})"


def test_prefill_node_pool_is_on_huge_pages(tiny_llama):
    from prefill_node.service import PrefillNode, PrefillNodeConfig

    node = PrefillNode(PrefillNodeConfig(engine=_config(tiny_llama), provider="shm"))
    try:
        kv = node.engine.engine.kv_cache
        assert kv.nbytes == NUM_BLOCKS * 8 * 1024 >= 8 * MiB
        check_pool_on_huge_pages(kv.buffer)
    finally:
        node.close_now()


def test_decode_node_pool_is_on_huge_pages_colocated_or_not(tiny_llama):
    from decode_node.service import DecodeNode, DecodeNodeConfig

    async def build(colocated: bool) -> None:
        node = DecodeNode(DecodeNodeConfig(_config(tiny_llama), "decode-test", colocated=colocated,
                                           prefill_addresses=() if colocated else ("127.0.0.1:1",), provider="shm"))
        await node.start()
        try:
            buf = node.llm.kv_cache.buffer
            if colocated:
                assert node.transport is None and node.receiver is None
            check_pool_on_huge_pages(buf)
        finally:
            await node.close()

    asyncio.run(build(colocated=True))
    asyncio.run(build(colocated=False))


def test_cache_without_allocator_is_on_huge_pages_and_bad_allocators_are_refused():
    # 4 MiB: 2 layers x K/V x 512 pages x 2 kv heads x 16 tokens x 16 dims x 4 bytes
    default = PagedKVCache(KVCacheShape(num_layers=2, num_pages=512, kv_heads=2, page_size=16, head_dim=16),
                           torch.float32)
    assert tuple(default.buffer.shape) == (2, 2, 512, 2, 16, 16) and default.nbytes == 4 * MiB
    check_pool_on_huge_pages(default.buffer)

    shape = KVCacheShape(num_layers=2, num_pages=4, kv_heads=2, page_size=8, head_dim=16)
    dims = (2, 2, 4, 2, 8, 16)
    small = PagedKVCache(shape, torch.float32)
    assert tuple(small.buffer.shape) == dims and int(small.buffer.abs().sum()) == 0

    seen = []

    def allocate(d, dtype):
        seen.append((d, dtype))
        return torch.zeros(d, dtype=dtype)

    kv = PagedKVCache(shape, torch.bfloat16, allocate=allocate)
    assert seen == [(dims, torch.bfloat16)] and kv.buffer.dtype == torch.bfloat16
    assert kv.k[1].shape == (4, 2, 8, 16)  # k[l]: [pages, kv_heads, page_size, head_dim]

    with pytest.raises(ValueError, match=r"shape \(2, 2, 4, 2, 16, 8\).*needs shape \(2, 2, 4, 2, 8, 16\)"):
        PagedKVCache(shape, torch.float32, allocate=lambda d, dtype: torch.zeros((2, 2, 4, 2, 16, 8), dtype=dtype))
    with pytest.raises(ValueError, match=r"dtype torch.float16.*dtype torch.float32"):
        PagedKVCache(shape, torch.float32, allocate=lambda d, dtype: torch.zeros(d, dtype=torch.float16))
    with pytest.raises(ValueError, match="non-contiguous"):
        PagedKVCache(shape, torch.float32,
                     allocate=lambda d, dtype: torch.zeros(tuple(reversed(d)), dtype=dtype).permute(5, 4, 3, 2, 1, 0))
    with pytest.raises(TypeError, match="returned ndarray"):
        import numpy as np

        PagedKVCache(shape, torch.float32, allocate=lambda d, dtype: np.zeros(d, dtype=np.float32))


def test_kv_prefault_faults_the_whole_pool_in_at_startup():
    from pdserve.engine.config import CacheConfig

    shape = KVCacheShape(num_layers=2, num_pages=512, kv_heads=2, page_size=16, head_dim=16)  # 4 MiB
    lazy = PagedKVCache(shape, torch.float32)
    start = lazy.buffer.data_ptr()
    assert resident_bytes(start, start + lazy.nbytes) < lazy.nbytes  # untouched anonymous memory
    eager = PagedKVCache(shape, torch.float32, prefault=True)
    start = eager.buffer.data_ptr()
    assert resident_bytes(start, start + eager.nbytes) >= eager.nbytes
    assert int(eager.buffer.abs().sum()) == 0

    # a custom allocator's buffer is faulted in too, its content kept
    custom = alloc_tensor(tuple((2, 2, 512, 2, 16, 16)), torch.float32, huge_pages=False)
    custom.view(-1)[::977] = 3.0
    before = custom.clone()
    start = custom.data_ptr()
    kv = PagedKVCache(shape, torch.float32, allocate=lambda d, dtype: custom, prefault=True)
    assert kv.buffer is custom and torch.equal(custom, before)
    assert resident_bytes(start, start + kv.nbytes) >= kv.nbytes

    assert CacheConfig(kv_prefault=True).kv_prefault
    with pytest.raises(ValueError, match="kv_prefault must be True or False, got 1"):
        CacheConfig(kv_prefault=1)
