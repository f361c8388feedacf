"""Host topology for D16: NUMA nodes, their CPUs and distances, and where each NIC sits, read from
sysfs; the NUMA node a memory range of this process is on; and a pure chooser of the NIC and CPUs
closest to a shard's memory.

Read (under `root`, default /sys; tests pass a fake tree):
- /devices/system/node/node<N>/cpulist   CPUs of node N ("0-3,8,10-11"; empty for memory-only nodes)
- /devices/system/node/node<N>/distance  its distances to every node, in node-id order ("10 21")
  (no node directory, a kernel without NUMA: one node 0 holding /devices/system/cpu/online)
- /class/infiniband/<dev>/device         RDMA devices (verbs, EFA); their net interfaces in device/net/
- /class/net/<iface>/device              network interfaces
  A device's NUMA node is the first `numa_node` file found walking up from its device directory
  (a virtio NIC keeps it on its PCI parent); -1 or no such file: unknown. Interfaces without a
  device link, or whose device lives under /devices/virtual (lo, bridges, veth, soft-RoCE), are
  virtual and skipped.

`choose(topology, numa_node, provider)`: the NIC of the memory's own node first, else the one on
the nearest node by distance (ties: an RDMA device before an interface, then by name), else none
(a NIC whose node is unknown is never called close); the CPUs of the nearest node that has any.
The libfabric domain is inferred where the provider's naming is known: verbs -> the RDMA device
name, efa -> "<device>-rdm", tcp / sockets -> the interface name, shm -> "shm" (no NIC).

`rail_node(provider, domain)`: the local address a rail on `domain` is bound to besides being
asked for by name (tcp: the interface's IPv4 address; verbs: that of the device's interface;
efa: none), for fabric.engine's rails.

`numa_node_of(address, length)`: the NUMA node whose memory backs a range of this process, from
the move_pages(2) query form (nodes=NULL: report, move nothing) on at most `max_pages` pages
spread over it. A page this process has not mapped yet (status -ENOENT) is looked up in the page
cache with mincore(2): resident there (a shared-memory page another process, e.g. a TP worker
rank, has written) it is mapped by reading one byte through /proc/self/mem, which allocates
nothing and cannot fault the process; not resident it is counted `untouched` and left alone
(faulting it in would commit memory on the caller's node and make the answer self-fulfilling).
The result says "unknown" (node None, with the reason) when no sampled page is resident, when
no node holds more than half of those that are, or when the kernel has no NUMA support or
refuses the call (ENOSYS, EPERM from a seccomp profile); it never guesses.

Malformed files raise TopologyError (a ValueError) naming the path and the text. Nothing here
blocks: small sysfs reads, for rail_node one ioctl per interface, and for numa_node_of at most 2
move_pages calls, `max_pages` mincore calls and `max_pages` one-byte reads of pages already in
memory (minor faults, no I/O).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

_NODE_DIR = re.compile(r"node(\d+)")


class TopologyError(ValueError):
    """A sysfs file that does not say what the kernel documents."""


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]          # ascending; empty for a memory-only node
    distances: tuple[int, ...]     # to every node of the topology, in node-id order


@dataclass(frozen=True)
class Nic:
    name: str                      # RDMA device ("mlx5_0", "rdmap16s27") or interface ("eth0")
    kind: str                      # "rdma" (class/infiniband) or "net" (class/net)
    numa_node: int | None          # None: unknown (-1 or no numa_node file)
    netdevs: tuple[str, ...] = ()  # an RDMA device's network interfaces

    def domain(self, provider: str | None) -> str | None:
        """The libfabric domain name this NIC has under `provider`, where it can be inferred."""
        core = (provider or "").split(";")[0]
        if self.kind == "rdma":
            return {"verbs": self.name, "efa": f"{self.name}-rdm"}.get(core)
        return self.name if core in ("tcp", "sockets") else None

    def serves(self, provider: str | None) -> bool:
        """Whether `provider` (None: any) runs over this NIC."""
        core = (provider or "").split(";")[0]
        if not core:
            return True
        return core in (("verbs", "efa") if self.kind == "rdma" else ("tcp", "sockets"))


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]    # by ascending id
    nics: tuple[Nic, ...]          # RDMA devices, then interfaces, each by name

    def node(self, node_id: int) -> NumaNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise ValueError(f"NUMA node {node_id} is not in this topology (nodes {[n.id for n in self.nodes]})")

    def distance(self, a: int, b: int) -> int:
        return self.node(a).distances[[n.id for n in self.nodes].index(b)]


@dataclass(frozen=True)
class Placement:
    """Where a shard whose memory is on `numa_node` should run its transfers."""

    numa_node: int
    nic: Nic | None
    domain: str | None             # libfabric domain of `nic` (or "shm"), None when not inferable
    cpus: tuple[int, ...]          # empty: no node has CPUs (never on a running kernel)
    cpu_node: int | None           # the node `cpus` belong to
    reason: str                    # why, in words (for the node's startup log)


def parse_cpulist(text: str, path: str = "<cpulist>") -> tuple[int, ...]:
    """"0-3,8,10-11" -> (0, 1, 2, 3, 8, 10, 11); "" -> (). TopologyError naming `path` otherwise."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise TopologyError(f"{path}: malformed CPU list {text.strip()!r} (at {part!r})")
        lo = int(m.group(1))
        cpus.update(range(lo, int(m.group(2) or lo) + 1))
    return tuple(sorted(cpus))


def format_cpulist(cpus) -> str:
    """(0, 1, 2, 3, 8, 10, 11) -> "0-3,8,10-11"; () -> "" (the inverse of parse_cpulist)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise TopologyError(f"{path}: not ASCII text ({e})") from e


def _int(path: Path) -> int:
    text = _read(path).strip()
    try:
        return int(text)
    except ValueError:
        raise TopologyError(f"{path}: expected an integer, found {text!r}") from None


def _numa_of(device: Path, root: Path) -> int | None:
    """The NUMA node of a device: the nearest numa_node file at or above its real directory."""
    d = Path(os.path.realpath(device))
    top = Path(os.path.realpath(root / "devices"))
    while d != top and top in d.parents:
        f = d / "numa_node"
        if f.is_file():
            v = _int(f)
            if v < -1:
                raise TopologyError(f"{f}: NUMA node {v} (expected -1 or a node id)")
            return None if v == -1 else v
        d = d.parent
    return None


def _is_virtual(device: Path, root: Path) -> bool:
    if not device.exists():
        return True
    return Path(os.path.realpath(root / "devices" / "virtual")) in Path(os.path.realpath(device)).parents


def _read_nodes(root: Path) -> tuple[NumaNode, ...]:
    base = root / "devices" / "system" / "node"
    ids = sorted(int(m.group(1)) for p in (base.iterdir() if base.is_dir() else ())
                 if (m := _NODE_DIR.fullmatch(p.name)) and p.is_dir())
    if not ids:
        online = root / "devices" / "system" / "cpu" / "online"
        cpus = parse_cpulist(_read(online), str(online)) if online.is_file() else ()
        return (NumaNode(0, cpus, (10,)),)
    nodes = []
    for i in ids:
        d = base / f"node{i}"
        cpulist = d / "cpulist"
        cpus = parse_cpulist(_read(cpulist), str(cpulist)) if cpulist.is_file() else ()
        dist_file = d / "distance"
        if dist_file.is_file():
            text = _read(dist_file).split()
            try:
                dist = tuple(int(x) for x in text)
            except ValueError:
                raise TopologyError(f"{dist_file}: expected integers, found {' '.join(text)!r}") from None
            if len(dist) != len(ids):
                raise TopologyError(f"{dist_file}: {len(dist)} distances for {len(ids)} nodes {ids}")
        else:
            dist = tuple(10 if j == i else 20 for j in ids)   # the kernel's defaults: local 10, remote 20
        nodes.append(NumaNode(i, cpus, dist))
    return tuple(nodes)


def _read_nics(root: Path, node_ids: set[int]) -> tuple[Nic, ...]:
    nics = []
    for cls, kind in (("infiniband", "rdma"), ("net", "net")):
        base = root / "class" / cls
        for entry in sorted(base.iterdir() if base.is_dir() else (), key=lambda p: p.name):
            device = entry / "device"
            if _is_virtual(device, root):
                continue
            node = _numa_of(device, root)
            if node is not None and node not in node_ids:
                raise TopologyError(f"{entry}: NIC on NUMA node {node}, which {root}/devices/system/node does "
                                    f"not list ({sorted(node_ids)})")
            netdevs = tuple(sorted(p.name for p in (device / "net").iterdir())) if (device / "net").is_dir() else ()
            nics.append(Nic(entry.name, kind, node, netdevs if kind == "rdma" else ()))
    return tuple(nics)


def read_topology(root: str | os.PathLike = "/sys") -> Topology:
    """NUMA nodes and NICs of the host whose sysfs is mounted at `root`."""
    r = Path(root)
    nodes = _read_nodes(r)
    return Topology(nodes, _read_nics(r, {n.id for n in nodes}))


def choose(topology: Topology, numa_node: int, provider: str | None = None) -> Placement:
    """The NIC (serving `provider`; None: any) and CPUs closest to memory on `numa_node`."""
    here = topology.node(numa_node)
    ids = [n.id for n in topology.nodes]
    rank = {b: (0 if b == numa_node else 1, here.distances[ids.index(b)], b) for b in ids}
    cpu_node = min((n for n in topology.nodes if n.cpus), key=lambda n: rank[n.id], default=None)
    cpus = cpu_node.cpus if cpu_node else ()
    cpu_id = cpu_node.id if cpu_node else None
    if (provider or "").split(";")[0] == "shm":
        return Placement(numa_node, None, "shm", cpus, cpu_id, "shm moves bytes through memory: no NIC")
    usable = [n for n in topology.nics if n.serves(provider)]
    known = [n for n in usable if n.numa_node is not None]
    if not known:
        unknown = [n.name for n in usable if n.numa_node is None]
        why = (f"no NIC for provider {provider!r}" if provider else "no NIC") + " with a known NUMA node"
        if unknown:
            why += f" (locality unknown: {', '.join(unknown)})"
        return Placement(numa_node, None, None, cpus, cpu_id, why)
    nic = min(known, key=lambda n: (rank[n.numa_node], n.kind != "rdma", n.name))
    where = "on the memory's node" if nic.numa_node == numa_node else \
        f"on node {nic.numa_node}, distance {here.distances[ids.index(nic.numa_node)]}: the nearest"
    return Placement(numa_node, nic, nic.domain(provider), cpus, cpu_id, f"{nic.kind} NIC {nic.name} {where}")


# --- the address that opens an endpoint on a domain -----------------------------------------------

_SIOCGIFADDR = 0x8915   # <linux/sockios.h>: an interface's primary IPv4 address


def interface_ipv4(name: str) -> str | None:
    """The primary IPv4 address of network interface `name`, None when it has none or no such
    interface exists (one ioctl on a throwaway UDP socket)."""
    import fcntl
    import socket
    import struct

    if not name or len(name.encode()) > 15:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ifreq = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(ifreq[20:24])


def rail_node(provider: str, domain: str, root: str | os.PathLike = "/sys") -> str | None:
    """The local address to bind `provider`'s endpoint on `domain` to, besides asking for the
    domain by name (fabric.engine.open_rail): tcp / sockets -> the IPv4 address of the interface
    `domain` (a tcp domain lists an entry per address family; the bind picks the IPv4 one);
    verbs -> that of the RDMA device `domain`'s first network interface (device/net/ under `root`)
    that has one. None otherwise (efa and others: chosen by the domain name alone)."""
    core = (provider or "").split(";")[0]
    if core in ("tcp", "sockets"):
        return interface_ipv4(domain)
    if core == "verbs":
        net = Path(root) / "class" / "infiniband" / domain / "device" / "net"
        for iface in sorted(p.name for p in net.iterdir()) if net.is_dir() else ():
            if (ip := interface_ipv4(iface)) is not None:
                return ip
    return None


# --- where a memory range lives -----------------------------------------------------------------

# move_pages(2) by machine: x86-64's table, and the generic one (asm-generic/unistd.h) of arm64,
# riscv64 and loongarch64. Another machine: the result is unknown, named as such.
_MOVE_PAGES = {"x86_64": 279, "aarch64": 239, "arm64": 239, "riscv64": 239, "loongarch64": 239}
MAX_SAMPLED_PAGES = 64


@dataclass(frozen=True)
class MemoryLocality:
    """Where a memory range's sampled pages are (numa_node_of)."""

    node: int | None                    # the node holding more than half of the resident sampled pages; None: unknown
    pages: tuple[tuple[int, int], ...]  # (node, sampled pages on it), by node
    sampled: int                        # pages asked about
    untouched: int                      # sampled pages not in memory yet (never written by any process)
    unmapped: int                       # sampled pages without a page to report (-EFAULT: no mapping, zero page, ...)
    reason: str                         # the answer in words


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.mincore.restype = ctypes.c_int
    return libc


def _move_pages_status(libc: ctypes.CDLL, nr: int, pages: list[int]) -> list[int] | int:
    """Each page's node or -errno (move_pages with nodes=NULL), or the call's errno when it failed."""
    arr = (ctypes.c_void_p * len(pages))(*pages)
    status = (ctypes.c_int * len(pages))()
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(0), ctypes.c_ulong(len(pages)), arr, None, status,
                      ctypes.c_int(0))
    if rc < 0:
        return ctypes.get_errno()
    return list(status)


def _unknown(sampled: int, reason: str) -> MemoryLocality:
    return MemoryLocality(None, (), sampled, 0, 0, reason)


def numa_node_of(address: int, length: int, max_pages: int = MAX_SAMPLED_PAGES) -> MemoryLocality:
    """The NUMA node backing [address, address + length) of this process (see the module docstring):
    ValueError for a non-positive address, length or max_pages; otherwise a MemoryLocality whose
    `node` is None, with the reason, whenever the pages do not say."""
    if not isinstance(address, int) or address <= 0:
        raise ValueError(f"numa_node_of: address must be a positive integer, got {address!r}")
    if not isinstance(length, int) or length <= 0:
        raise ValueError(f"numa_node_of: length must be a positive integer, got {length!r}")
    if not isinstance(max_pages, int) or max_pages < 1:
        raise ValueError(f"numa_node_of: max_pages must be >= 1, got {max_pages!r}")
    page = mmap.PAGESIZE
    first, last = address // page, (address + length - 1) // page
    count = last - first + 1
    if count <= max_pages:
        idx = list(range(count))
    else:   # evenly spread, first and last page included
        idx = sorted({round(i * (count - 1) / (max_pages - 1)) for i in range(max_pages)} if max_pages > 1 else {0})
    pages = [(first + i) * page for i in idx]
    machine = platform.machine()
    nr = _MOVE_PAGES.get(machine)
    if nr is None:
        return _unknown(len(pages), f"no move_pages(2) syscall number known for machine {machine!r}")
    libc = _libc()
    status = _move_pages_status(libc, nr, pages)
    if isinstance(status, int):
        what = {errno.ENOSYS: "the kernel has no NUMA support",
                errno.EPERM: "the call is not permitted here (a seccomp profile?)"}.get(status, os.strerror(status))
        return _unknown(len(pages), f"move_pages(2) failed with {errno.errorcode.get(status, status)}: {what}")
    absent = [i for i, s in enumerate(status) if s == -errno.ENOENT]
    if absent:
        # Not mapped in this process: map those the page cache holds (shared memory written elsewhere).
        vec = (ctypes.c_ubyte * 1)()
        resident = [i for i in absent if libc.mincore(ctypes.c_void_p(pages[i]), page, vec) == 0 and vec[0] & 1]
        if resident:
            fd = os.open("/proc/self/mem", os.O_RDONLY)
            try:
                for i in resident:
                    try:
                        os.pread(fd, 1, pages[i])
                    except OSError:   # EIO: not readable (e.g. PROT_NONE); its status stays -ENOENT
                        continue
            finally:
                os.close(fd)
            again = _move_pages_status(libc, nr, [pages[i] for i in resident])
            if isinstance(again, list):
                for i, s in zip(resident, again, strict=True):
                    status[i] = s
    per_node: dict[int, int] = {}
    for s in status:
        if s >= 0:
            per_node[s] = per_node.get(s, 0) + 1
    untouched = sum(1 for s in status if s == -errno.ENOENT)
    unmapped = len(status) - untouched - sum(per_node.values())
    held = tuple(sorted(per_node.items()))
    resident_n = sum(per_node.values())
    counts = ", ".join(f"node {n}: {c}" for n, c in held)
    if resident_n == 0:
        return MemoryLocality(None, held, len(pages), untouched, unmapped,
                              f"none of the {len(pages)} sampled pages is in memory ({untouched} never written, "
                              f"{unmapped} without a page)")
    node, top = max(per_node.items(), key=lambda kv: (kv[1], -kv[0]))
    if 2 * top <= resident_n:
        return MemoryLocality(None, held, len(pages), untouched, unmapped,
                              f"the sampled pages are spread over nodes ({counts}), none holds more than half")
    return MemoryLocality(node, held, len(pages), untouched, unmapped,
                          f"{top} of {resident_n} resident sampled pages on node {node}"
                          + (f" ({counts})" if len(held) > 1 else "")
                          + (f"; {untouched} not in memory yet" if untouched else ""))
