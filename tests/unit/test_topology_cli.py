"""`pdserve topology` (pdserve/tools/topology.py): the host's nodes and NICs, and the placement a TP N
node would get, on a fake two-node tree split along this process's own CPUs and on the real /sys."""

from __future__ import annotations

import os

import pytest

from pdserve.tools.cli import main
from tests.unit.test_topology import two_node_host, write


def test_two_node_host_tp2(tmp_path, capsys):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 allowed CPUs to split over two fake nodes, this process has {cpus}")
    half = len(cpus) // 2
    root = two_node_host(tmp_path)     # mlx5_0 (+ ens1f0) on node 0, EFA rdmap128s2 on node 1
    write(root / "devices/system/node/node0/cpulist", ",".join(map(str, cpus[:half])) + "\n")
    write(root / "devices/system/node/node1/cpulist", ",".join(map(str, cpus[half:])) + "\n")
    assert main(["topology", "--tp", "2", "--provider", "efa", "--sys", str(root)]) == 0
    out = capsys.readouterr().out
    assert "  mlx5_0: rdma, numa 0, interfaces ens1f0\n" in out and "  eth0: net, numa unknown\n" in out
    assert "veth0" not in out and " lo:" not in out
    # the leader runs on every CPU (both nodes): unknown, nothing chosen; rank 1 is pinned on node 1
    last = out.strip().splitlines()[-1]
    assert last.startswith("KV shard placement: rank 0 numa unknown nic none cpus none; rank 1 numa 1 "
                           "nic rdmap128s2 cpus "), last
    assert "domain rdmap128s2-rdm: runs on CPU(s) " in out and "(pinned), all on node 1" in out


def test_this_host(capsys):
    assert main(["topology", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("NUMA nodes (/sys/devices/system/node):\n  node ")
    assert "KV shard placement: rank 0 numa " in out and "; rank 1 numa " in out


def test_bad_tp_is_refused(capsys):
    assert main(["topology", "--tp", "0"]) == 2
    assert "--tp must be >= 1, got 0" in capsys.readouterr().err
