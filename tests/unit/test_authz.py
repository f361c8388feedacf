"""prefill_node.authz and fabric's address checks, in process (S9): who may make a prefill node
write. The cluster test (tests/integration/test_security.py) covers shm end to end; this covers
every rule, tcp addresses included.

Evidence: without mTLS only the "memory is the peer's" rule applies; with it, decode_node_id must
be one of the certificate's names, a tcp peer's fabric IP must equal the gRPC caller's (IPv4-mapped
IPv6 callers included), an efa peer (no IP in its name) passes on the certificate alone; an abort
fence must target the transfer's engine and come from the identity bound by its Prefills.
"""

from __future__ import annotations

import socket
import struct

import pytest

from fabric import PeerDescriptor, RemoteDescriptor
from fabric.descriptors import check_address
from fabric.liveness import host_id
from kv_messenger import KvLayout, TransferTicket
from kv_messenger.ticket import TransferKey
from pdserve.serving.channels import CallerIdentity, is_local_address
from prefill_node.authz import PeerBindings, PermissionDeniedError, authorize_abort, authorize_prefill
from prefill_node.service import AbortSpec, PrefillSpec

OWN = PeerDescriptor("tcp;ofi_rxm", b"\x02\x00" + b"\x00" * 14, "p" * 32, host_id(), 1, 1)


def _tcp(ip: str, engine: str = "d") -> PeerDescriptor:
    name = struct.pack("=H", socket.AF_INET) + struct.pack(">H", 5000) + socket.inet_aton(ip) + b"\x00" * 8
    return PeerDescriptor("tcp;ofi_rxm", name, engine * 32, "host-b/pid:[1]", 7, 7)


def _spec(peer: PeerDescriptor, kv_owner: PeerDescriptor | None = None) -> PrefillSpec:
    layout = KvLayout(num_layers=2, num_pages=8, kv_heads=1, page_size=16, head_dim=8, dtype="float32")
    ticket = TransferTicket(request_id="r", kv=RemoteDescriptor(kv_owner or peer, 1, 0, 1, 1 << 20), layout=layout,
                            dst_pages=(0,), context=RemoteDescriptor(peer, 2, 0, 2, 1 << 16), context_offset=0,
                            imm_tag=3, expected_writes=3, num_prefill_tokens=4)
    return PrefillSpec(request_id="r", token_ids=[1, 2, 3, 4], target=ticket, peer=peer)


def test_prefill_rules():
    peer = _tcp("10.0.0.2")
    plain = CallerIdentity(frozenset(), "10.9.9.9")
    authorize_prefill(plain, "", _spec(peer), OWN)   # no mTLS: no identity to check
    with pytest.raises(PermissionDeniedError, match="the KV memory belongs to fabric engine eeeeeeee"):
        authorize_prefill(plain, "", _spec(peer, kv_owner=_tcp("10.0.0.2", "e")), OWN)
    decode = CallerIdentity(frozenset({"decode-1"}), "10.0.0.2")
    authorize_prefill(decode, "decode-1", _spec(peer), OWN)
    authorize_prefill(CallerIdentity(decode.names, "::ffff:10.0.0.2"), "decode-1", _spec(peer), OWN)
    with pytest.raises(PermissionDeniedError, match=r"decode_node_id 'decode-2' is not the caller's certificate"):
        authorize_prefill(decode, "decode-2", _spec(peer), OWN)
    with pytest.raises(PermissionDeniedError, match=r"decode_node_id '' is not"):
        authorize_prefill(decode, "", _spec(peer), OWN)
    with pytest.raises(PermissionDeniedError, match=r"called from '10.0.0.3' but its fabric endpoint is at 10.0.0.2"):
        authorize_prefill(CallerIdentity(decode.names, "10.0.0.3"), "decode-1", _spec(peer), OWN)
    efa = PeerDescriptor("efa", b"\x01" * 32, "d" * 32, "host-b/pid:[1]", 7, 7)
    authorize_prefill(decode, "decode-1", _spec(efa), OWN)   # no IP in an efa name: the certificate decides


def test_abort_rules():
    decode, bindings = _tcp("10.0.0.2"), PeerBindings(capacity=2)
    key = TransferKey(decode.engine_id, "r", 0)
    me = CallerIdentity(frozenset({"decode-1"}), "10.0.0.2")
    other = CallerIdentity(frozenset({"decode-2"}), "10.0.0.5")
    authorize_abort(other, AbortSpec(key, OWN.engine_id), bindings)   # nothing bound yet
    bindings.bind(decode.engine_id, "decode-1")
    authorize_abort(me, AbortSpec(key, OWN.engine_id), bindings)
    with pytest.raises(PermissionDeniedError, match="belong to decode node 'decode-1'"):
        authorize_abort(other, AbortSpec(key, OWN.engine_id), bindings)
    fence = RemoteDescriptor(_tcp("10.0.0.2", "e"), 9, 0, 9, 8)
    with pytest.raises(PermissionDeniedError, match="the fence region belongs to fabric engine eeeeeeee"):
        authorize_abort(CallerIdentity(frozenset(), None), AbortSpec(key, OWN.engine_id, 5, fence), bindings)
    for e in ("x", "y"):   # bounded: the oldest binding is forgotten
        bindings.bind(e * 32, "decode-9")
    assert bindings.node_of(decode.engine_id) is None


def test_address_checks_and_local_hosts():
    good = _tcp("127.0.0.1").address
    check_address("tcp;ofi_rxm", good, 16)
    with pytest.raises(ValueError, match="of 8 bytes: its address family needs 16"):
        check_address("tcp;ofi_rxm", good[:8], 16)
    check_address("shm", b"fi_shm://12:0:0\0", 18)
    with pytest.raises(ValueError, match="not one NUL-terminated string"):
        check_address("shm", b"fi_shm://12:0:0", 18)
    with pytest.raises(ValueError, match="efa endpoint name of 31 bytes: this provider's are 32"):
        check_address("efa", b"\0" * 31, 32)
    assert _tcp("10.1.2.3").ip_address() == "10.1.2.3"
    assert PeerDescriptor("shm", b"fi_shm://1\0", "x", "h", 1, 1).ip_address() is None
    assert is_local_address("127.0.0.1") and is_local_address("::1")
    assert not is_local_address("192.0.2.1") and not is_local_address("not-an-ip")
