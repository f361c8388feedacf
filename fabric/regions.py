"""RegionTable: this engine's memory registrations (fi_mr_reg) and the ones it revoked.

fabric registers memory it is handed and never allocates it (fabric.memory). A region is
valid only on the engine that registered it; peers address it through its RemoteDescriptor.
Deregistering marks the region stale process-wide (fabric.stale) and remembers it, so that
engines shaking hands later are told (fabric.protocol sends those REVOKE messages).

Threads: any thread may register and deregister; the progress thread reads the revoked list
(``revoked_here``) when a peer says hello. No waits: the engine lock is held only around the
table updates.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from fabric import stale
from fabric._libfabric import ffi, lib
from fabric.descriptors import RemoteDescriptor
from fabric.endpoint import Endpoint
from fabric.errors import FabricError
from fabric.memory import MemoryRegion, buffer_address

logger = logging.getLogger(__name__)

_MAX_REVOKED_TOLD = 1024  # deregistered regions told to engines that shake hands later


class RegionTable:
    """The registrations of one endpoint."""

    def __init__(self, ep: Endpoint) -> None:
        self._ep = ep
        self._regions: dict[int, MemoryRegion] = {}
        self._revoked_here: OrderedDict[int, None] = OrderedDict()  # our deregistered regions, oldest first

    def register(
        self, buffer: object | None = None, *, address: int | None = None, length: int | None = None
    ) -> MemoryRegion:
        """Register ``buffer`` (writable buffer protocol) or raw ``address``/``length``."""
        ep = self._ep
        ep.check_open()
        if buffer is not None:
            if address is not None or length is not None:
                raise ValueError("register: pass either a buffer or address/length, not both")
            addr, nbytes, keepalive = buffer_address(buffer)
        else:
            if not isinstance(address, int) or address <= 0:
                raise ValueError(f"register: address={address!r}: expected a positive int")
            if not isinstance(length, int) or length <= 0:
                raise ValueError(f"register: length={length!r}: expected a positive int")
            addr, nbytes, keepalive = address, length, None
        key = ffi.new("uint64_t *")
        desc = ffi.new("uint64_t *")
        mr = ffi.new("uint64_t *")
        rc = lib.pdf_mr_reg(ep.h, addr, nbytes, key, desc, mr)
        if rc:
            raise FabricError(rc, f"fi_mr_reg(address=0x{addr:x}, length={nbytes})")
        region_id = ep.next_id()
        base = addr if ep.mr_mode & lib.FI_MR_VIRT_ADDR else 0
        remote = RemoteDescriptor(peer=ep.me, region_id=region_id, base=base, key=int(key[0]), length=nbytes)
        region = MemoryRegion(
            engine_id=ep.engine_id, region_id=region_id, address=addr, length=nbytes, key=int(key[0]),
            descriptor=remote, _desc=int(desc[0]), _mr=int(mr[0]), _keepalive=keepalive, rail=ep.rail,
        )
        with ep.lock:
            self._regions[region_id] = region
        logger.debug("registered region %d: %d bytes at 0x%x key=%d", region_id, nbytes, addr, region.key)
        return region

    def check(self, region: MemoryRegion, what: str) -> None:
        """Raise unless ``region`` is a live registration of this endpoint."""
        if not isinstance(region, MemoryRegion):
            raise TypeError(f"{what}: expected a MemoryRegion, got {type(region).__name__}")
        if region.engine_id != self._ep.engine_id:
            raise FabricError(
                lib.FI_EINVAL,
                f"{what}: region {region.region_id} belongs to engine {region.engine_id[:8]}, "
                f"not {self._ep.engine_id[:8]}",
            )
        if region.rail != self._ep.rail:
            raise FabricError(lib.FI_EINVAL, f"{what}: region {region.region_id} is on rail {region.rail}, "
                                             f"not {self._ep.rail}")
        if region.closed:
            raise FabricError(lib.FI_ENOENT, f"{what}: region {region.region_id} is deregistered")

    def deregister(self, region: MemoryRegion) -> None:
        """Close the registration and mark it stale; the caller tells the peers (REVOKE)."""
        ep = self._ep
        self.check(region, "deregister")
        with ep.lock:
            if region.inflight:
                raise FabricError(
                    lib.FI_EBUSY, f"deregister region {region.region_id}: {region.inflight} write batches in flight"
                )
            region.closed = True
            del self._regions[region.region_id]
            self._revoked_here[region.region_id] = None
            while len(self._revoked_here) > _MAX_REVOKED_TOLD:
                self._revoked_here.popitem(last=False)
        stale.mark_region_revoked(ep.engine_id, region.region_id)
        rc = lib.pdf_mr_close(ep.h, region._mr)
        region._keepalive = None
        if rc:
            raise FabricError(rc, f"fi_close(mr of region {region.region_id})")

    def revoked_here(self) -> list[int]:
        """Ids of the regions this engine deregistered (the most recent _MAX_REVOKED_TOLD), oldest first."""
        with self._ep.lock:
            return list(self._revoked_here)

    def close_all(self) -> None:
        """Close every registration left (at engine close, after the endpoint itself closed)."""
        with self._ep.lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for region in regions:
            region.closed = True
            rc = lib.pdf_mr_close(self._ep.h, region._mr)
            if rc:
                logger.warning("%s", FabricError(rc, f"fi_close(mr of region {region.region_id})"))
            region._keepalive = None
