"""The transport as the nodes see it: the fabric types a node names (its endpoint's config, the
errors it reports, a peer's descriptor, a registration, a socket shutdown's result), re-exported so
that nodes reach fabric only through kv_messenger (the import-boundary test forbids prefill_node /
decode_node -> fabric), and `open_transfer_engine`, which builds a node's endpoint. Owns nothing."""

from fabric import FabricConfig, FabricError, MemoryRegion, PeerDescriptor, RemoteDescriptor, TransferEngine
from fabric.sockets import SocketShutdown

__all__ = ["FabricConfig", "FabricError", "MemoryRegion", "PeerDescriptor", "RemoteDescriptor", "SocketShutdown",
           "TransferEngine", "open_transfer_engine"]


def open_transfer_engine(provider: str | None, node: str | None,
                         close_timeout_s: float = FabricConfig.close_timeout_s) -> TransferEngine:
    """A node's fabric endpoint: libfabric `provider` (None: $FI_PROVIDER or the default), bound to
    the local address `node` (None: the provider's choice); `close_timeout_s`: how long its close
    waits for outstanding writes. Close it with `TransferEngine.close`."""
    return TransferEngine(FabricConfig(provider=provider, node=node, close_timeout_s=close_timeout_s))
