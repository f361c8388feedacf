"""Which network devices a UcxBackend's UCX context uses: UCX_NET_DEVICES from FabricConfig.node.

UCX takes every interface by default; a config that names a local address (``node``, e.g.
"127.0.0.1" or a namespace's veth address) gets the interface holding it, so its worker address
carries only that interface (as libfabric's tcp binds to ``node``). An explicit UCX_NET_DEVICES
in the environment wins; an address held by no interface is refused (ValueError naming it).
Reads the interface addresses with SIOCGIFADDR (IPv4); never blocks.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

_SIOCGIFADDR = 0x8915


def _ipv4_of(sock: socket.socket, name: str) -> str | None:
    try:
        got = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None   # no IPv4 address on it
    return socket.inet_ntoa(got[20:24])


def interface_of(address: str) -> str | None:
    """The interface holding IPv4 ``address``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            if _ipv4_of(sock, name) == address:
                return name
    return None


def net_devices(node: str | None) -> str:
    """UCX_NET_DEVICES for ``node`` ("" : UCX's default or the environment's setting)."""
    if os.environ.get("UCX_NET_DEVICES") or node is None:
        return ""
    try:
        ipaddress.IPv4Address(node)
    except ValueError as exc:
        raise ValueError(f"node={node!r}: the ucx provider takes an IPv4 address of this host") from exc
    name = interface_of(node)
    if name is None:
        raise ValueError(f"node={node!r}: no interface of this host has that address")
    return name
