"""Picklable descriptors exchanged between processes (peers and regions), and the checks an
endpoint name from the network passes before it reaches fi_av_insert (``check_address``)."""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

ADDR_MAX = 256  # the longest endpoint name (PDF_ADDR_MAX in csrc/pdf_core.h)
_SOCKADDR_SIZES = {socket.AF_INET: 16, socket.AF_INET6: 28}  # sockaddr_in, sockaddr_in6


def _sockaddr_provider(provider: str) -> bool:
    """Providers whose endpoint names are a struct sockaddr (tcp, and verbs / sockets under rxm)."""
    core = provider.split(";")[0]
    return core in ("tcp", "verbs", "sockets", "udp")


def check_address(provider: str, address: bytes, own_length: int) -> None:
    """Raise ValueError naming the problem if ``address`` cannot be an endpoint name of
    ``provider`` (whose names this endpoint's are ``own_length`` bytes long): shm names are
    NUL-terminated strings of at most ADDR_MAX bytes; sockaddr names (tcp, verbs) have the size
    their address family says; other providers' names have exactly this endpoint's length."""
    n = len(address)
    if not 1 <= n <= ADDR_MAX:
        raise ValueError(f"endpoint name of {n} bytes: expected 1..{ADDR_MAX}")
    if provider == "shm":
        if address[-1] != 0 or address.index(0) != n - 1:
            raise ValueError(f"shm endpoint name of {n} bytes is not one NUL-terminated string")
        return
    if _sockaddr_provider(provider):
        if n < 2:
            raise ValueError(f"{provider} endpoint name of {n} bytes: too short for a sockaddr")
        family = struct.unpack_from("=H", address)[0]
        want = _SOCKADDR_SIZES.get(family)
        if want is None:
            raise ValueError(f"{provider} endpoint name has address family {family}, not IPv4 or IPv6")
        if n != want:
            raise ValueError(f"{provider} endpoint name of {n} bytes: its address family needs {want}")
        return
    if n != own_length:
        raise ValueError(f"{provider} endpoint name of {n} bytes: this provider's are {own_length}")


@dataclass(frozen=True)
class PeerDescriptor:
    """Everything another process needs to reach an engine's endpoint.

    provider: the provider both sides must use.
    address: raw endpoint name from fi_getname (for fi_av_insert).
    engine_id: unique id of that engine instance (never reused).
    host_id: boot id of the engine's host (same value: same kernel).
    pid, start_time: the owning process and its start time in clock ticks,
        so that a peer on the same host can tell when it is gone.
    """

    provider: str
    address: bytes
    engine_id: str
    host_id: str
    pid: int
    start_time: int

    def __repr__(self) -> str:
        return f"PeerDescriptor({self.provider}, engine={self.engine_id[:8]}, pid={self.pid})"

    def ip_address(self) -> str | None:
        """The IP address in the endpoint name of a sockaddr provider (tcp, verbs), else None."""
        if not _sockaddr_provider(self.provider) or len(self.address) < 2:
            return None
        family = struct.unpack_from("=H", self.address)[0]
        if family == socket.AF_INET and len(self.address) >= 8:
            return str(ipaddress.IPv4Address(self.address[4:8]))
        if family == socket.AF_INET6 and len(self.address) >= 24:
            return str(ipaddress.IPv6Address(self.address[8:24]))
        return None


@dataclass(frozen=True)
class RemoteDescriptor:
    """What a writer needs to target a registered region of another engine.

    peer: the engine owning the region.
    region_id: that engine's id for the region (unique per engine).
    base: the remote address of byte 0 as the provider expects it: the
        virtual address with FI_MR_VIRT_ADDR, 0 with offset addressing.
    key: the remote protection key.
    length: region length in bytes; writes must stay inside.
    rkey: the packed remote key (ucp_rkey_pack) of a UCX region; b"" for libfabric, whose key is
        ``key``.
    """

    peer: PeerDescriptor
    region_id: int
    base: int
    key: int
    length: int
    rkey: bytes = b""

    def __repr__(self) -> str:
        return (
            f"RemoteDescriptor(engine={self.peer.engine_id[:8]}, region={self.region_id}, "
            f"length={self.length})"
        )
