"""S9 on a real cluster: 1 prefill + 1 decode node + the router, every process serving mTLS and
checking a shared token (Cluster(tls=True, auth_token=True): a throwaway CA, one certificate per
process, pdserve.serving.channels).

Evidence: a request through the router answers with the certificates and the token, also from
`pdserve generate --url` with the flags the cluster names; a caller with a certificate but no
token gets UNAUTHENTICATED; one without a certificate, or plaintext, is refused at the handshake
(UNAVAILABLE); the prefill node refuses (PERMISSION_DENIED) a Prefill from a caller whose
certificate names another node than the request's decode_node_id, one whose KV memory belongs to
another fabric engine than its peer, and one whose shm peer claims another host, and an
AbortPrefill of decode-0's transfers from another certificate or with a fence aimed at another
engine; every node is left with no page held.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import grpc
import pytest
from support.cluster import assert_no_page_leak, cluster_fixture

from fabric import PeerDescriptor, RemoteDescriptor
from fabric.liveness import host_id
from kv_messenger import KvLayout, TransferTicket
from kv_messenger.ticket import peer_from_bytes, remote_to_bytes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.channels import ChannelSecurity, open_sync_channel
from pdserve.tools.client import Client, ClientError
from pdserve_api.v1 import node_pb2, node_pb2_grpc, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"

cluster = cluster_fixture("secure", prefill=1, decode=1, port=0, http_port=None, num_blocks=32,
                          threads_per_node=1, engine_args=("--max-batch-tokens", "32"), startup_timeout_s=150,
                          router_health_interval_s=0.5, tls=True, auth_token=True)


def _security(cluster, name: str | None, token: bool) -> ChannelSecurity:
    """The cluster's CA, the certificate `name` made for it (None: none), its token or not."""
    d = cluster.security_dir
    cert = key = None
    if name is not None:
        cert, key = str(d / f"{name}.pem"), str(d / f"{name}.key")
    return ChannelSecurity(cert_file=cert, key_file=key, ca_file=str(d / "ca.pem"),
                           token=cluster.client_security.token if token else None)


def test_request_answers_with_mtls_and_token(cluster):
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with Client(cluster.url, timeout=120, security=cluster.client_security) as client:
        done = client.complete(PROMPT, sampling)
    assert len(done.token_ids) == 8 and done.finish_reason == "length" and done.text
    # the same request from the command line, with the flags the cluster names for its clients
    out = subprocess.run([sys.executable, "-m", "pdserve.tools.cli", "generate", "--url", cluster.url,
                          *cluster.client_flags(), "--json", "--max-tokens", "8", "--temperature", "0",
                          "--ignore-eos", PROMPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["token_ids"] == list(done.token_ids)
    assert_no_page_leak(cluster)


def test_without_token_unauthenticated(cluster):
    with Client(cluster.url, timeout=30, security=_security(cluster, "client", token=False)) as client:
        with pytest.raises(ClientError) as err:
            client.complete(PROMPT, SamplingParams(max_tokens=2))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "auth token" in err.value.message
    # a wrong token is no better
    wrong = ChannelSecurity(cert_file=str(cluster.security_dir / "client.pem"),
                            key_file=str(cluster.security_dir / "client.key"),
                            ca_file=str(cluster.security_dir / "ca.pem"), token="not-the-token-0123456789")
    with Client(cluster.url, timeout=30, security=wrong) as client:
        with pytest.raises(ClientError) as err:
            client.list_models()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    # the nodes check it too, not only the router
    decode = cluster.addresses("decode")[0]
    with open_sync_channel(decode, _security(cluster, "client", token=False)) as channel:
        with pytest.raises(grpc.RpcError) as rpc:
            node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=30)
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("how", ["no client certificate", "plaintext"])
def test_without_certificate_refused(cluster, how):
    security = (_security(cluster, None, token=True) if how == "no client certificate"
                else ChannelSecurity(token=cluster.client_security.token))
    for address in (cluster.url, cluster.addresses("prefill")[0]):
        with open_sync_channel(address, security) as channel:
            with pytest.raises(grpc.RpcError) as rpc:
                node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=10)
        assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE, (address, rpc.value)


def _forged_prefill(decode_node_id: str, peer: PeerDescriptor, kv_peer: PeerDescriptor) -> prefill_pb2.PrefillRequest:
    """A well-formed Prefill (it parses) whose KV memory is `kv_peer`'s and whose peer is `peer`."""
    layout = KvLayout(num_layers=2, num_pages=8, kv_heads=1, page_size=16, head_dim=8, dtype="float32")
    kv = RemoteDescriptor(kv_peer, region_id=1, base=0, key=1, length=1 << 20)
    context = RemoteDescriptor(peer, region_id=2, base=0, key=2, length=1 << 16)
    ticket = TransferTicket(request_id="forged-1", kv=kv, layout=layout, dst_pages=(0,), context=context,
                            context_offset=0, imm_tag=77, expected_writes=3, num_prefill_tokens=4)
    req = ticket.to_pb([1, 2, 3, 4], peer)
    req.decode_node_id = decode_node_id
    return req


def _peer(name: str, host: str) -> PeerDescriptor:
    return PeerDescriptor(provider="shm", address=f"fi_shm://{name}\0".encode(), engine_id=name * 4,
                          host_id=host, pid=1, start_time=1)


def _assert_prefill_node_refuses(cluster, cert: str, method: str, req: object, match: str) -> None:
    """PrefillService.`method`(req), called with certificate `cert` and the token, is PERMISSION_DENIED
    with details matching `match`."""
    with open_sync_channel(cluster.addresses("prefill")[0], _security(cluster, cert, token=True)) as channel:
        with pytest.raises(grpc.RpcError) as rpc:
            getattr(prefill_pb2_grpc.PrefillServiceStub(channel), method)(req, timeout=30)
    assert rpc.value.code() == grpc.StatusCode.PERMISSION_DENIED, rpc.value
    assert re.search(match, rpc.value.details()), rpc.value.details()


@pytest.mark.parametrize("cert, node_id, peer_host, kv_owner, match", [
    ("router", "decode-0", "here", "decode", r"decode_node_id 'decode-0' is not the caller's certificate identity"),
    ("decode-0", "decode-0", "here", "other", r"KV memory belongs to fabric engine"),
    ("decode-0", "decode-0", "elsewhere", "decode", r"shm peer of decode node 'decode-0' is on another host"),
])
def test_prefill_node_refuses_another_nodes_prefill(cluster, cert, node_id, peer_host, kv_owner, match):
    peer = _peer("decode", host_id() if peer_host == "here" else "another-host/pid:[1]")
    req = _forged_prefill(node_id, peer, peer if kv_owner == "decode" else _peer("other", host_id()))
    _assert_prefill_node_refuses(cluster, cert, "Prefill", req, match)
    assert_no_page_leak(cluster)


def test_prefill_node_refuses_another_nodes_abort(cluster):
    """AbortPrefill's fence is a write too: a certificate other than the one decode-0's Prefills
    were authorized under cannot abort its transfers, nor aim the fence at another engine."""
    client = _security(cluster, "client", token=True)
    with open_sync_channel(cluster.addresses("decode")[0], client) as channel:
        info = node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=30)
    decode_peer = peer_from_bytes(info.fabric_peer)
    with open_sync_channel(cluster.addresses("prefill")[0], client) as channel:
        prefill_engine = peer_from_bytes(node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(
            node_pb2.GetNodeInfoRequest(), timeout=30).fabric_peer).engine_id
    with Client(cluster.url, timeout=120, security=cluster.client_security) as c:   # binds decode-0's engine
        c.complete(PROMPT, SamplingParams(temperature=0, max_tokens=2))
    other = RemoteDescriptor(_peer("other", host_id()), region_id=1, base=0, key=1, length=8)
    cases = [
        ("router", b"", r"belong to decode node 'decode-0', not to the caller's certificate identity \['router'\]"),
        ("decode-0", remote_to_bytes(other), r"the fence region belongs to fabric engine"),
    ]
    for cert, fence, match in cases:
        req = prefill_pb2.AbortPrefillRequest(request_id="r-1", decode_engine_id=decode_peer.engine_id, attempt=0,
                                              prefill_engine_id=prefill_engine, fence_tag=5 if fence else 0,
                                              fence_region=fence)
        _assert_prefill_node_refuses(cluster, cert, "AbortPrefill", req, match)
    assert_no_page_leak(cluster)


def test_bench_harness_against_the_secured_cluster(cluster):
    from pdserve.tools.bench.backends import SendOptions
    from pdserve.tools.bench.datasets import DatasetSpec, LengthRange
    from pdserve.tools.bench.runner import RunConfig
    from pdserve.tools.bench.serve import ServeSettings, run_serve

    data = DatasetSpec("random", 4, LengthRange(8, 16), LengthRange(2, 3), seed=3)
    settings = ServeSettings("grpc", cluster.url, data, RunConfig(max_concurrency=2, send=SendOptions(timeout_s=120)),
                             security=cluster.client_security)
    result = run_serve(settings, progress=False)
    assert result.metrics.completed == 4 and result.metrics.failed == 0
    assert cluster.client_security.token not in json.dumps(result.to_json())   # the secret stays out of results
    assert_no_page_leak(cluster)
