"""Who may make a prefill node write (S9): a Prefill writes only into the memory of the decode node
that asked.

`authorize_prefill(caller, decode_node_id, spec, own)` raises PermissionDeniedError (the call
answers PERMISSION_DENIED) unless:
- the KV and context descriptors name the same fabric engine as the request's peer (always: the
  writes go to the descriptors' engine, the connect to the peer's); a decode rank's KV may name
  another endpoint (rail, D16) of that same engine, the context never;
- with mTLS (the caller presented a certificate the CA signed), `decode_node_id` is one of the
  certificate's names (common name or DNS SAN), and the peer's fabric address is the caller's
  own: for tcp-based providers the fabric address's IP (and every KV rail's) equals the gRPC
  caller's, so a rail on another NIC is refused under mTLS; for shm the peer
  is on this host (same host id) and the caller called from an address of this host. Other
  providers' addresses (efa, verbs) carry no IP to compare; only the certificate is checked.

`authorize_abort(caller, spec, bindings)` does the same for AbortPrefill, whose delivery fence is
a write too: the fence region must belong to the transfer's decode engine (always), and under mTLS
the caller must hold the identity that engine's Prefills were authorized under (`PeerBindings`:
decode fabric engine id -> decode node id, bound by each authorized Prefill, the last
REMEMBERED_BINDINGS engines).

Without mTLS there is no identity to check: a network that reaches the prefill node's gRPC port
can make it write into any decode node it can reach (README, "Security posture").
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from dataclasses import replace

import grpc

from kv_messenger.prefill_transfers import AbortSpec
from kv_messenger.transport import PeerDescriptor
from pdserve.serving.channels import CallerIdentity, is_local_address
from pdserve_api.servers import StatusError
from prefill_node.service import PrefillSpec

REMEMBERED_BINDINGS = 4096   # decode engines whose certificate identity is remembered


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
    t = spec.target
    tp = t.sharding.tp_size
    memories = [("KV memory" + (f" of decode rank {r}" if tp > 1 else ""), t.rank_kv(r).peer) for r in range(tp)]
    for what, target in memories + [("context memory", t.context.peer)]:
        # a decode rank's memory may sit on another rail (endpoint) of the same engine (D16, fabric.engine)
        if replace(target, address=peer.address) != peer or (what == "context memory" and target != peer):
            raise PermissionDeniedError(f"request {rid}: the {what} belongs to fabric engine "
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
    for what, target in [("fabric endpoint", peer)] + [(f"{w}'s fabric endpoint", m) for w, m in memories]:
        ip = target.ip_address()
        if ip is None:
            continue   # no IP in this provider's addresses: the certificate is the check
        if caller.host is None or not _same_ip(ip, caller.host):
            raise PermissionDeniedError(f"request {rid}: decode node {decode_node_id!r} called from {caller.host!r} "
                                        f"but its {what} is at {ip} (bind it to the address it calls from: "
                                        f"--fabric-node; a rail on another NIC cannot be tied to the caller)")


class PeerBindings:
    """Which decode node id (certificate identity) each decode fabric engine's Prefills were
    authorized under; bounded (the oldest engines are forgotten). The serving loop only."""

    def __init__(self, capacity: int = REMEMBERED_BINDINGS) -> None:
        self._capacity = capacity
        self._by_engine: OrderedDict[str, str] = OrderedDict()

    def bind(self, decode_engine_id: str, decode_node_id: str) -> None:
        self._by_engine[decode_engine_id] = decode_node_id
        self._by_engine.move_to_end(decode_engine_id)
        while len(self._by_engine) > self._capacity:
            self._by_engine.popitem(last=False)

    def node_of(self, decode_engine_id: str) -> str | None:
        return self._by_engine.get(decode_engine_id)


def authorize_abort(caller: CallerIdentity, spec: AbortSpec, bindings: PeerBindings) -> None:
    """Raise PermissionDeniedError naming the mismatch (see the module docstring)."""
    key = spec.key
    if spec.fence_region is not None and spec.fence_region.peer.engine_id != key.decode_engine_id:
        raise PermissionDeniedError(f"abort of {key.request_id}: the fence region belongs to fabric engine "
                                    f"{spec.fence_region.peer.engine_id[:8]}, not to the transfer's decode engine "
                                    f"{key.decode_engine_id[:8]}")
    if not caller.authenticated:
        return
    owner = bindings.node_of(key.decode_engine_id)
    if owner is not None and owner not in caller.names:
        raise PermissionDeniedError(f"abort of {key.request_id}: the transfers of decode engine "
                                    f"{key.decode_engine_id[:8]} belong to decode node {owner!r}, not to the "
                                    f"caller's certificate identity {sorted(caller.names)}")
