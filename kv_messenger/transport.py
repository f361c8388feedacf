"""The transport as the nodes see it: the fabric types a node names (its endpoint's config, the
errors it reports, a peer's descriptor), re-exported so that nodes reach fabric only through
kv_messenger (the import-boundary test forbids prefill_node / decode_node -> fabric). Owns nothing."""

from fabric import FabricConfig, FabricError, PeerDescriptor, RemoteDescriptor, TransferEngine

__all__ = ["FabricConfig", "FabricError", "PeerDescriptor", "RemoteDescriptor", "TransferEngine"]
