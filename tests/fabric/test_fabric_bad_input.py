"""Bad input is refused with a clear error before anything is posted."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fabric_peer import PeerProcess
from support.wait import wait_until

from fabric import FabricConfig, FabricError, ImmCounter, PageWrites, TransferEngine, open_backend
from fabric.errors import fi_strerror
from pdserve.engine.cache.hostmem import alloc_buffer

FENCE_TAG = 6

MiB = 1 << 20


def _never(*args: object) -> None:
    raise AssertionError(f"callback ran for a refused batch: {args}")


@pytest.fixture
def pair(backend: str):
    config = FabricConfig(provider=backend, node="127.0.0.1")
    a = open_backend(config)
    b = open_backend(config)
    src = a.register(alloc_buffer(MiB, huge_pages=False).view)
    dst = b.register(alloc_buffer(MiB, huge_pages=False).view)
    yield a, b, src, dst
    a.close()
    b.close()


def _assert_nothing_posted(a, b, src, dst) -> None:
    """Fence: a good write with another tag, posted after the refused ones, lands; anything the
    refused calls had posted on the same connection would have landed before it."""
    assert a.outstanding() == 0
    a.write_sync(PageWrites(src, [0], dst.descriptor, [0], [4096], FENCE_TAG))
    wait_until(lambda: b.imm_counter.landed(FENCE_TAG) == 1, 10, "the fence write to land")
    assert b.imm_counter.landed(5) == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "src_offs, dst_offs, lens, match",
    [
        ([MiB - 4096], [0], [8192], r"src_offsets\[0\]=1044480 \+ lengths\[0\]=8192 = 1052672 exceeds source"),
        ([0, 0], [0, MiB], [4096, 4096], r"dst_offsets\[1\]=1048576 \+ lengths\[1\]=4096 .* exceeds destination"),
        ([0], [-4096], [4096], r"dst_offsets\[0\]=-4096"),
        ([0], [0], [0], r"lengths\[0\]=0"),
        ([0, 4096], [0], [4096, 4096], r"src_offsets=2, dst_offsets=1, lengths=2"),
        ([], [], [], r"empty batch"),
        ([0.5], [0], [4096], r"src_offsets: expected integers"),
        ([2**64 - 1], [0], [4096], r"src_offsets\[0\]=18446744073709551615"),
    ],
)
def test_out_of_range_offsets_name_the_values(pair, src_offs, dst_offs, lens, match) -> None:
    a, b, src, dst = pair
    with pytest.raises(ValueError, match=match):
        a.write(PageWrites(src, src_offs, dst.descriptor, dst_offs, lens, 5), _never, _never)
    _assert_nothing_posted(a, b, src, dst)


@pytest.mark.timeout(30)
def test_bad_imm_and_mode(pair) -> None:
    a, b, src, dst = pair
    # the tag is 24 bits: the low 8 bits of the immediate data are its unit count
    with pytest.raises(ValueError, match=r"imm=16777216: expected None or an int in 0..16777215"):
        a.write(PageWrites(src, [0], dst.descriptor, [0], [4096], 2**24), _never, _never)
    with pytest.raises(ValueError, match=r"imm_mode='sometimes'"):
        a.write(PageWrites(src, [0], dst.descriptor, [0], [4096], 5, imm_mode="sometimes"), _never, _never)
    _assert_nothing_posted(a, b, src, dst)


@pytest.mark.timeout(30)
def test_unregistered_memory_is_refused(pair) -> None:
    a, b, src, dst = pair
    with pytest.raises(TypeError, match="expected a MemoryRegion, got bytearray"):
        a.write(PageWrites(bytearray(4096), [0], dst.descriptor, [0], [4096], 5), _never, _never)
    # a region of another engine is not registered with this one
    with pytest.raises(FabricError, match="belongs to engine") as info:
        a.write(PageWrites(dst, [0], dst.descriptor, [0], [4096], 5), _never, _never)
    assert fi_strerror(info.value.code) in str(info.value)
    # a deregistered region
    extra = a.register(alloc_buffer(MiB).view)
    a.deregister(extra)
    with pytest.raises(FabricError, match="deregistered"):
        a.write(PageWrites(extra, [0], dst.descriptor, [0], [4096], 5), _never, _never)
    _assert_nothing_posted(a, b, src, dst)


@pytest.mark.timeout(30)
def test_stale_descriptors_in_process(pair, backend: str) -> None:
    a, b, src, dst = pair
    other = b.register(alloc_buffer(MiB).view)
    stale_region = other.descriptor
    b.deregister(other)
    with pytest.raises(FabricError, match="region .* was deregistered") as info:
        a.write(PageWrites(src, [0], stale_region, [0], [4096], 5), _never, _never)
    assert info.value.code == 2  # FI_ENOENT
    c = open_backend(FabricConfig(provider=backend, node="127.0.0.1"))
    gone = c.register(alloc_buffer(MiB).view).descriptor
    c.close()
    with pytest.raises(FabricError, match="engine .* is closed"):
        a.write(PageWrites(src, [0], gone, [0], [4096], 5), _never, _never)
    _assert_nothing_posted(a, b, src, dst)


@pytest.mark.timeout(60)
def test_stale_descriptors_from_another_process(backend: str) -> None:
    """The owner tells the peers it knows: deregistered regions and closed engines."""
    config = FabricConfig(provider=backend, node="127.0.0.1")
    engine = open_backend(config)
    peer = PeerProcess.start(config, MiB)
    try:
        src = engine.register(alloc_buffer(MiB).view)
        done = threading.Event()
        engine.write(PageWrites(src, [0], peer.descriptor, [0], [4096], 5), done.set, _never)
        assert done.wait(10)
        peer.call("deregister")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                engine.write(PageWrites(src, [0], peer.descriptor, [0], [4096], 6), lambda: None, lambda e: None)
            except FabricError as exc:
                assert "was deregistered" in str(exc)
                break
            time.sleep(0.02)
        else:
            pytest.fail("descriptor of a deregistered remote region still accepted after 5 s")
        peer.call("close_engine")
        with pytest.raises(FabricError, match="is closed"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                engine.send(peer.peer, b"anyone there?")
                time.sleep(0.02)
    finally:
        engine.close()
        peer.stop()


@pytest.mark.timeout(60)
def test_stale_descriptor_refused_by_a_writer_that_connects_later(backend: str) -> None:
    """The owner never knew this writer when it deregistered; the handshake tells it.

    On shm nothing at the target would stop the write (no key check: process_vm_writev into the
    old addresses), so the refusal before posting is the protection.
    """
    config = FabricConfig(provider=backend, node="127.0.0.1")
    owner = PeerProcess.start(config, MiB)
    engine = open_backend(config)
    try:
        stale = owner.descriptor  # obtained before the deregistration, never used yet
        owner.call("deregister")
        src = engine.register(alloc_buffer(MiB).view)
        with pytest.raises(FabricError, match="was deregistered") as info:
            engine.write(PageWrites(src, [0], stale, [0], [4096], 5), _never, _never)
        assert info.value.code == 2  # FI_ENOENT
        assert engine.outstanding() == 0
    finally:
        engine.close()
        owner.stop()


@pytest.mark.timeout(30)
def test_config_validation_names_values() -> None:
    with pytest.raises(ValueError, match=r"imm_mode='first'"):
        FabricConfig(imm_mode="first")
    with pytest.raises(ValueError, match=r"locality='moon'"):
        FabricConfig(locality="moon")
    with pytest.raises(ValueError, match=r"tx_depth=-1"):
        FabricConfig(tx_depth=-1)
    with pytest.raises(ValueError, match=r"peer_timeout_s=-2"):
        FabricConfig(peer_timeout_s=-2)
    with pytest.raises(ValueError, match=r"busy_spin_us=-1"):
        FabricConfig(busy_spin_us=-1)
    with pytest.raises(ValueError, match=r"delivery_complete='yes'"):
        FabricConfig(delivery_complete="yes")
    # default: delivery-complete where it is free (shm, RDMA), not on tcp
    assert FabricConfig().wants_delivery_complete("shm") and FabricConfig().wants_delivery_complete("efa")
    assert not FabricConfig().wants_delivery_complete("tcp;ofi_rxm")
    assert FabricConfig(delivery_complete=True).wants_delivery_complete("tcp;ofi_rxm")
    with pytest.raises(FabricError, match="opening provider 'no-such-provider'") as info:
        TransferEngine(FabricConfig(provider="no-such-provider"))
    assert info.value.code == 61  # FI_ENODATA from fi_getinfo


@pytest.mark.timeout(30)
def test_register_checks_buffers(backend: str) -> None:
    with open_backend(FabricConfig(provider=backend, node="127.0.0.1")) as engine:
        with pytest.raises(ValueError, match="read-only"):
            engine.register(b"immutable bytes")
        with pytest.raises(ValueError, match="not contiguous"):
            engine.register(np.zeros((64, 64), dtype=np.uint8)[:, ::2])
        with pytest.raises(ValueError, match="length=0"):
            engine.register(address=0x1000, length=0)
        arr = np.zeros(1 << 16, dtype=np.uint8)  # by (address, length), as for torch storage
        region = engine.register(address=arr.ctypes.data, length=arr.nbytes)
        assert region.length == arr.nbytes
        engine.deregister(region)


def test_imm_counter_rules() -> None:
    counter = ImmCounter()
    fired: list[int] = []
    counter.on_landed(9, 2)  # before expect: kept
    counter.expect(9, 3, fired.append)
    assert fired == []
    counter.on_landed(9, 1)
    assert fired == [9]
    counter.on_landed(9, 1)  # after completion: unclaimed, not a second fire
    assert fired == [9] and counter.landed(9) == 1
    counter.expect(7, 2, fired.append)
    counter.on_landed(7, 1)
    assert counter.cancel(7) == 1
    counter.on_landed(7, 5)
    assert counter.dropped == 5 and counter.landed(7) == 0
    with pytest.raises(ValueError, match="tag=16777216"):
        counter.expect(2**24, 1, fired.append)
    with pytest.raises(ValueError, match="count=0 for tag 1"):
        counter.expect(1, 0, fired.append)
    counter.expect(1, 1, fired.append)
    with pytest.raises(ValueError, match="tag 1 is already expected"):
        counter.expect(1, 1, fired.append)
