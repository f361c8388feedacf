"""D16: each TP shard's NUMA node, NIC, libfabric domain and CPUs (kv_messenger.placement), and the
memory-locality query under it (fabric.topology.numa_node_of) on this process's real memory.

The fake sysfs trees are test_topology's. On fake multi-node hosts the shards' memory cannot really
sit on node 1 of this machine, so those cases name each shard's node through `locate` (the fake
host's memory map, as the fake tree is its sysfs); real pages go through numa_node_of."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading

import pytest
import torch

from fabric import topology as topo_mod
from fabric.topology import MemoryLocality, format_cpulist, numa_node_of, parse_cpulist, read_topology
from kv_messenger.placement import (
    ShardMemory,
    ShardPlacement,
    pin_thread_to,
    placement_info,
    placement_summary,
    shard_memories,
    shard_placements,
)
from pdserve.engine.cache.kv_cache import KVCacheShape
from pdserve.engine.kv_connector import AttentionGroupSpec, KvCacheSpec, KvShardPool
from tests.unit.test_topology import link, node, two_node_host, write

PAGE = mmap.PAGESIZE


def on_nodes(nodes: dict[int, int | None]):
    """The fake host's memory map: the shard at address `a` is on nodes[a] (None: unknown)."""
    def locate(address: int, length: int) -> MemoryLocality:
        n = nodes[address]
        return MemoryLocality(n, ((n, 1),) if n is not None else (), 1, 0 if n is not None else 1, 0,
                              f"fake: node {n}")
    return locate


def anon(pages: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, pages * PAGE)
    buf = (ctypes.c_char * len(m)).from_buffer(m)
    addr = ctypes.addressof(buf)
    del buf                                   # the mapping stays; only the export is dropped
    return m, addr


def resident(addr: int, pages: int) -> list[int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(addr), pages * PAGE, vec) == 0, os.strerror(ctypes.get_errno())
    return [i for i in range(pages) if vec[i] & 1]


def home_node() -> int:
    return next(n.id for n in read_topology().nodes if set(n.cpus) & os.sched_getaffinity(0))


# --- numa_node_of on real memory ------------------------------------------------------------------

def test_written_memory_is_on_this_machines_node():
    t = torch.ones(1 << 20)                   # 4 MiB, written
    where = numa_node_of(t.data_ptr(), t.numel() * t.element_size())
    if where.node is None and "move_pages(2) failed" in where.reason:
        pytest.skip(f"no NUMA query here: {where.reason}")
    assert where.node == home_node() or len(read_topology().nodes) > 1
    assert where.sampled == 64 and where.untouched == 0 and sum(c for _, c in where.pages) == 64
    assert "64 of 64 resident sampled pages on node" in where.reason


def test_untouched_pages_are_not_faulted_in_and_say_unknown():
    m, addr = anon(40)
    try:
        m[3 * PAGE] = 1                       # pages 3 and 30 written, the rest never touched
        m[30 * PAGE] = 1
        where = numa_node_of(addr, 40 * PAGE)
        if "move_pages(2) failed" in where.reason:
            pytest.skip(where.reason)
        assert (where.sampled, where.untouched, sum(c for _, c in where.pages)) == (40, 38, 2)
        assert where.node is not None and "38 not in memory yet" in where.reason
        assert resident(addr, 40) == [3, 30]  # asking allocated nothing
        none = numa_node_of(addr + 5 * PAGE, 20 * PAGE)   # pages 5..24: none written
        assert none.node is None and none.untouched == 20
        assert "none of the 20 sampled pages is in memory (20 never written" in none.reason
    finally:
        m.close()


def test_shared_memory_written_by_another_process_is_found():
    # A TP worker rank writes its pool; the leader maps the same file but has not touched it, so its
    # page tables lack those pages. They are found through the page cache, the holes stay holes.
    path = f"/dev/shm/pdserve-test-placement-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 16 * PAGE)
        m = mmap.mmap(fd, 16 * PAGE, flags=mmap.MAP_SHARED)
        buf = (ctypes.c_char * len(m)).from_buffer(m)
        addr = ctypes.addressof(buf)
        del buf
        pid = os.fork()
        if pid == 0:
            try:
                m2 = mmap.mmap(fd, 16 * PAGE, flags=mmap.MAP_SHARED)
                for i in range(4, 12):
                    m2[i * PAGE] = 7
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        where = numa_node_of(addr, 16 * PAGE)
        if "move_pages(2) failed" in where.reason:
            pytest.skip(where.reason)
        assert (where.sampled, where.untouched, sum(c for _, c in where.pages)) == (16, 8, 8)
        assert where.node == home_node() or len(read_topology().nodes) > 1
        assert resident(addr, 16) == list(range(4, 12))
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_sampling_is_bounded_and_spread():
    t = torch.ones((300 * PAGE) // 4)         # 300 pages
    where = numa_node_of(t.data_ptr(), t.numel() * 4, max_pages=7)
    if "move_pages(2) failed" in where.reason:
        pytest.skip(where.reason)
    assert where.sampled == 7 and where.node is not None
    assert numa_node_of(t.data_ptr(), 1).sampled == 1
    assert numa_node_of(t.data_ptr(), 300 * PAGE, max_pages=1).sampled == 1


def test_unmapped_memory_is_unknown_not_an_error():
    m, addr = anon(4)
    m.close()                                 # unmapped: move_pages reports -EFAULT per page
    where = numa_node_of(addr, 4 * PAGE)
    assert where.node is None and where.pages == ()
    if "move_pages(2) failed" not in where.reason:
        assert (where.unmapped, where.untouched) == (4, 0)
        assert "4 without a page" in where.reason


@pytest.mark.parametrize("address,length,max_pages,match", [
    (0, 10, 64, r"address must be a positive integer, got 0"),
    (4096, 0, 64, r"length must be a positive integer, got 0"),
    (4096, -5, 64, r"length must be a positive integer, got -5"),
    (4096, 10, 0, r"max_pages must be >= 1, got 0"),
])
def test_bad_arguments_are_named(address, length, max_pages, match):
    with pytest.raises(ValueError, match=match):
        numa_node_of(address, length, max_pages)


def test_unknown_machine_is_unknown(monkeypatch):
    monkeypatch.setattr(topo_mod.platform, "machine", lambda: "s390x")
    t = torch.ones(1024)
    where = numa_node_of(t.data_ptr(), 4096)
    assert where.node is None and "no move_pages(2) syscall number known for machine 's390x'" in where.reason


def test_failed_call_names_its_errno(monkeypatch):
    # move_pages with nodes=NULL never fails with EINVAL for a valid call: pass a bogus syscall
    # number through the table to get the kernel's ENOSYS, as a kernel without NUMA answers.
    monkeypatch.setitem(topo_mod._MOVE_PAGES, topo_mod.platform.machine(), 100000)
    t = torch.ones(1024)
    where = numa_node_of(t.data_ptr(), 4096)
    assert where.node is None
    assert f"move_pages(2) failed with {errno.errorcode[errno.ENOSYS]}: the kernel has no NUMA support" in where.reason


def test_cpulist_round_trip():
    assert format_cpulist((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    assert format_cpulist(()) == "" and format_cpulist([5, 4, 4]) == "4-5"
    assert parse_cpulist(format_cpulist(range(0, 64, 3))) == tuple(range(0, 64, 3))


# --- shard_placements on fake hosts ---------------------------------------------------------------

def test_two_nodes_a_nic_on_each(tmp_path):
    topo = read_topology(two_node_host(tmp_path))   # mlx5_0 on node 0, EFA rdmap128s2 on node 1
    shards = [ShardMemory(0, 0x1000, 4096), ShardMemory(1, 0x2000, 4096)]
    p = shard_placements(shards, "verbs;ofi_rxm", topo, locate=on_nodes({0x1000: 0, 0x2000: 1}))
    assert [(x.rank, x.numa_node, x.nic, x.domain, x.cpus) for x in p] == [
        (0, 0, "mlx5_0", "mlx5_0", (0, 1, 2, 3)),
        (1, 1, "rdmap128s2", "rdmap128s2", (4, 5, 6, 7)),
    ]
    p = shard_placements(shards, "efa", topo, locate=on_nodes({0x1000: 1, 0x2000: 0}))
    assert [(x.nic, x.domain, x.cpus) for x in p] == [("rdmap128s2", "rdmap128s2-rdm", (4, 5, 6, 7)),
                                                       ("mlx5_0", "mlx5_0-rdm", (0, 1, 2, 3))]
    assert placement_summary(p) == ("KV shard placement: rank 0 numa 1 nic rdmap128s2 cpus 4-7; "
                                    "rank 1 numa 0 nic mlx5_0 cpus 0-3")
    assert [i.labels() for i in placement_info(p)] == [
        {"rank": "0", "numa_node": "1", "nic": "rdmap128s2", "domain": "rdmap128s2-rdm", "cpus": "4-7"},
        {"rank": "1", "numa_node": "0", "nic": "mlx5_0", "domain": "mlx5_0-rdm", "cpus": "0-3"}]
    # tcp: node 1 has no interface, ens1f0 on node 0 is the nearest; eth0 (node unknown) never wins
    p = shard_placements(shards[1:], "tcp;ofi_rxm", topo, locate=on_nodes({0x2000: 1}))
    assert (p[0].nic, p[0].domain, p[0].cpus) == ("ens1f0", "ens1f0", (4, 5, 6, 7))
    assert "memory: fake: node 1; net NIC ens1f0 on node 0, distance 21: the nearest" == p[0].reason


def test_unknown_memory_node_on_a_multi_node_host_pins_nothing(tmp_path):
    topo = read_topology(two_node_host(tmp_path))
    (p,) = shard_placements([ShardMemory(3, 0x1000, 4096)], "verbs", topo, locate=on_nodes({0x1000: None}))
    assert (p.rank, p.numa_node, p.nic, p.domain, p.cpus) == (3, None, None, None, ())
    assert "2 NUMA nodes, so no NIC or CPUs are chosen" in p.reason
    assert placement_summary([p]) == "KV shard placement: rank 3 numa unknown nic none cpus none"
    assert placement_info([p])[0].labels()["numa_node"] == "unknown"


def test_nic_of_unknown_node_is_not_called_close(tmp_path):
    # One node, one virtio interface whose numa_node is -1 (this VM's shape, plus a second CPU set).
    node(tmp_path, 0, "0-1", "10")
    virtio = tmp_path / "devices/pci0000:00/0000:00:03.0"
    write(virtio / "numa_node", "-1\n")
    link(tmp_path / "class/net/eth0/device", virtio / "virtio2")
    topo = read_topology(tmp_path)
    (p,) = shard_placements([ShardMemory(0, 0x1000, 4096)], "tcp;ofi_rxm", topo, locate=on_nodes({0x1000: 0}))
    assert (p.numa_node, p.nic, p.domain, p.cpus) == (0, None, None, (0, 1))
    assert "locality unknown: eth0" in p.reason


def test_node_missing_from_topology_names_the_rank(tmp_path):
    topo = read_topology(two_node_host(tmp_path))
    with pytest.raises(ValueError, match=r"TP rank 1's KV pool is on NUMA node 5: NUMA node 5 is not in this"):
        shard_placements([ShardMemory(1, 0x1000, 1)], None, topo, locate=on_nodes({0x1000: 5}))
    with pytest.raises(ValueError, match=r"duplicate ranks in \[0, 0\]"):
        shard_placements([ShardMemory(0, 0x1000, 1), ShardMemory(0, 0x2000, 1)], None, topo)
    with pytest.raises(ValueError, match=r"rank must be >= 0, address and length > 0"):
        ShardMemory(0, 0x1000, 0)


def spec_of(pools: list[torch.Tensor]) -> KvCacheSpec:
    # pools: [layers, 2, pages, kv_heads_r, page_size, head_dim] per rank
    shape = KVCacheShape(num_layers=1, num_pages=4, kv_heads=pools[0].shape[3], page_size=4, head_dim=8)
    shards = tuple(KvShardPool(r, b, tuple(range(r, r + b.shape[3]))) for r, b in enumerate(pools)) \
        if len(pools) > 1 else ()
    return KvCacheSpec(pools[0], shape, torch.float32, (AttentionGroupSpec("full", (0,), None),), 16, "m", shards)


def test_real_pools_on_a_one_node_host_without_nic(tmp_path):
    # This machine's shape, as a fake tree so the test holds on any host: real torch pools (their
    # pages written), their real node from move_pages, one node 0, no NIC.
    write(tmp_path / "devices/system/cpu/online", "0-1\n")
    topo = read_topology(tmp_path)
    pools = [torch.ones(1, 2, 4, 1, 4, 8), torch.ones(1, 2, 4, 1, 4, 8)]
    spec = spec_of(pools)
    assert shard_memories(spec) == (ShardMemory(0, pools[0].data_ptr(), 1024),
                                    ShardMemory(1, pools[1].data_ptr(), 1024))
    where = numa_node_of(pools[0].data_ptr(), 1024)
    if where.node not in (None, 0):
        pytest.skip(f"this host's memory is on node {where.node}, which a one-node fake tree does not list")
    p = shard_placements(spec, "verbs;ofi_rxm", topo)
    assert [(x.rank, x.numa_node, x.nic, x.domain, x.cpus) for x in p] == [(0, 0, None, None, (0, 1)),
                                                                           (1, 0, None, None, (0, 1))]
    assert placement_summary(p) == ("KV shard placement: rank 0 numa 0 nic none cpus 0-1; "
                                    "rank 1 numa 0 nic none cpus 0-1")
    # KvShardPool records and TP 1 specs go the same way
    assert shard_placements(spec.shards, "shm", topo)[1].domain == "shm"
    (one,) = shard_placements(spec_of(pools[:1]), None, topo)
    assert one.rank == 0 and one.numa_node == 0


def test_untouched_pool_on_a_one_node_host_is_that_node(tmp_path):
    write(tmp_path / "devices/system/cpu/online", "0-1\n")
    m, addr = anon(8)                         # never written: its own pages say nothing
    try:
        (p,) = shard_placements([ShardMemory(0, addr, 8 * PAGE)], None, read_topology(tmp_path))
        assert p.numa_node == 0 and p.cpus == (0, 1) and p.memory.node is None
        assert "the host has one NUMA node (0)" in p.reason
        assert resident(addr, 8) == []
    finally:
        m.close()


def test_this_machine():
    # The real /sys and real pools: whatever the host, every shard gets a node that exists and CPUs
    # of it; on a one-node host without RDMA devices (this VM) that is numa 0, nic none.
    topo = read_topology()
    pools = [torch.ones(1, 2, 4, 1, 4, 8), torch.ones(1, 2, 4, 2, 4, 8)]
    p = shard_placements(spec_of(pools), "verbs;ofi_rxm", topo)
    assert [x.rank for x in p] == [0, 1]
    for x in p:
        if x.numa_node is not None:
            assert x.numa_node in {n.id for n in topo.nodes} and x.cpus
    rdma = [n for n in topo.nics if n.kind == "rdma" and n.numa_node is not None]
    if len(topo.nodes) == 1 and not rdma:
        assert all((x.numa_node, x.nic, x.domain) == (topo.nodes[0].id, None, None) for x in p)


# --- pinning --------------------------------------------------------------------------------------

def run_in_thread(fn):
    box = {}

    def body():
        box["result"] = fn()
        box["mask"] = os.sched_getaffinity(0)

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert not t.is_alive()
    return box["result"], box["mask"]


def placement(cpus: tuple[int, ...]) -> ShardPlacement:
    return ShardPlacement(0, 0, None, None, cpus, "test", MemoryLocality(0, ((0, 1),), 1, 0, 0, "test"))


def test_pin_thread_to_pins_only_the_calling_thread():
    before = os.sched_getaffinity(0)
    last = max(before)
    result, mask = run_in_thread(lambda: pin_thread_to(placement((last, 10_000))))
    assert result == (last,) and mask == {last}
    assert os.sched_getaffinity(0) == before          # the main thread is untouched


def test_pin_thread_to_never_widens_and_logs_a_no_op(caplog):
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger="kv_messenger.placement"):
        result, mask = run_in_thread(lambda: pin_thread_to(placement((10_000, 10_001))))
        assert result == () and mask == before
        assert "not pinning thread" in caplog.text and "placement CPUs [10000-10001]" in caplog.text
        caplog.clear()
        result, mask = run_in_thread(lambda: pin_thread_to(placement(())))
        assert result == () and mask == before and "placement CPUs []" in caplog.text
    first = min(before)
    result, mask = run_in_thread(lambda: pin_thread_to(placement(tuple(before)), allowed=[first]))
    assert result == (first,) and mask == {first}
