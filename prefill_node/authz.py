"""Who may make a prefill node write (S9): a Prefill writes only into the memory of the decode node
that asked.

`authorize_prefill(caller, decode_node_id, spec, own)` raises PermissionDeniedError (the call
answers PERMISSION_DENIED) unless:
- the KV and context descriptors name the same fabric engine as the request's peer (always: the
  writes go to the descriptors' engine, the connect to the peer's);
- with mTLS (the caller presented a certificate the CA signed), `decode_node_id` is one of the
  certificate's names (common name or DNS SAN), and the peer's fabric address is the caller's
  own: for tcp-based providers the fabric address's IP equals the gRPC caller's; for shm the peer
  is on this host (same host id) and the caller called from an address of this host. Other
  providers' addresses (efa, verbs) carry no IP to compare; only the certificate is checked.

Without mTLS there is no identity to check: a network that reaches the prefill node's gRPC port
can make it write into any decode node it can reach (README, "Security posture").
"""

from __future__ import annotations

import ipaddress

import grpc

from fabric import PeerDescriptor
from pdserve.serving.channels import CallerIdentity, is_local_address
from pdserve_api.servers import StatusError
from prefill_node.service import PrefillSpec


class PermissionDeniedError(StatusError):
    """The caller may not ask for this prefill."""

    code = grpc.StatusCode.PERMISSION_DENIED


def _same_ip(a: str, b: str) -> bool:
    try:
        x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return False
    if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped is not None:
        x = x.ipv4_mapped
    if isinstance(y, ipaddress.IPv6Address) and y.ipv4_mapped is not None:
        y = y.ipv4_mapped
    return x == y


def authorize_prefill(caller: CallerIdentity, decode_node_id: str, spec: PrefillSpec, own: PeerDescriptor) -> None:
    """Raise PermissionDeniedError naming the mismatch (see the module docstring)."""
    rid, peer = spec.request_id, spec.peer
    for what, target in (("KV", spec.target.kv.peer), ("context", spec.target.context.peer)):
        if target.engine_id != peer.engine_id or target.address != peer.address:
            raise PermissionDeniedError(f"request {rid}: the {what} memory belongs to fabric engine "
                                        f"{target.engine_id[:8]}, not to the requesting peer {peer.engine_id[:8]}")
    if not caller.authenticated:
        return
    if not decode_node_id or decode_node_id not in caller.names:
        raise PermissionDeniedError(f"request {rid}: decode_node_id {decode_node_id!r} is not the caller's "
                                    f"certificate identity {sorted(caller.names)}")
    if peer.provider == "shm":
        if peer.host_id != own.host_id:
            raise PermissionDeniedError(f"request {rid}: shm peer of decode node {decode_node_id!r} is on another "
                                        f"host ({peer.host_id!r}, this node {own.host_id!r})")
        if caller.host is None or not is_local_address(caller.host):
            raise PermissionDeniedError(f"request {rid}: decode node {decode_node_id!r} called from "
                                        f"{caller.host!r}, not from this host, but names an shm peer")
        return
    ip = peer.ip_address()
    if ip is None:
        return   # no IP in this provider's addresses: the certificate is the check
    if caller.host is None or not _same_ip(ip, caller.host):
        raise PermissionDeniedError(f"request {rid}: decode node {decode_node_id!r} called from {caller.host!r} "
                                    f"but its fabric endpoint is at {ip} (bind it to the address it calls from: "
                                    f"--fabric-node)")
