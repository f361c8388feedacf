"""`pdserve topology`: this host's NUMA nodes and NICs as pdserve reads them (D16), and the KV shard
placement a TP N node started here would get.

    pdserve topology [--tp N] [--provider PROVIDER] [--sys ROOT]

The placement is a prediction made before any pool exists: rank r > 0 runs on its slice of this
process's CPUs (pdserve.parallel.group.rank_cpus; all of them when there are fewer CPUs than ranks)
and the leader (rank 0) on all of them, and a pool's pages land on the node of the CPUs that first
write them, so a rank whose CPUs all sit on one node is predicted there; otherwise the node is
unknown (on a one-node host it is that node). A running node logs what its pools' pages really say
(kv_messenger.placement.shard_placements). Nothing here blocks: sysfs reads only.
"""

from __future__ import annotations

import argparse
import os

from fabric.topology import Topology, format_cpulist, read_topology
from kv_messenger.placement import ShardPlacement, placement_on, placement_summary


def predicted_placements(topology: Topology, tp_size: int, provider: str | None) -> tuple[ShardPlacement, ...]:
    """Where a TP `tp_size` node started by this process would put its shards (module docstring)."""
    from pdserve.parallel.group import rank_cpus

    if tp_size < 1:
        raise ValueError(f"--tp must be >= 1, got {tp_size}")
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    slices = rank_cpus(tp_size)
    out = []
    for r in range(tp_size):
        mine = cpus if r == 0 or not slices[r] else slices[r]
        homes = sorted({n.id for n in topology.nodes if set(n.cpus) & set(mine)})
        where = "the leader, not pinned" if r == 0 else ("pinned" if slices[r] else "not pinned: too few CPUs")
        node = homes[0] if len(homes) == 1 else None
        why = f"runs on CPU(s) {format_cpulist(mine)} ({where}), " + \
            (f"all on node {node}" if node is not None else f"on nodes {homes}")
        out.append(placement_on(r, node, provider, topology, why))
    return tuple(out)


def render(topology: Topology, root: str, tp_size: int, provider: str | None) -> str:
    lines = [f"NUMA nodes ({root}/devices/system/node):"]
    for n in topology.nodes:
        lines.append(f"  node {n.id}: cpus {format_cpulist(n.cpus) or 'none'}, "
                     f"distances {' '.join(map(str, n.distances))}")
    lines.append("NICs (virtual interfaces skipped):" if topology.nics else "NICs: none (virtual interfaces skipped)")
    for nic in topology.nics:
        node = "unknown" if nic.numa_node is None else str(nic.numa_node)
        extra = f", interfaces {', '.join(nic.netdevs)}" if nic.netdevs else ""
        lines.append(f"  {nic.name}: {nic.kind}, numa {node}{extra}")
    placements = predicted_placements(topology, tp_size, provider)
    lines.append(f"a TP {tp_size} node, provider {provider or 'any'}:")
    for p in placements:
        lines.append(f"  {p.summary()} domain {p.domain or 'none'}: {p.reason}")
    lines.append(placement_summary(placements))
    return "\n".join(lines)


def cmd_topology(args: argparse.Namespace) -> int:
    print(render(read_topology(args.sys), args.sys, args.tp, args.provider))
    return 0


def add_topology_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("topology", help="this host's NUMA nodes and NICs, and where a TP N node's KV shards "
                                        "would run their transfers (D16)")
    t.add_argument("--tp", type=int, default=1, metavar="N", help="ranks of the node to place (default 1)")
    t.add_argument("--provider", default=None,
                   help="libfabric provider (tcp;ofi_rxm, verbs;ofi_rxm, efa, shm; default: any NIC)")
    t.add_argument("--sys", default="/sys", metavar="ROOT", help="where sysfs is mounted (default /sys)")
    t.set_defaults(func=cmd_topology)
