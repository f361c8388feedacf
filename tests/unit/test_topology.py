"""Host topology (D16, fabric.topology): NUMA nodes, NIC locality and the closest-NIC/CPU chooser,
on fake sysfs trees and on this machine's real /sys."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fabric.topology import Nic, TopologyError, choose, parse_cpulist, read_topology


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    path.symlink_to(os.path.relpath(target, path.parent))


def node(root: Path, i: int, cpus: str, distance: str) -> None:
    write(root / f"devices/system/node/node{i}/cpulist", cpus + "\n")
    write(root / f"devices/system/node/node{i}/distance", distance + "\n")


def two_node_host(root: Path) -> Path:
    """Node 0 (CPUs 0-3) with a ConnectX port mlx5_0 (interface ens1f0) and a virtio eth0 of unknown
    locality; node 1 (CPUs 4-7) with an EFA device; plus lo and a veth (virtual)."""
    node(root, 0, "0-3", "10 21")
    node(root, 1, "4-7", "21 10")
    write(root / "devices/system/node/online", "0-1\n")
    cx = root / "devices/pci0000:00/0000:00:01.0"
    write(cx / "numa_node", "0\n")
    link(root / "class/infiniband/mlx5_0/device", cx)
    (cx / "net/ens1f0").mkdir(parents=True)
    link(root / "class/net/ens1f0/device", cx)
    efa = root / "devices/pci0000:80/0000:80:02.0"
    write(efa / "numa_node", "1\n")
    link(root / "class/infiniband/rdmap128s2/device", efa)
    virtio = root / "devices/pci0000:00/0000:00:03.0"
    write(virtio / "numa_node", "-1\n")
    link(root / "class/net/eth0/device", virtio / "virtio2")
    (root / "class/net/lo").mkdir(parents=True)                       # no device link: virtual
    link(root / "class/net/veth0/device", root / "devices/virtual/net/veth0")
    return root


def test_reads_nodes_and_nics(tmp_path):
    topo = read_topology(two_node_host(tmp_path))
    assert [(n.id, n.cpus, n.distances) for n in topo.nodes] == [(0, (0, 1, 2, 3), (10, 21)),
                                                                 (1, (4, 5, 6, 7), (21, 10))]
    assert topo.nics == (Nic("mlx5_0", "rdma", 0, ("ens1f0",)), Nic("rdmap128s2", "rdma", 1),
                         Nic("ens1f0", "net", 0), Nic("eth0", "net", None))
    assert topo.distance(0, 1) == 21


def test_chooses_the_nic_and_cpus_of_the_memorys_node(tmp_path):
    topo = read_topology(two_node_host(tmp_path))
    p = choose(topo, 0, "verbs;ofi_rxm")
    assert (p.nic.name, p.domain, p.cpus, p.cpu_node) == ("mlx5_0", "mlx5_0", (0, 1, 2, 3), 0)
    p = choose(topo, 1, "efa")
    assert (p.nic.name, p.domain, p.cpus) == ("rdmap128s2", "rdmap128s2-rdm", (4, 5, 6, 7))
    p = choose(topo, 1)                                   # any NIC: the RDMA device on node 1
    assert p.nic.name == "rdmap128s2" and p.domain is None
    p = choose(topo, 0)                                   # node 0: RDMA device before its interface
    assert p.nic.name == "mlx5_0"
    # tcp on node 1: no interface there; ens1f0 on node 0 is the nearest (eth0's node is unknown)
    p = choose(topo, 1, "tcp;ofi_rxm")
    assert (p.nic.name, p.domain, p.cpus) == ("ens1f0", "ens1f0", (4, 5, 6, 7))
    assert "distance 21: the nearest" in p.reason
    p = choose(topo, 0, "shm")
    assert (p.nic, p.domain, p.cpus) == (None, "shm", (0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"NUMA node 3 is not in this topology \(nodes \[0, 1\]\)"):
        choose(topo, 3)


def test_nearest_by_distance_and_memory_only_nodes(tmp_path):
    # Node 2 is memory only (CXL-like): its CPUs are node 1's (distance 20), its NIC node 0's (30).
    node(tmp_path, 0, "0-1", "10 20 30")
    node(tmp_path, 1, "2-3", "20 10 20")
    node(tmp_path, 2, "", "30 20 10")
    dev = tmp_path / "devices/pci0000:00/0000:00:01.0"
    write(dev / "numa_node", "0\n")
    link(tmp_path / "class/infiniband/mlx5_0/device", dev)
    topo = read_topology(tmp_path)
    p = choose(topo, 2, "verbs")
    assert (p.nic.name, p.cpus, p.cpu_node) == ("mlx5_0", (2, 3), 1)
    assert "on node 0, distance 30" in p.reason
    assert choose(topo, 1, "tcp").nic is None            # no interface at all


def test_no_numa_directory_is_one_node(tmp_path):
    write(tmp_path / "devices/system/cpu/online", "0-5\n")
    topo = read_topology(tmp_path)
    assert [(n.id, n.cpus) for n in topo.nodes] == [(0, (0, 1, 2, 3, 4, 5))] and topo.nics == ()
    p = choose(topo, 0, "verbs")
    assert p.nic is None and p.cpus == (0, 1, 2, 3, 4, 5) and "no NIC" in p.reason


@pytest.mark.parametrize("path,text,match", [
    ("devices/system/node/node1/cpulist", "4-x\n", r"node1/cpulist: malformed CPU list '4-x'"),
    ("devices/system/node/node1/cpulist", "7-4\n", r"malformed CPU list '7-4'"),
    ("devices/system/node/node0/distance", "10\n", r"node0/distance: 1 distances for 2 nodes \[0, 1\]"),
    ("devices/system/node/node0/distance", "10 far\n", r"expected integers, found '10 far'"),
    ("devices/pci0000:80/0000:80:02.0/numa_node", "one\n", r"numa_node: expected an integer, found 'one'"),
    ("devices/pci0000:80/0000:80:02.0/numa_node", "5\n", r"rdmap128s2: NIC on NUMA node 5"),
])
def test_malformed_files_are_named(tmp_path, path, text, match):
    two_node_host(tmp_path)
    write(tmp_path / path, text)
    with pytest.raises(TopologyError, match=match):
        read_topology(tmp_path)


def test_cpulist_syntax():
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()


def test_this_machines_sys():
    # The honest answer here (2-core VM): one NUMA node and no RDMA NIC. Asserted as invariants so
    # the test holds on any Linux host.
    topo = read_topology()
    all_cpus = {c for n in topo.nodes for c in n.cpus}
    assert set(os.sched_getaffinity(0)) <= all_cpus
    rdma = [n for n in topo.nics if n.kind == "rdma"]
    assert {n.name for n in rdma} <= set(os.listdir("/sys/class/infiniband") if os.path.isdir("/sys/class/infiniband")
                                          else ())
    assert not any(n.name == "lo" for n in topo.nics)
    home = next(n.id for n in topo.nodes if n.cpus)
    p = choose(topo, home, "verbs;ofi_rxm")
    assert p.cpus and set(p.cpus) <= all_cpus
    assert (p.nic is None) == (not any(n.numa_node is not None for n in rdma))
    if len(topo.nodes) == 1 and not rdma:
        assert p.nic is None and p.domain is None and "no NIC" in p.reason
