"""Picklable descriptors exchanged between processes (peers and regions)."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class RemoteDescriptor:
    """What a writer needs to target a registered region of another engine.

    peer: the engine owning the region.
    region_id: that engine's id for the region (unique per engine).
    base: the remote address of byte 0 as the provider expects it: the
        virtual address with FI_MR_VIRT_ADDR, 0 with offset addressing.
    key: the remote protection key.
    length: region length in bytes; writes must stay inside.
    """

    peer: PeerDescriptor
    region_id: int
    base: int
    key: int
    length: int

    def __repr__(self) -> str:
        return (
            f"RemoteDescriptor(engine={self.peer.engine_id[:8]}, region={self.region_id}, "
            f"length={self.length})"
        )
