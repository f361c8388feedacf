"""Where each tensor-parallel shard's transfers should run (D16): the NUMA node of its KV pool,
the NIC and libfabric domain closest to it, and the CPUs to pin the threads that drive it to.

    placements = shard_placements(spec, transport.provider)   # at register_kv_cache, once
    logger.info("%s", placement_summary(placements))          # "KV shard placement: rank 0 numa 0 ..."
    pin_thread_to(placements[0])                               # in a thread that posts / polls rank 0's writes

`shard_placements` asks where each rank's pool lives (`fabric.topology.numa_node_of`: the pages'
own node, never guessed) and hands the node to `fabric.topology.choose` over the host's sysfs
topology. A pool whose node is unknown (no page of it in memory yet, pages spread over nodes, no
NUMA support) is placed on the host's node when the host has exactly one, which is then a fact
and not a guess; on a host with several it gets no NIC, no domain and no CPUs (nothing pinned),
and its `reason` says why. On a one-node host without an RDMA device (this development VM: a
virtio NIC whose sysfs numa_node is -1) every shard reads "numa 0 nic none".

The placements decide each rank's rail (kv_messenger.pool: its pool is registered on the
TransferEngine endpoint of its placement's domain, which `open_rail` asks libfabric for by that
name: efa "<device>-rdm", verbs the device, tcp the interface) and where the sender's messenger
thread runs.

`placement_info` is the same as label strings, one frozen record per rank, for an info gauge
(`pdserve:kv_shard_placement_info{rank, numa_node, nic, domain, cpus} 1`).

Bounds: reading small sysfs files and numa_node_of's few syscalls per shard (see
fabric/topology.py); pin_thread_to is one sched_getaffinity and at most one sched_setaffinity.
Nothing here waits.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fabric.topology import MemoryLocality, Topology, choose, format_cpulist, numa_node_of, read_topology
from pdserve.engine.kv_connector import KvCacheSpec, KvShardPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardMemory:
    """One rank's KV pool as an address range of this process."""

    rank: int
    address: int
    length: int                     # bytes

    def __post_init__(self) -> None:
        if self.rank < 0 or self.address <= 0 or self.length <= 0:
            raise ValueError(f"ShardMemory(rank={self.rank}, address={self.address:#x}, length={self.length}): "
                             "rank must be >= 0, address and length > 0")


@dataclass(frozen=True)
class ShardPlacement:
    rank: int
    numa_node: int | None           # the node of the pool's memory; None: unknown on a multi-node host
    nic: str | None                 # the closest NIC serving the provider (RDMA device or interface); None: none
    domain: str | None              # its libfabric domain ("shm" for shm); None: not inferable or no NIC
    cpus: tuple[int, ...]           # the CPUs closest to the memory; (): do not pin
    reason: str                     # how this was decided, in words
    memory: MemoryLocality | None   # what the pool's pages said; None: a prediction (placement_on)

    def summary(self) -> str:
        node = "unknown" if self.numa_node is None else str(self.numa_node)
        return f"rank {self.rank} numa {node} nic {self.nic or 'none'} cpus {format_cpulist(self.cpus) or 'none'}"


@dataclass(frozen=True)
class PlacementInfo:
    """One rank's placement as Prometheus label values (all strings; "none" / "unknown" for absent)."""

    rank: str
    numa_node: str
    nic: str
    domain: str
    cpus: str

    def labels(self) -> dict[str, str]:
        return {"rank": self.rank, "numa_node": self.numa_node, "nic": self.nic, "domain": self.domain,
                "cpus": self.cpus}


def shard_memories(spec: KvCacheSpec) -> tuple[ShardMemory, ...]:
    """Every rank's pool in rank order (at TP 1 the one `spec.buffer`)."""
    buffers = [(p.rank, p.buffer) for p in spec.shards] if spec.shards else [(0, spec.buffer)]
    return tuple(ShardMemory(rank, b.data_ptr(), b.numel() * b.element_size()) for rank, b in buffers)


def _as_memory(shard: KvShardPool | ShardMemory) -> ShardMemory:
    if isinstance(shard, ShardMemory):
        return shard
    if isinstance(shard, KvShardPool):
        b = shard.buffer
        return ShardMemory(shard.rank, b.data_ptr(), b.numel() * b.element_size())
    raise TypeError(f"expected a KvShardPool or ShardMemory, got {type(shard).__name__}")


def shard_placements(shards: KvCacheSpec | Iterable[KvShardPool | ShardMemory], provider: str | None,
                     topology: Topology | None = None, *,
                     locate: Callable[[int, int], MemoryLocality] = numa_node_of,
                     sys_root: str = "/sys") -> tuple[ShardPlacement, ...]:
    """One placement per rank, in the order given (a KvCacheSpec: rank order). `provider`: the
    libfabric provider the node's TransferEngine opened (None: any NIC). `topology`: default read
    from `sys_root`. `locate(address, length)`: where a range's memory is (numa_node_of).
    ValueError for duplicate ranks, or a node the topology does not list (naming the rank)."""
    memories = shard_memories(shards) if isinstance(shards, KvCacheSpec) else tuple(_as_memory(s) for s in shards)
    ranks = [m.rank for m in memories]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"shard_placements: duplicate ranks in {ranks}")
    topo = topology if topology is not None else read_topology(sys_root)
    out = []
    for m in memories:
        where = locate(m.address, m.length)
        out.append(placement_on(m.rank, where.node, provider, topo, f"memory: {where.reason}", where))
    return tuple(out)


def placement_on(rank: int, node: int | None, provider: str | None, topology: Topology, why: str,
                 memory: MemoryLocality | None = None) -> ShardPlacement:
    """The placement of a rank whose memory is on `node` (None: unknown; on a one-node host that
    node), `why` saying how the node is known. ValueError naming the rank for a node not listed."""
    if node is None and len(topology.nodes) == 1:
        node = topology.nodes[0].id
        why += f"; the host has one NUMA node ({node})"
    if node is None:
        return ShardPlacement(rank, None, None, None, (),
                              f"{why}; {len(topology.nodes)} NUMA nodes, so no NIC or CPUs are chosen", memory)
    try:
        p = choose(topology, node, provider)
    except ValueError as e:
        raise ValueError(f"TP rank {rank}'s KV pool is on NUMA node {node}: {e}") from None
    return ShardPlacement(rank, node, p.nic.name if p.nic else None, p.domain, p.cpus, f"{why}; {p.reason}", memory)


def placement_summary(placements: Iterable[ShardPlacement]) -> str:
    """"KV shard placement: rank 0 numa 0 nic none cpus 0-1; rank 1 ..." (one line, for start logs)."""
    return "KV shard placement: " + ("; ".join(p.summary() for p in placements) or "no shards")


def placement_info(placements: Iterable[ShardPlacement]) -> tuple[PlacementInfo, ...]:
    return tuple(PlacementInfo(str(p.rank), "unknown" if p.numa_node is None else str(p.numa_node),
                               p.nic or "none", p.domain or "none", format_cpulist(p.cpus) or "none")
                 for p in placements)


def pin_thread_to(placement: ShardPlacement, allowed: Iterable[int] | None = None) -> tuple[int, ...]:
    """Pin the calling thread (sched_setaffinity(0, ...) is per thread on Linux) to the placement's
    CPUs within `allowed` (default: the CPUs this thread may use now, so a pin never widens what
    the launcher or a cgroup gave it). Returns the CPUs it now runs on; () when nothing was changed
    (no CPUs in common, or the placement has none), which is logged."""
    current = set(os.sched_getaffinity(0))
    permitted = current if allowed is None else set(allowed) & current
    target = set(placement.cpus) & permitted
    if not target:
        logger.info("KV shard rank %d: not pinning thread %s: placement CPUs [%s] and allowed CPUs [%s] have none "
                    "in common", placement.rank, _thread_name(), format_cpulist(placement.cpus),
                    format_cpulist(permitted))
        return ()
    if target != current:
        os.sched_setaffinity(0, target)
        logger.info("KV shard rank %d: thread %s pinned to CPUs %s (NUMA node %s)", placement.rank, _thread_name(),
                    format_cpulist(target), placement.numa_node)
    return tuple(sorted(target))


def _thread_name() -> str:
    return threading.current_thread().name
