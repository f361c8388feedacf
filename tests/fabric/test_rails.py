"""Rails (D16): one TransferEngine with an endpoint per libfabric domain, on real tcp;ofi_rxm.

tcp;ofi_rxm lists one domain per interface (fi_info: "lo", "eth0", ...). Each engine here opens
rail 0 bound to 127.0.0.1 (domain "lo") and rail 1 on the first other interface with an IPv4
address (this machine: eth0), so the two rails are two different domains. Pages go from a region
on rail 1 to a peer region on rail 1 and from rail 0 to rail 0; the bytes and the immediate-data
counts are checked, and each write is seen on the rail it was posted on.

A rail is asked for by its domain NAME (hints->domain_attr->name, the name checked in pdf_open:
libfabric 1.17's tcp ignores the hint); tcp is also bound to the interface's IPv4 address. The
name-only open (node None) is the call efa ("rdmap0s6-rdm") and an address-less verbs device get;
efa and verbs cannot run on this machine, so it is exercised here with the tcp provider string.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from fabric import FabricConfig, FabricError, PageWrites, TransferEngine
from fabric.endpoint import Endpoint
from fabric.topology import interface_ipv4
from pdserve.engine.cache.hostmem import alloc_buffer

PROVIDER = "tcp;ofi_rxm"
PAGE = 4096
PAGES = 16


def _second_domain() -> str | None:
    """An interface other than lo with an IPv4 address that tcp;ofi_rxm opens an endpoint on."""
    for _, name in socket.if_nameindex():
        if name == "lo" or interface_ipv4(name) is None:
            continue
        return name
    return None


@pytest.fixture(scope="module")
def pair():
    second = _second_domain()
    if second is None:
        pytest.skip("no interface besides lo with an IPv4 address: one tcp domain only")
    config = FabricConfig(provider=PROVIDER, node="127.0.0.1")
    a, b = TransferEngine(config), TransferEngine(config)
    try:
        for e in (a, b):
            try:
                assert e.open_rail(second) == 1
            except FabricError as err:
                pytest.skip(f"tcp;ofi_rxm does not open on {second}: {err}")
        yield a, b, second
    finally:
        a.close()
        b.close()


class _Count:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.fired: set[int] = set()

    def __call__(self, tag: int) -> None:
        with self.cv:
            self.fired.add(tag)
            self.cv.notify_all()

    def wait(self, tag: int) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: tag in self.fired, 10.0)


def _write(a: TransferEngine, src, dst, pages: list[int], tag: int) -> None:
    done = threading.Event()
    errors: list[Exception] = []
    off = np.asarray(pages, dtype=np.uint64) * PAGE
    a.write(PageWrites(src, off, dst.descriptor, off, np.full(len(pages), PAGE, dtype=np.uint64), tag,
                       imm_mode="every"), done.set, lambda e: (errors.append(e), done.set()))
    assert done.wait(10) and not errors, errors


def test_two_rails_on_two_domains_write_rail_to_rail(pair):
    a, b, second = pair
    assert [(r.index, r.domain) for r in a.rails] == [(0, "lo"), (1, second)]
    assert a.rails[1].node == interface_ipv4(second)
    assert a.rails[1].peer.engine_id == a.engine_id and a.rails[1].peer.address != a.rails[0].peer.address
    assert a.rails[1].peer.ip_address() == interface_ipv4(second)
    assert a.open_rail(second) == 1 and a.open_rail("lo") == 0 and a.rail_for("nope") is None
    assert not a.writes_ordered   # a fence on one rail proves nothing of the other
    rng = np.random.default_rng(16)
    bufs = [alloc_buffer(PAGES * PAGE) for _ in range(4)]
    for buf in bufs[:2]:
        buf.numpy()[:] = rng.integers(0, 256, PAGES * PAGE, dtype=np.uint8)
    src0, src1 = a.register(bufs[0].view, rail=0), a.register(bufs[1].view, rail=1)
    dst0, dst1 = b.register(bufs[2].view, rail=0), b.register(bufs[3].view, rail=1)
    assert (src1.rail, dst1.rail, dst0.rail) == (1, 1, 0)
    assert dst1.descriptor.peer == b.rails[1].peer and dst0.descriptor.peer == b.peer_descriptor
    assert len({src0.region_id, src1.region_id}) == 2   # one id counter across rails
    landed = _Count()
    pages1, pages0 = [1, 2, 3, 7, 8, 15], [0, 4, 5, 6]
    b.imm_counter.expect(101, len(pages1), landed)
    b.imm_counter.expect(100, len(pages0), landed)
    before = [a.rail_stats(i) for i in (0, 1)]
    _write(a, src1, dst1, pages1, 101)
    _write(a, src0, dst0, pages0, 100)
    assert landed.wait(101) and landed.wait(100)
    for pages, s, d in ((pages1, bufs[1], bufs[3]), (pages0, bufs[0], bufs[2])):
        got, want = d.numpy().reshape(PAGES, PAGE), s.numpy().reshape(PAGES, PAGE)
        assert np.array_equal(got[pages], want[pages])
        untouched = sorted(set(range(PAGES)) - set(pages))
        assert not got[untouched].any()
    after = [a.rail_stats(i) for i in (0, 1)]
    assert [after[i].entries - before[i].entries for i in (0, 1)] == [len(pages0), len(pages1)]
    assert a.stats().entries == sum(st.entries for st in after)
    # each rail shook hands with the endpoint it wrote to, and only that one
    assert b.rails[1].peer in a._rails[1]._peers.addresses_of(b.engine_id)
    assert b.rails[1].peer not in a._rails[0]._peers.addresses_of(b.engine_id)
    # a region is used on its own rail only
    with pytest.raises(FabricError, match="is on rail 1, not 0"):
        a._rails[0]._writes.write(PageWrites(src1, [0], dst0.descriptor, [0], [PAGE], None), print, print)
    for r in (src0, src1):
        a.deregister(r)
    for r in (dst0, dst1):
        b.deregister(r)
    # disconnecting a peer ends the connections to every endpoint of its engine, on every rail
    a.disconnect(b.peer_descriptor)
    assert [r._peers.addresses_of(b.engine_id) for r in a._rails] == [[], []]


def test_rail_arguments_are_checked(pair):
    a, _, _ = pair
    with pytest.raises(ValueError, match=r"rail=5: this engine has rails 0..1"):
        a.register(bytearray(PAGE), rail=5)
    with pytest.raises(ValueError, match="no local address opens provider 'tcp;ofi_rxm' on domain 'nosuch0'"):
        a.open_rail("nosuch0")
    with TransferEngine(FabricConfig(provider="shm")) as shm:
        with pytest.raises(ValueError, match="provider shm has one domain"):
            shm.open_rail("eth0")
        assert shm.open_rail(shm.domain) == 0 and len(shm.rails) == 1


def test_a_closed_peer_is_gone_on_every_rail(pair):
    _, b, second = pair
    c = TransferEngine(FabricConfig(provider=PROVIDER, node="127.0.0.1"))
    try:
        assert c.open_rail(second) == 1
        src, dst = alloc_buffer(PAGES * PAGE), alloc_buffer(PAGES * PAGE)
        src.numpy()[:] = 7
        s1, d1 = c.register(src.view, rail=1), b.register(dst.view, rail=1)
        landed = _Count()
        b.imm_counter.expect(102, 2, landed)
        _write(c, s1, d1, [3, 4], 102)           # c's rail 1 -> b's rail 1 only
        assert landed.wait(102) and (dst.numpy()[3 * PAGE : 5 * PAGE] == 7).all()
        assert [len(r._peers.addresses_of(c.engine_id)) for r in b._rails] == [0, 1]
    finally:
        c.close()
    # c said goodbye on its rail 1 only (the only one that knew b): b judges it gone whichever rail heard
    deadline = time.monotonic() + 5   # the goodbye left c; b's rail-1 thread handles it soon
    while not b.peer_gone(c.peer_descriptor) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.peer_gone(c.peer_descriptor)
    assert b.wait_peer_gone(c.peer_descriptor, 5.0)
    assert all(r._peers.is_gone(c.engine_id) for r in b._rails)
    b.deregister(d1)


def test_a_rail_is_asked_for_by_domain_name(pair):
    a, b, second = pair
    # the rails of the pair were opened by name (open_rail passes it to pdf_open), rail 0 without one
    assert [r._ep.asked_domain for r in a._rails] == [None, second]
    config = FabricConfig(provider=PROVIDER, node="127.0.0.1")
    # a name the provider lacks: a FabricError naming it and the domains fi_getinfo listed
    with pytest.raises(FabricError, match=r"no domain named 'nosuch0' \(the provider's: [^)]*\blo\b") as err:
        Endpoint(config, domain="nosuch0")
    listed = str(err.value).split("the provider's: ")[1].split(")")[0].split(", ")
    assert {"lo", second} <= set(listed)
    # by the name alone (efa's call: no bind address), on each domain fi_info names; config.node
    # (rail 0's 127.0.0.1) is not used then
    for name in ("lo", second):
        ep = Endpoint(config, node=None, domain=name, engine_id=a.engine_id, rail=2)
        try:
            assert (ep.node, ep.asked_domain, ep.domain, ep.provider) == (None, name, name, PROVIDER)
            assert ep.me.ip_address() == interface_ipv4(name)
        finally:
            ep.close_ep()
            ep.release()
    with pytest.raises(ValueError, match="domain=''"):
        Endpoint(config, domain="")


def test_a_rail_opened_by_name_alone_carries_writes(monkeypatch):
    """open_rail as it runs for efa (Endpoint(node=None, domain=name)): its tcp bind address is
    dropped on the way to the real endpoint, so the domain name alone picks the rail."""
    second = _second_domain()
    if second is None:
        pytest.skip("no interface besides lo with an IPv4 address: one tcp domain only")
    import fabric.engine

    opened = []

    def by_name(config, *, node=None, domain=None, **kw):
        opened.append((node, domain))
        return Endpoint(config, node=None, domain=domain, **kw)

    monkeypatch.setattr(fabric.engine, "Endpoint", by_name)
    config = FabricConfig(provider=PROVIDER, node="127.0.0.1")
    with TransferEngine(config) as a, TransferEngine(config) as b:
        assert a.open_rail(second) == 1 and b.open_rail(second) == 1
        assert opened[-2:] == [(interface_ipv4(second), second)] * 2
        assert [(r.domain, r.node, r.peer.ip_address()) for r in a.rails][1] == (second, None, interface_ipv4(second))
        src, dst = alloc_buffer(PAGES * PAGE), alloc_buffer(PAGES * PAGE)
        src.numpy()[:] = np.random.default_rng(17).integers(0, 256, PAGES * PAGE, dtype=np.uint8)
        s1, d1 = a.register(src.view, rail=1), b.register(dst.view, rail=1)
        landed = _Count()
        pages = [2, 9, 10, 13]
        b.imm_counter.expect(103, len(pages), landed)
        _write(a, s1, d1, pages, 103)
        assert landed.wait(103)
        got, want = dst.numpy().reshape(PAGES, PAGE), src.numpy().reshape(PAGES, PAGE)
        assert np.array_equal(got[pages], want[pages]) and not got[sorted(set(range(PAGES)) - set(pages))].any()
        assert (a.rail_stats(1).entries, a.rail_stats(0).entries) == (len(pages), 0)
        a.deregister(s1)
        b.deregister(d1)
