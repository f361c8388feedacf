"""Registered pools on transparent huge pages: alignment, what THP really backs, lifetimes."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from fabric import FabricConfig, TransferEngine
from pdserve.engine.cache.hostmem import HUGE_PAGE_BYTES, alloc_buffer, alloc_tensor, thp_mode

MiB = 1 << 20


def test_huge_buffer_is_aligned_and_backed_by_huge_pages() -> None:
    buf = alloc_buffer(8 * MiB + 123, populate=True)
    assert len(buf) == 8 * MiB + 123
    if thp_mode() in ("never", "unavailable"):
        assert not buf.huge_pages and "transparent huge pages" in buf.reason
        pytest.skip(f"THP is {thp_mode()} here")
    assert buf.huge_pages and buf.reason == ""
    assert buf.address % HUGE_PAGE_BYTES == 0
    # the kernel may refuse a huge page under memory pressure; most of it is backed here
    assert buf.huge_page_bytes() >= 4 * MiB, buf.huge_page_bytes()


def test_normal_pages_when_asked() -> None:
    buf = alloc_buffer(MiB, huge_pages=False)
    assert not buf.huge_pages and buf.reason == "not requested"
    assert buf.address % 4096 == 0


def test_views_share_memory_and_keep_it_alive() -> None:
    buf = alloc_buffer(2 * MiB)
    arr = buf.numpy()
    ten = buf.torch(torch.float32, (512, 1024))
    arr[:4] = [1, 2, 3, 4]
    assert bytes(buf[0:4]) == b"\x01\x02\x03\x04"
    ten[0, 1] = 2.5
    assert np.frombuffer(bytes(buf[4:8]), dtype=np.float32)[0] == 2.5
    del buf
    gc.collect()
    ten[511, 1023] = 7.0  # the mapping outlives the HostBuffer while a view holds it
    assert arr.view(np.float32)[-1] == 7.0


def test_alloc_tensor_is_zeroed_and_registrable() -> None:
    pool = alloc_tensor((4, 2, 16, 2, 8, 32), torch.bfloat16)  # a KV pool's shape
    assert pool.shape == (4, 2, 16, 2, 8, 32) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous() and int(pool.abs().sum()) == 0
    with TransferEngine(FabricConfig(provider="shm")) as engine:
        region = engine.register(address=pool.data_ptr(), length=pool.numel() * pool.element_size())
        assert region.length == pool.nbytes
        engine.deregister(region)
    assert alloc_tensor((0, 3), torch.float32).shape == (0, 3)
    with pytest.raises(ValueError, match=r"shape=\(2, -1\)"):
        alloc_tensor((2, -1), torch.float32)


def test_fabric_registers_the_view_it_is_handed() -> None:
    # fabric never allocates and knows no HostBuffer: its owner hands over the buffer's view
    buf = alloc_buffer(MiB, huge_pages=False)
    with TransferEngine(FabricConfig(provider="shm")) as engine:
        with pytest.raises(TypeError, match=r"no buffer protocol.*\.view"):
            engine.register(buf)
        region = engine.register(buf.view)
        assert (region.address, region.length) == (buf.address, MiB)
        engine.deregister(region)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="nbytes=0"):
        alloc_buffer(0)
    with pytest.raises(ValueError, match="nbytes=1.5"):
        alloc_buffer(1.5)  # type: ignore[arg-type]
