"""pdserve.serving.channels: ChannelSecurity's checks, the token interceptor, mTLS identities, and
keepalive noticing a stopped server (S8, S9).

Evidence: every bad configuration is refused when built with the offending file or value named; an
in-process grpc.aio server with mTLS + token answers a client with both, refuses a missing or
wrong token with UNAUTHENTICATED (health Check exempt), refuses a client without a certificate at
the handshake, and tells its handlers the caller's certificate names; a call in flight to a server
process that is SIGSTOPped fails with UNAVAILABLE (keepalive) instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.serving.channels import (
    CHANNEL_KEEPALIVE,
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    SERVER_PENDING_REQUESTS,
    TOKEN_ENV,
    ChannelSecurity,
    add_server_port,
    aio_server,
    caller_identity,
    channel_options,
    open_channel,
    server_options,
)
from pdserve.tools.certs import make_pki
from pdserve_api.servers import add_standard_services_aio
from pdserve_api.v1 import node_pb2, node_pb2_grpc
from router.config import RouterConfig

TOKEN = "t0ken-for-the-unit-tests-123"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ["server", "client", "other"], hosts=["127.0.0.1"])


def test_bad_configurations_are_named(pki, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs its key"):
        ChannelSecurity(cert_file=pki["server"].cert, ca_file=pki.ca)
    with pytest.raises(ValueError, match="needs the CA"):
        ChannelSecurity(cert_file=pki["server"].cert, key_file=pki["server"].key)
    with pytest.raises(ValueError, match=r"TLS certificate '/nonexistent.pem' cannot be read"):
        ChannelSecurity(cert_file="/nonexistent.pem", key_file=pki["server"].key, ca_file=pki.ca)
    with pytest.raises(ValueError, match="does not load .* the key does not match"):
        ChannelSecurity(cert_file=pki["server"].cert, key_file=pki["client"].key, ca_file=pki.ca)
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"TLS CA '{garbage}' holds no PEM certificate"):
        ChannelSecurity(ca_file=str(garbage))
    with pytest.raises(ValueError, match="at least 16 printable ASCII characters without spaces, got 5"):
        ChannelSecurity(token="short")
    with pytest.raises(ValueError, match="with ' '"):
        ChannelSecurity(token="has a space in the middle")
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert ChannelSecurity.load(token_file=str(token_file)).token == TOKEN
    with pytest.raises(ValueError, match="auth token file '/nonexistent' cannot be read"):
        ChannelSecurity.load(token_file="/nonexistent")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert ChannelSecurity.load().token == TOKEN
    assert TOKEN not in repr(ChannelSecurity.load())   # the secret never reaches logs
    assert ChannelSecurity.load().describe() == "plaintext + token"
    assert ChannelSecurity(pki["server"].cert, pki["server"].key, pki.ca).describe() == "mTLS"


def test_keepalive_on_every_server_and_channel():
    opts = dict(channel_options([("grpc.max_receive_message_length", 1)]))
    assert opts["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS and opts["grpc.keepalive_permit_without_calls"] == 1
    assert opts["grpc.max_receive_message_length"] == 1
    assert dict(channel_options([("grpc.keepalive_time_ms", 123)]))["grpc.keepalive_time_ms"] == 123  # given wins
    srv = dict(server_options())
    # servers accept the clients' pings (never GOAWAY for them) and ping their clients too
    assert srv["grpc.http2.min_ping_interval_without_data_ms"] < dict(CHANNEL_KEEPALIVE)["grpc.keepalive_time_ms"]
    assert srv["grpc.http2.max_ping_strikes"] == 0 and srv["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    assert opts["grpc.http2.ping_timeout_ms"] == srv["grpc.http2.ping_timeout_ms"] == KEEPALIVE_TIMEOUT_MS
    # calls parked in gRPC core before the application takes them: far above the router's in-flight cap
    assert srv["grpc.server.max_pending_requests"] == SERVER_PENDING_REQUESTS >= 4 * RouterConfig.max_inflight_requests


class _Names(node_pb2_grpc.NodeServiceServicer):
    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id=",".join(sorted(caller_identity(context).names)))


async def _call(address: str, security: ChannelSecurity) -> str:
    async with open_channel(address, security) as channel:
        try:
            reply = await node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return reply.node_id


async def _health(address: str, security: ChannelSecurity) -> str:
    async with open_channel(address, security) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_mtls_and_token_in_process(pki):
    server_security = ChannelSecurity(pki["server"].cert, pki["server"].key, pki.ca, token=TOKEN)

    async def run() -> dict[str, str]:
        server = aio_server(server_security)
        node_pb2_grpc.add_NodeServiceServicer_to_server(_Names(), server)
        await add_standard_services_aio(server, [])
        address = f"127.0.0.1:{add_server_port(server, '127.0.0.1:0', server_security)}"
        await server.start()
        try:
            client = ChannelSecurity(pki["client"].cert, pki["client"].key, pki.ca, token=TOKEN)
            no_token = ChannelSecurity(pki["client"].cert, pki["client"].key, pki.ca)
            wrong = ChannelSecurity(pki["client"].cert, pki["client"].key, pki.ca, token=TOKEN[::-1])
            return {
                "good": await _call(address, client),
                "other": await _call(address, ChannelSecurity(pki["other"].cert, pki["other"].key, pki.ca,
                                                              token=TOKEN)),
                "no token": await _call(address, no_token),
                "wrong token": await _call(address, wrong),
                "health without token": await _health(address, no_token),
                "no certificate": await _call(address, ChannelSecurity(ca_file=pki.ca, token=TOKEN)),
                "plaintext": await _call(address, ChannelSecurity(token=TOKEN)),
            }
        finally:
            await server.stop(0)

    got = asyncio.run(run())
    # the caller's names: its common name and DNS SANs, never the IP SAN the certificates share
    assert got["good"] == "client" and got["other"] == "other"
    assert got["no token"] == got["wrong token"] == "UNAUTHENTICATED"
    assert got["health without token"] == "SERVING"
    assert got["no certificate"] == got["plaintext"] == "UNAVAILABLE"


_STALL_SERVER = textwrap.dedent("""
    import asyncio, sys
    from pdserve.serving.channels import PLAINTEXT, add_server_port, aio_server
    from pdserve_api.v1 import node_pb2_grpc

    class Slow(node_pb2_grpc.NodeServiceServicer):
        async def GetNodeInfo(self, request, context):
            await asyncio.sleep(3600)   # the call stays in flight

    async def main():
        server = aio_server(PLAINTEXT)
        node_pb2_grpc.add_NodeServiceServicer_to_server(Slow(), server)
        print(add_server_port(server, "127.0.0.1:0", PLAINTEXT), flush=True)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())
""")


@pytest.mark.timeout(120)
def test_call_to_a_stopped_server_fails_instead_of_hanging():
    """The server process is SIGSTOPped with a call in flight and no deadline: keepalive pings go
    unanswered and the call fails UNAVAILABLE (bounded wait here only so a regression cannot hang)."""
    proc = subprocess.Popen([sys.executable, "-c", _STALL_SERVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        port = int(proc.stdout.readline())

        async def run() -> str:
            async with open_channel(f"127.0.0.1:{port}") as channel:
                call = node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest())
                await asyncio.sleep(1.0)   # connected, the call in flight
                os.kill(proc.pid, signal.SIGSTOP)
                bound = 6 * (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
                try:
                    await asyncio.wait_for(call, bound)
                except grpc.aio.AioRpcError as e:
                    return e.code().name
                except TimeoutError:
                    return f"still waiting after {bound} s"
            return "answered"

        assert asyncio.run(run()) == "UNAVAILABLE"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_malformed_request_bytes_answer_invalid_argument():
    """grpc.aio alone answers bytes that do not parse UNKNOWN ("Unexpected DecodeError"); through
    aio_server every kind of method answers INVALID_ARGUMENT naming the method and the message type
    (unary, server-streaming health Watch, bidirectional reflection), a good request still gets its
    answer, and the token check still comes first."""
    identity = lambda b: b  # noqa: E731 - raw bytes on the wire
    garbage = b"\xff" * 9

    async def run() -> dict[str, tuple[str, str]]:
        security = ChannelSecurity(token=TOKEN)
        server = aio_server(security)
        node_pb2_grpc.add_NodeServiceServicer_to_server(_Names(), server)
        await add_standard_services_aio(server, [])
        address = f"127.0.0.1:{add_server_port(server, '127.0.0.1:0', security)}"
        await server.start()
        token = [("authorization", f"Bearer {TOKEN}")]
        out: dict[str, tuple[str, str]] = {}
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                async def status(what: str, make, body: bytes, metadata=token) -> None:
                    try:
                        call = make(body, metadata=metadata, timeout=10)
                        if hasattr(call, "__aiter__"):
                            async for _ in call:
                                pass
                        else:
                            await call
                        out[what] = ("OK", "")
                    except grpc.aio.AioRpcError as e:
                        out[what] = (e.code().name, e.details() or "")

                info = channel.unary_unary("/pdserve.api.v1.NodeService/GetNodeInfo", request_serializer=identity,
                                           response_deserializer=identity)
                await status("unary", info, garbage)
                await status("unary good", info, b"")
                await status("unary no token", info, garbage, metadata=None)
                watch = channel.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=identity,
                                             response_deserializer=identity)
                await status("server streaming", watch, garbage)
                reflect = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                                request_serializer=identity, response_deserializer=identity)
                await status("bidirectional", lambda b, **kw: reflect(iter([b]), **kw), garbage)
        finally:
            await server.stop(0)
        return out

    got = asyncio.run(run())
    assert got["unary"][0] == "INVALID_ARGUMENT", got
    assert "/pdserve.api.v1.NodeService/GetNodeInfo: 9 request bytes are not a valid GetNodeInfoRequest" \
        in got["unary"][1]
    assert got["unary good"] == ("OK", "")
    assert got["unary no token"][0] == "UNAUTHENTICATED"
    assert got["server streaming"][0] == "INVALID_ARGUMENT" and "HealthCheckRequest" in got["server streaming"][1]
    assert got["bidirectional"][0] == "INVALID_ARGUMENT" and "ServerReflectionRequest" in got["bidirectional"][1]
