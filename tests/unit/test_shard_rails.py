"""D16 rails in the KV pool: each TP rank's pool is registered on the TransferEngine rail of the
domain its placement names (kv_messenger.pool), on a real tcp;ofi_rxm engine.

The host is a fake sysfs tree (test_topology's helpers) with two NUMA nodes and a NIC on each:
"lo" on node 0 and this machine's other IPv4 interface (eth0 here) on node 1, the names of real
interfaces so that the real engine can open on them; rank r's memory is on node r (`locate`, the
fake host's memory map). One NUMA node and no NIC with a known node (this machine's real shape)
gives one rail and today's descriptors. Last, the prefill node's authorization (prefill_node.authz)
of a ticket whose decode rank 1 sits on another rail of the requesting engine."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fabric import FabricConfig, PeerDescriptor, RemoteDescriptor, TransferEngine
from fabric.topology import interface_ipv4, read_topology
from kv_messenger.placement import shard_placements
from kv_messenger.plan import KvLayout, ShardingScheme
from kv_messenger.pool import register_pool
from kv_messenger.ticket import TransferTicket, peer_to_bytes, remote_to_bytes
from pdserve.serving.channels import CallerIdentity
from prefill_node.authz import PermissionDeniedError, authorize_prefill
from prefill_node.service import PrefillSpec
from tests.unit.test_shard_placement import on_nodes, spec_of
from tests.unit.test_topology import link, node, write


def _second_interface() -> str | None:
    return next((n for _, n in socket.if_nameindex() if n != "lo" and interface_ipv4(n) is not None), None)


def two_nics_host(root: Path, second: str, cpus: tuple[str, str] = ("0-1", "2-3")) -> Path:
    """Node 0 (CPUs cpus[0]) with NIC lo, node 1 (CPUs cpus[1]) with NIC `second` (both PCI devices
    here)."""
    node(root, 0, cpus[0], "10 21")
    node(root, 1, cpus[1], "21 10")
    for i, name in enumerate(("lo", second)):
        dev = root / f"devices/pci0000:00/0000:00:0{i + 1}.0"
        write(dev / "numa_node", f"{i}\n")
        link(root / f"class/net/{name}/device", dev)
    return root


@pytest.fixture
def engine():
    e = TransferEngine(FabricConfig(provider="tcp;ofi_rxm", node="127.0.0.1"))
    yield e
    e.close()


def test_two_numa_nodes_two_nics_give_two_rails(tmp_path, engine):
    second = _second_interface()
    if second is None:
        pytest.skip("no interface besides lo with an IPv4 address")
    allowed = sorted(os.sched_getaffinity(0))   # the fake nodes' CPUs are CPUs this process has
    topo = read_topology(two_nics_host(tmp_path, second, (str(allowed[0]), str(allowed[-1]))))
    pools = [torch.ones(1, 2, 4, 1, 4, 8), torch.ones(1, 2, 4, 1, 4, 8)]
    where = on_nodes({pools[0].data_ptr(): 0, pools[1].data_ptr(): 1})
    pool = register_pool(engine, spec_of(pools), 4,
                         place=lambda spec, provider: shard_placements(spec, provider, topo, locate=where))
    assert [(p.rank, p.numa_node, p.domain) for p in pool.placements] == [(0, 0, "lo"), (1, 1, second)]
    assert [(r.index, r.domain) for r in engine.rails] == [(0, "lo"), (1, second)]
    assert [r.rail for r in pool.regions] == [0, 1]
    # each rank's descriptor (what TransferTicket.kv_ranks carries) names its rail's endpoint
    assert pool.regions[0].descriptor.peer == engine.peer_descriptor
    assert pool.regions[1].descriptor.peer == engine.rails[1].peer
    assert pool.regions[1].descriptor.peer.ip_address() == interface_ipv4(second)
    assert pool.context.region.rail == 0
    # rail 1's progress thread runs on node 1's CPUs (from its next round on); rail 0's stays put
    thread = engine._rails[1]._ep._thread
    deadline = time.monotonic() + 5
    while not engine.rails[1].cpus and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.rails[1].cpus == (allowed[-1],) and engine.rails[0].cpus == ()
    assert os.sched_getaffinity(thread.native_id) == {allowed[-1]}


def test_one_numa_node_is_one_rail_and_todays_descriptors(tmp_path, engine):
    # this machine's shape: one node, a virtio NIC whose numa_node is -1 (never called close)
    node(tmp_path, 0, "0-1", "10")
    virtio = tmp_path / "devices/pci0000:00/0000:00:03.0"
    write(virtio / "numa_node", "-1\n")
    link(tmp_path / "class/net/eth0/device", virtio / "virtio2")
    topo = read_topology(tmp_path)
    pools = [torch.ones(1, 2, 4, 1, 4, 8), torch.ones(1, 2, 4, 1, 4, 8)]
    where = on_nodes({pools[0].data_ptr(): 0, pools[1].data_ptr(): 0})
    pool = register_pool(engine, spec_of(pools), 4,
                         place=lambda spec, provider: shard_placements(spec, provider, topo, locate=where))
    assert [p.domain for p in pool.placements] == [None, None]
    assert len(engine.rails) == 1 and [r.rail for r in pool.regions] == [0, 0]
    me = engine.peer_descriptor
    for r in pool.regions:   # the wire bytes name rail 0's endpoint, as before rails
        assert r.descriptor.peer == me
        assert json.loads(remote_to_bytes(r.descriptor))["peer"] == peer_to_bytes(me).decode()


def test_a_domain_no_rail_opens_on_stays_on_rail_0(tmp_path, caplog):
    second = _second_interface()
    if second is None:
        pytest.skip("no interface besides lo with an IPv4 address")
    topo = read_topology(two_nics_host(tmp_path, second))
    pools = [torch.ones(1, 2, 4, 1, 4, 8), torch.ones(1, 2, 4, 1, 4, 8)]
    where = on_nodes({pools[0].data_ptr(): 0, pools[1].data_ptr(): 1})
    with TransferEngine(FabricConfig(provider="tcp;ofi_rxm", node="127.0.0.1", multi_rail=False)) as e:
        pool = register_pool(e, spec_of(pools), 4,
                             place=lambda spec, provider: shard_placements(spec, provider, topo, locate=where))
        assert len(e.rails) == 1 and [r.rail for r in pool.regions] == [0, 0]
    assert f"TP rank 1's KV pool stays on rail 0 (domain lo), not on its nearest domain {second}" in caplog.text
    assert "multi_rail=False" in caplog.text


def test_prefill_authz_accepts_a_rank_on_another_rail_of_the_same_engine():
    peer, rail1 = _tcp("10.0.0.2"), _tcp("10.0.1.2")
    forged = replace(rail1, pid=8)   # another process claiming the engine id
    plain, tls = CallerIdentity(frozenset(), "10.9.9.9"), CallerIdentity(frozenset({"decode-1"}), "10.0.0.2")
    authorize_prefill(plain, "", _tp2_spec(peer, rail1), OWN)   # no mTLS: the same engine is enough
    with pytest.raises(PermissionDeniedError, match="the KV memory of decode rank 1 belongs to fabric engine"):
        authorize_prefill(plain, "", _tp2_spec(peer, forged), OWN)
    # mTLS: every endpoint's IP must be the caller's, and a rail on another NIC's cannot be tied to it
    authorize_prefill(tls, "decode-1", _tp2_spec(peer, replace(rail1, address=peer.address)), OWN)
    with pytest.raises(PermissionDeniedError, match=r"its KV memory of decode rank 1's fabric endpoint is at 10.0.1.2"):
        authorize_prefill(tls, "decode-1", _tp2_spec(peer, rail1), OWN)


def _tcp(ip: str) -> PeerDescriptor:
    name = struct.pack("=H", socket.AF_INET) + struct.pack(">H", 5000) + socket.inet_aton(ip) + b"\x00" * 8
    return PeerDescriptor("tcp;ofi_rxm", name, "d" * 32, "host-b/pid:[1]", 7, 7)


OWN = PeerDescriptor("tcp;ofi_rxm", b"\x02\x00" + b"\x00" * 14, "p" * 32, "host-a/pid:[1]", 1, 1)


def _tp2_spec(peer: PeerDescriptor, rank1: PeerDescriptor) -> PrefillSpec:
    layout = KvLayout(num_layers=2, num_pages=8, kv_heads=2, page_size=16, head_dim=8, dtype="float32")
    kv = (RemoteDescriptor(peer, 1, 0, 1, 1 << 20), RemoteDescriptor(rank1, 3, 0, 3, 1 << 20))
    ticket = TransferTicket(request_id="r", kv=kv[0], layout=layout, dst_pages=(0,),
                            context=RemoteDescriptor(peer, 2, 0, 2, 1 << 16), context_offset=0, imm_tag=3,
                            expected_writes=3, num_prefill_tokens=4, sharding=ShardingScheme(tp_size=2), kv_ranks=kv)
    return PrefillSpec(request_id="r", token_ids=[1, 2, 3, 4], target=ticket, peer=peer)
