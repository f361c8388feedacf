"""Registered memory: the local MemoryRegion handle and how a buffer is addressed.

fabric registers memory it is handed and never allocates it: the owner (the
engine's KV pool, the KV messenger's staging buffers: pdserve.engine.cache.hostmem)
passes a writable buffer-protocol object, or the (address, length) of memory it
keeps alive itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fabric.descriptors import RemoteDescriptor

__all__ = ["MemoryRegion", "buffer_address"]


@dataclass(eq=False)
class MemoryRegion:
    """A local registration (fi_mr_reg) owned by one TransferEngine.

    Only the owning engine may use it; it is not picklable (send
    ``descriptor`` to other processes instead). The registered memory must
    stay alive and must not move until ``TransferEngine.deregister``; when it
    was registered from a buffer object, the region keeps that object alive.
    """

    engine_id: str
    region_id: int
    address: int
    length: int
    key: int
    descriptor: RemoteDescriptor
    _desc: int = field(repr=False)
    _mr: int = field(repr=False)
    _keepalive: Any = field(default=None, repr=False)
    closed: bool = False
    inflight: int = 0
    rail: int = 0  # the engine's endpoint it is registered on (TransferEngine.rails); writes from it post there

    def __reduce__(self):
        raise TypeError("MemoryRegion is a local handle; send region.descriptor to other processes")


def buffer_address(obj: Any) -> tuple[int, int, Any]:
    """(address, length, keepalive) of an object exposing a writable buffer.

    Accepts bytearray, mmap, memoryview (e.g. a host buffer's ``view``), numpy
    arrays (C-contiguous) and anything else with the buffer protocol. Tensors
    without the buffer protocol are registered by (address, length) instead
    (``data_ptr()``, ``nbytes``).
    """
    from fabric._libfabric import ffi

    try:
        view = memoryview(obj)
    except TypeError as exc:
        raise TypeError(
            f"cannot register {type(obj).__name__}: no buffer protocol; pass a buffer "
            "(a host buffer's .view) or register by address=..., length=... instead"
        ) from exc
    if view.readonly:
        raise ValueError(f"cannot register {type(obj).__name__}: buffer is read-only")
    if not view.c_contiguous:
        raise ValueError(f"cannot register {type(obj).__name__}: buffer is not contiguous")
    if view.nbytes == 0:
        raise ValueError(f"cannot register {type(obj).__name__}: buffer is empty (0 bytes)")
    cdata = ffi.from_buffer(obj, require_writable=True)
    address = int(ffi.cast("uintptr_t", cdata))
    return address, view.nbytes, (obj, cdata)
