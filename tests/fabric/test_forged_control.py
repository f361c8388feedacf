"""Control messages are attributed to the endpoint they come from, and endpoint names from the
network are length-checked before fi_av_insert (S9).

Evidence (tcp;ofi_rxm, whose receive completions name their source): a BYE or REVOKE that a third
engine forges in the name of another, from an address the receiver does not know or from its own
known address, is dropped and counted, the named engine stays reachable and writable, and its own
BYE later still counts. On shm (source addresses unusable, same host only) a BYE claiming a sender
on another host is dropped. An endpoint name that is too long, too short, of an unknown address
family or (shm) not one NUL-terminated string is refused with FabricError(FI_EINVAL) naming it,
in Python and in C, and the engine keeps working.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from support.wait import wait_until

from fabric import FabricConfig, FabricError, PageWrites, PeerDescriptor, TransferEngine, control as wire
from fabric._libfabric import ffi, lib
from pdserve.engine.cache.hostmem import alloc_buffer

MiB = 1 << 20


def _engines(provider: str, n: int) -> list[TransferEngine]:
    config = FabricConfig(provider=provider, node="127.0.0.1")
    return [TransferEngine(config) for _ in range(n)]


def _forge(attacker: TransferEngine, target: TransferEngine, kind: int, value: int, claimed: PeerDescriptor,
           known: bool) -> None:
    """`attacker` posts a `kind` message to `target` whose payload names `claimed` as its sender;
    `known`: the attacker greeted the target first (its address is in the target's AV)."""
    if known:
        attacker.connect(target.peer_descriptor)
    fi_addr = attacker._peers.resolve(target.peer_descriptor, hello=False)
    sent = threading.Event()
    attacker._channel.post(target.peer_descriptor, fi_addr, kind, wire.encode(kind, value, claimed),
                           lambda err: sent.set())
    assert sent.wait(10), "the forged message was not sent"


def _write_lands(a: TransferEngine, b: TransferEngine, region_a, region_b, tag: int) -> None:
    a.write_sync(PageWrites(region_a, [0], region_b.descriptor, [0], [4096], tag), timeout=10)
    wait_until(lambda: b.imm_counter.landed(tag) == 1, 10, f"write with tag {tag} to land")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("known", [False, True], ids=["from-unknown-address", "from-known-address"])
def test_forged_bye_and_revoke_do_not_touch_another_engine(known: bool) -> None:
    a, b, c = _engines("tcp;ofi_rxm", 3)
    try:
        assert a._ep.source_addr, "tcp;ofi_rxm should grant FI_SOURCE"
        src = a.register(alloc_buffer(MiB, huge_pages=False).view)
        dst = b.register(alloc_buffer(MiB, huge_pages=False).view)
        a.connect(b.peer_descriptor)
        b.connect(a.peer_descriptor)
        _write_lands(a, b, src, dst, 11)
        reason = "source_mismatch" if known else "unknown_source"
        before = a._control.rejected[reason]
        _forge(c, a, wire.BYE, 0, b.peer_descriptor, known)
        _forge(c, a, wire.REVOKE, dst.descriptor.region_id, b.peer_descriptor, known)
        # the forgeries are counted as dropped (and come in order before anything later from c)
        wait_until(lambda: a._control.rejected[reason] >= before + 2, 10, "the forged messages to be dropped")
        assert not a.peer_gone(b.peer_descriptor)
        assert not a._peers.is_revoked(b.engine_id, dst.descriptor.region_id)
        _write_lands(a, b, src, dst, 12)   # b is still reachable, its region still writable
        b.close()                          # b's own goodbye still counts
        wait_until(lambda: a.peer_gone(b.peer_descriptor), 10, "b's real BYE to mark it gone")
    finally:
        for e in (a, b, c):
            e.close()


@pytest.mark.timeout(30)
def test_shm_bye_claiming_another_host_is_dropped() -> None:
    a, b = _engines("shm", 2)
    try:
        assert not a._ep.source_addr   # shm's source addresses are never used
        elsewhere = dataclasses.replace(b.peer_descriptor, host_id="another-host/pid:[1]")
        before = a._control.rejected["source_mismatch"]
        _forge(b, a, wire.BYE, 0, elsewhere, known=True)
        wait_until(lambda: a._control.rejected["source_mismatch"] == before + 1, 10, "the forged BYE to be dropped")
        assert not a.peer_gone(b.peer_descriptor)
    finally:
        a.close()
        b.close()


def _bad_names(provider: str, good: bytes) -> list[tuple[bytes, str]]:
    names = [(b"", r"endpoint name of 0 bytes: expected 1\.\.256"), (b"x" * 300, r"of 300 bytes: expected 1\.\.256")]
    if provider == "shm":
        names += [(good.rstrip(b"\0"), "not one NUL-terminated string"),
                  (b"fi_shm://1\0trailing\0", "not one NUL-terminated string")]
    else:
        names += [(good[:8], r"of 8 bytes: its address family needs 16"),
                  (b"\x0a\x00" + good[2:], r"of 16 bytes: its address family needs 28"),
                  (b"\x63\x00" + good[2:], "address family 99, not IPv4 or IPv6")]
    return names


@pytest.mark.timeout(60)
def test_bad_endpoint_names_are_refused(provider: str) -> None:
    a, b = _engines(provider, 2)
    try:
        good = b.peer_descriptor
        for name, match in _bad_names(provider, good.address):
            bad = dataclasses.replace(good, address=name, engine_id="f" * 32)
            with pytest.raises(FabricError, match=match) as info:
                a.connect(bad, timeout=2)
            assert info.value.code == lib.FI_EINVAL, name
        # the C side refuses what its own bounds catch, whoever calls it
        out = ffi.new("uint64_t *")
        assert lib.pdf_av_insert(a._ep.h, ffi.new("uint8_t[]", 300), 300, out) == -lib.FI_EINVAL
        assert lib.pdf_av_insert(a._ep.h, ffi.new("uint8_t[]", 1), 0, out) == -lib.FI_EINVAL
        # and the engine still works with a good peer
        src = a.register(alloc_buffer(MiB, huge_pages=False).view)
        dst = b.register(alloc_buffer(MiB, huge_pages=False).view)
        a.connect(good)
        _write_lands(a, b, src, dst, 21)
    finally:
        a.close()
        b.close()
