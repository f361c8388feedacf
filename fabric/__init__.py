"""fabric: moves bytes between registered memory regions of processes.

One-sided RDMA writes with 32-bit immediate data through libfabric
(providers: efa and verbs;ofi_rxm in production, tcp;ofi_rxm and shm
elsewhere, same code path). It knows nothing about what the bytes mean.

Public API:
    TransferEngine(config) -> register / deregister / connect / disconnect /
        write_pages / write_pages_sync / send / wait_peer_gone / close, plus
        .imm_counter
    FabricConfig, MemoryRegion, RemoteDescriptor, PeerDescriptor,
    ImmCounter, FabricError, SyncResult, TransferBackend, HostBuffer, alloc_buffer,
    alloc_tensor
"""

from fabric.backend import SyncResult, TransferBackend
from fabric.config import FabricConfig
from fabric.descriptors import PeerDescriptor, RemoteDescriptor
from fabric.errors import FabricError
from fabric.imm import ImmCounter
from fabric.memory import HostBuffer, MemoryRegion, alloc_buffer, alloc_tensor


def __getattr__(name: str):
    # The engine needs the compiled extension; import it lazily so that the
    # pure-Python parts (config, descriptors) work before the build.
    if name == "TransferEngine":
        from fabric.engine import TransferEngine

        return TransferEngine
    raise AttributeError(f"module 'fabric' has no attribute {name!r}")


__all__ = [
    "FabricConfig",
    "FabricError",
    "HostBuffer",
    "ImmCounter",
    "MemoryRegion",
    "PeerDescriptor",
    "RemoteDescriptor",
    "SyncResult",
    "TransferBackend",
    "TransferEngine",
    "alloc_buffer",
    "alloc_tensor",
]
