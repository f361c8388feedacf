"""Wire format of the engine's own control messages (hello, bye, revoke, ping).

Messages are small and self-describing; each carries the sender's
PeerDescriptor so the receiver can answer. No pickle crosses the wire.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from fabric.descriptors import PeerDescriptor

MAGIC = b"PDFC"
VERSION = 1

HELLO = 1
BYE = 2
REVOKE = 3
PING = 4
PONG = 5
USER = 6
KINDS = {HELLO: "hello", BYE: "bye", REVOKE: "revoke", PING: "ping", PONG: "pong", USER: "user"}

_HEAD = struct.Struct("<4sBBQ")  # magic, version, kind, value (region id / nonce)
_PEER = struct.Struct("<HHHHqq")  # lengths: provider, address, engine_id, host_id; pid, start_time


@dataclass(frozen=True)
class ControlMessage:
    kind: int
    value: int
    sender: PeerDescriptor
    payload: bytes = b""


def encode(kind: int, value: int, sender: PeerDescriptor, payload: bytes = b"") -> bytes:
    prov = sender.provider.encode()
    eid = sender.engine_id.encode()
    hid = sender.host_id.encode()
    return b"".join(
        (
            _HEAD.pack(MAGIC, VERSION, kind, value),
            _PEER.pack(len(prov), len(sender.address), len(eid), len(hid), sender.pid, sender.start_time),
            prov,
            sender.address,
            eid,
            hid,
            payload,
        )
    )


def decode(data: bytes) -> ControlMessage:
    """Parse a control message; raises ValueError naming what is wrong."""
    if len(data) < _HEAD.size + _PEER.size:
        raise ValueError(f"control message too short: {len(data)} bytes")
    magic, version, kind, value = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"bad control header: magic={magic!r} version={version}")
    if kind not in KINDS:
        raise ValueError(f"unknown control message kind {kind}")
    lp, la, le, lh, pid, start = _PEER.unpack_from(data, _HEAD.size)
    pos = _HEAD.size + _PEER.size
    end = pos + lp + la + le + lh
    if end > len(data):
        raise ValueError(f"control message truncated: needs {end} bytes, has {len(data)}")
    prov = data[pos : pos + lp].decode()
    pos += lp
    addr = bytes(data[pos : pos + la])
    pos += la
    eid = data[pos : pos + le].decode()
    pos += le
    hid = data[pos : pos + lh].decode()
    pos += lh
    sender = PeerDescriptor(provider=prov, address=addr, engine_id=eid, host_id=hid, pid=pid, start_time=start)
    return ControlMessage(kind=kind, value=value, sender=sender, payload=bytes(data[pos:]))
