"""fabric: moves bytes between registered memory regions of processes.

One-sided RDMA writes with 32-bit immediate data through libfabric
(providers: efa and verbs;ofi_rxm in production, tcp;ofi_rxm and shm
elsewhere, same code path). It knows nothing about what the bytes mean,
imports nothing else of this repository, and never allocates the memory it
registers (the engine owns its KV pool: pdserve.engine.cache.hostmem).

Public API (the only names other packages import):
    TransferEngine(config) -> register / deregister / connect / disconnect /
        write / write_sync (one PageWrites batch; write_pages / write_pages_sync:
        the deprecated positional forms) / send / wait_peer_gone / close, plus
        .imm_counter and stats(); open_rail(domain) / rails: one endpoint per NIC
        domain, a region registered on one (D16)
    open_backend(config) -> the TransferBackend the config's provider selects: TransferEngine
        (libfabric) or fabric.ucx.UcxBackend (provider "ucx", issue 32); both implement
        fabric.backend.TransferBackend, the seam typed once
    PageWrites (a batch of page writes, the request typed once),
    FabricConfig, FabricError, MemoryRegion, RemoteDescriptor, PeerDescriptor,
    ImmCounter, IMM_TAG_MAX (the largest immediate-data tag)
    fabric.topology: the host's NUMA nodes and NIC locality from /sys,
        numa_node_of(address, length), choose() (D16; used by
        kv_messenger.placement and `pdserve topology`)

Inside (only fabric's own tests name these): backend
(TransferBackend, the transport interface a second backend implements, and
its ownership / threading rules; SyncResult, what write_sync returns), engine (the facade),
endpoint, environment (the FI_* variables a config asks of libfabric),
regions, writes, peers, protocol, control (wire format), stale, imm,
memory, liveness, shmclean, errors.
"""

from fabric.backend import PageWrites
from fabric.config import FabricConfig
from fabric.descriptors import PeerDescriptor, RemoteDescriptor
from fabric.errors import FabricError
from fabric.imm import IMM_TAG_MAX, ImmCounter
from fabric.memory import MemoryRegion


def open_backend(config: FabricConfig | None = None, *, on_message=None):
    """The TransferBackend ``config`` selects: fabric.ucx.UcxBackend for provider "ucx"
    ($FI_PROVIDER=ucx included), else the libfabric TransferEngine. ``on_message(peer, payload)``
    as for either."""
    config = config or FabricConfig()
    if config.resolved_provider() == "ucx":
        from fabric.ucx import UcxBackend

        return UcxBackend(config, on_message=on_message)
    from fabric.engine import TransferEngine

    return TransferEngine(config, on_message=on_message)


def __getattr__(name: str):
    # The engine needs the compiled extension; import it lazily so that the
    # pure-Python parts (config, descriptors) work before the build.
    if name == "TransferEngine":
        from fabric.engine import TransferEngine

        return TransferEngine
    raise AttributeError(f"module 'fabric' has no attribute {name!r}")


__all__ = [
    "IMM_TAG_MAX",
    "FabricConfig",
    "FabricError",
    "ImmCounter",
    "MemoryRegion",
    "PageWrites",
    "PeerDescriptor",
    "RemoteDescriptor",
    "TransferEngine",
    "open_backend",
]
