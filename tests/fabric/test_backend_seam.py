"""TransferBackend is the seam a second transport implements (issue 32: UCX), typed once: a batch of
page writes is one PageWrites value; `write` / `write_sync` take it; the deprecated positional
`write_pages` / `write_pages_sync` are shims every backend inherits. In process, no libfabric: a fake
backend that copies bytes between bytearrays stands in for a second implementation."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from fabric import FabricConfig, PageWrites, TransferEngine
from fabric.backend import TransferBackend
from fabric.descriptors import PeerDescriptor, RemoteDescriptor
from fabric.imm import ImmCounter
from fabric.memory import MemoryRegion

PEER = PeerDescriptor("fake", b"a", "e" * 32, "host", 1, 1)


class CopyBackend(TransferBackend):
    """The smallest backend: regions are bytearrays, a write copies at once and reports on_done."""

    def __init__(self) -> None:
        self.memory: dict[int, bytearray] = {}
        self.posted: list[PageWrites] = []

    @property
    def peer_descriptor(self) -> PeerDescriptor:
        return PEER

    @property
    def imm_counter(self) -> ImmCounter:
        raise NotImplementedError

    def register(self, buffer=None, *, address=None, length=None) -> MemoryRegion:
        raise NotImplementedError

    def deregister(self, region: MemoryRegion) -> None:
        raise NotImplementedError

    def connect(self, peer: PeerDescriptor) -> None:
        pass

    def disconnect(self, peer: PeerDescriptor) -> None:
        pass

    def write(self, writes: PageWrites, on_done, on_error) -> int:
        self.posted.append(writes)
        src, dst = self.memory[0], self.memory[1]
        for so, do, n in zip(writes.src_offsets, writes.dst_offsets, writes.lengths, strict=True):
            dst[do:do + n] = src[so:so + n]
        on_done()
        return len(self.posted)

    def send(self, peer: PeerDescriptor, payload: bytes) -> None:
        pass

    def wait_peer_gone(self, peer: PeerDescriptor, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


def _batch(**kw) -> PageWrites:
    fields = dict(src_region=object(), src_offsets=np.array([0, 8], dtype=np.uint64),
                  dst=RemoteDescriptor(PEER, 1, 0, 0, 16), dst_offsets=[8, 0], lengths=[4, 4], imm=7)
    return PageWrites(**(fields | kw))


def _fields(w: PageWrites) -> tuple:
    """The fields by identity (the offsets are arrays: PageWrites compares by identity)."""
    return tuple(id(getattr(w, f.name)) if f.name.endswith(("offsets", "lengths")) else getattr(w, f.name)
                 for f in dataclasses.fields(w))


def test_page_writes_is_one_frozen_value():
    w = _batch()
    assert w.imm_mode is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.imm = 8
    assert [f.name for f in dataclasses.fields(PageWrites)] == [
        "src_region", "src_offsets", "dst", "dst_offsets", "lengths", "imm", "imm_mode"]


def test_a_second_backend_implements_write_and_gets_the_rest():
    be = CopyBackend()
    be.memory = {0: bytearray(b"abcdefghijklmnop"), 1: bytearray(16)}
    done = []
    be.write(_batch(), lambda: done.append(1), pytest.fail)
    assert done == [1] and bytes(be.memory[1][:12]) == b"ijkl\x00\x00\x00\x00abcd"
    res = be.write_sync(_batch(lengths=[1, 1]))
    assert res.writes == 2 and res.slept
    # the deprecated positional forms are shims over write / write_sync, with the same fields
    w = be.posted[0]
    be.write_pages(w.src_region, w.src_offsets, w.dst, w.dst_offsets, w.lengths, w.imm, lambda: done.append(2),
                   pytest.fail, imm_mode="every")
    assert _fields(be.posted[-1]) == _fields(w)[:-1] + ("every",)
    be.write_pages_sync(w.src_region, w.src_offsets, w.dst, w.dst_offsets, w.lengths, w.imm, timeout=5)
    assert _fields(be.posted[-1]) == _fields(w)


def test_the_libfabric_engine_implements_the_seam():
    assert issubclass(TransferEngine, TransferBackend)
    abstract = TransferBackend.__abstractmethods__
    assert {"write", "register", "connect", "send", "close"} <= abstract
    assert not abstract - set(vars(TransferEngine)), abstract - set(vars(TransferEngine))
    # write / write_sync take the one typed value (write_sync adds the engine's own spin budget)
    assert list(inspect.signature(TransferEngine.write).parameters) == ["self", "writes", "on_done", "on_error"]
    assert list(inspect.signature(TransferEngine.write_sync).parameters) == ["self", "writes", "timeout", "spin_us"]
    assert "write_pages" not in vars(TransferEngine)    # inherited shim only
    assert FabricConfig().imm_mode in ("last", "every")
