"""The kernel TCP sockets that carry this process's fabric connections (tcp;ofi_rxm), and ending
them from outside libfabric: `TransferEngine.shut_down_sockets` (the decode side's key rotation,
kv_messenger.decode.rotation; docs/transfer-safety.md). Called from a worker thread of the caller's.

Why not `TransferEngine.close_connection`: its fi_av_remove crashes libfabric 1.17's rxm when a
connection has a write half received (docs/transfer-safety.md), which is exactly the state a stalled
prefill process leaves behind. Here the socket itself is shut down (shutdown(2), SHUT_RDWR, through
a duplicate of the provider's descriptor, checked to still name the same socket): our FIN goes out
and the provider reads end-of-stream, which it handles as a peer that went away (the path a
SIGKILLed peer takes) and closes its descriptor. What the shutdown guarantees, Linux TCP: a
segment that arrives after it with new data is answered with a reset, never queued (a socket whose
receive side is shut, in FIN_WAIT, see tcp_rcv_state_process), so only bytes that arrived before it
can still be read; once the provider closed its descriptor (`open_inodes` no longer names the
socket) nothing more of that connection is ever read into our memory.

Which sockets: every TCP socket of this process, other than a listening one, whose local port is one
of our fabric endpoints' ports (the connections peers opened to us) or whose remote address is a
known peer's fabric endpoint (the ones we opened). gRPC sockets use other ports.

Bounds: reads of /proc/self/fd and /proc/self/net/tcp{,6}; shutdown(2) does not block. Nothing here
waits (the caller polls `SocketShutdown.still_open`, or `open_inodes`).

(Moved here from decode_node/fabric_sockets.py, issue 30: socket shutdown is a fabric operation.)
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TCP_LISTEN = 0x0A   # /proc/net/tcp's state of a listening socket


@dataclass(frozen=True)
class Endpoint:
    """An IP address and TCP port."""

    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process, as /proc shows it."""

    fd: int
    inode: int
    local: Endpoint
    remote: Endpoint
    state: int


def endpoint_of(address: bytes) -> Endpoint | None:
    """The IP and port of a tcp provider's fabric address (a struct sockaddr_in or sockaddr_in6,
    as fi_getname gives it); None for any other format (shm, efa)."""
    if len(address) >= 16 and struct.unpack_from("=H", address)[0] == socket.AF_INET:
        return Endpoint(ipaddress.IPv4Address(address[4:8]), struct.unpack_from("!H", address, 2)[0])
    if len(address) >= 28 and struct.unpack_from("=H", address)[0] == socket.AF_INET6:
        return Endpoint(ipaddress.IPv6Address(address[8:24]), struct.unpack_from("!H", address, 2)[0])
    return None


def _proc_endpoint(field: str) -> Endpoint:
    """/proc/net/tcp{,6}'s "HEXADDR:HEXPORT" (the address in 32-bit words of host byte order)."""
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    words = b"".join(struct.pack("=I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return Endpoint(ip, int(port, 16))


def _socket_inodes() -> dict[int, int]:
    """Socket inode -> one of this process's descriptors for it."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:   # closed meanwhile
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def own_tcp_sockets() -> list[TcpSocket]:
    """Every TCP socket this process holds a descriptor of."""
    fds = _socket_inodes()
    out = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:   # no IPv6 in this kernel
            continue
        for line in lines:
            cols = line.split()
            inode = int(cols[9])
            if inode in fds:
                out.append(TcpSocket(fds[inode], inode, _proc_endpoint(cols[1]), _proc_endpoint(cols[2]),
                                     int(cols[3], 16)))
    return out


def fabric_sockets(own: set[Endpoint], peers: set[Endpoint]) -> list[TcpSocket]:
    """The connections of our fabric endpoints `own` (module docstring); listening sockets excluded."""
    own_ports = {e.port for e in own}
    return [s for s in own_tcp_sockets() if s.state != TCP_LISTEN
            and (s.local.port in own_ports or s.remote in peers)]


def shut_down(sockets: list[TcpSocket]) -> set[int]:
    """shutdown(SHUT_RDWR) each socket (through a duplicate descriptor, checked to be the same socket:
    the provider may have closed and reused the number meanwhile); the inodes shut down."""
    done: set[int] = set()
    for s in sockets:
        try:
            dup = os.dup(s.fd)
        except OSError:   # closed meanwhile: nothing left to shut
            continue
        try:
            st = os.fstat(dup)
            if not stat.S_ISSOCK(st.st_mode) or st.st_ino != s.inode:
                continue   # the number names another file now
            sock = socket.socket(fileno=dup)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done.add(s.inode)
            except OSError as e:   # ENOTCONN: already reset or shut; the provider closes it either way
                logger.info("shutdown of fabric socket %s -> %s: %s", s.local, s.remote, e)
                done.add(s.inode)
            finally:
                sock.detach()
        finally:
            os.close(dup)
    return done


def open_inodes(inodes: set[int]) -> set[int]:
    """Those of `inodes` that this process still holds a descriptor of."""
    return inodes & set(_socket_inodes())


@dataclass(frozen=True)
class SocketShutdown:
    """The fabric sockets one `TransferEngine.shut_down_sockets` shut down (their inodes)."""

    inodes: frozenset[int]

    def still_open(self) -> set[int]:
        """Those this process still holds a descriptor of (the provider has not closed them yet)."""
        return open_inodes(set(self.inodes))
