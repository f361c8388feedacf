"""No client pins the router (issue 33 items 3 and 4, S8): slow readers are cut by the write
deadline, one client is capped below the router's whole capacity, oversized requests are refused
before parsing, and every capacity refusal is HTTP 429 with Retry-After / gRPC RESOURCE_EXHAUSTED.

A real router (RouterServer, gRPC and HTTP on loopback) in front of fake decode nodes that are
real grpc.aio servers speaking the node contract (GenerateService, NodeService, health). A "flood"
prompt is answered with 4 KiB messages as fast as the router takes them, until cancelled, so a
client that reads nothing fills its socket buffers within milliseconds. The slow clients are real
sockets: raw TCP sockets with a small receive buffer that send an SSE request and never read, and
gRPC calls that are started and never read. Router, fakes and clients share one event loop per
test; every wait is bounded by WAIT.
"""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import grpc
import pytest
from support.net import free_ports
from support.wait import async_wait_until

from pdserve.serving.metrics import REGISTRY
from pdserve_api.servers import AioExceptionToStatusInterceptor, add_standard_services_aio
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc, node_pb2, node_pb2_grpc
from router.clients import grpc_client, http_client, peer_host
from router.config import RouterConfig
from router.http_api import HttpConfig
from router.limits import RequestLimits
from router.server import GENERATE_SERVICE, RouterServer

WAIT = 20.0            # every wait in this file is bounded by this many seconds
WRITE_TIMEOUT_S = 1.0  # the router's write deadline in these tests
# How long after a slow client pinned its slot the slot must be free: the deadline, plus the time
# the flood takes to fill the buffers (milliseconds on loopback), plus poll and scheduling slack.
FREED_WITHIN_S = WRITE_TIMEOUT_S + 8.0
SMALL_RCVBUF = 4096
FLOOD_TEXT = "x" * 4096


class FakeDecode(generate_pb2_grpc.GenerateServiceServicer, node_pb2_grpc.NodeServiceServicer):
    """A decode node without a model. Prompt "flood": 4 KiB messages until cancelled; "hold": one
    token, then waits until `release` is set; else two tokens and LENGTH. `full`: every Generate
    is answered RESOURCE_EXHAUSTED(full). `cancelled`: the calls that ended before their last message."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.seen: list[str] = []
        self.cancelled: set[str] = set()
        self.release = asyncio.Event()
        self.full: str | None = None

    async def Generate(self, request, context):
        rid = request.request_id
        if self.full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.full)
        self.seen.append(rid)
        done = False
        try:
            if request.text == "flood":
                while True:
                    yield generate_pb2.GenerateResponse(request_id=rid, token_ids=[7], text=FLOOD_TEXT)
            yield generate_pb2.GenerateResponse(request_id=rid, token_ids=[1], text="a ")
            if request.text == "hold":
                await asyncio.wait_for(self.release.wait(), WAIT)
            yield generate_pb2.GenerateResponse(request_id=rid, token_ids=[2], text="b",
                                                finish_reason=generate_pb2.FINISH_REASON_LENGTH)
            done = True
        finally:   # cancelled, or closed because the router's call went away (its write failed)
            if not done:
                self.cancelled.add(rid)

    async def ListModels(self, request, context):
        return generate_pb2.ListModelsResponse(models=[generate_pb2.ModelInfo(id="fake", max_context_length=4096)])

    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id=self.node_id, role=node_pb2.NODE_ROLE_DECODE, model="fake",
                                 max_context_length=4096)


async def start_fake(fake: FakeDecode, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(interceptors=[AioExceptionToStatusInterceptor()])
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(fake, server)
    node_pb2_grpc.add_NodeServiceServicer_to_server(fake, server)
    await add_standard_services_aio(server, [GENERATE_SERVICE])
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


class Rig:
    """Fake decode nodes behind an in-process router with gRPC and HTTP."""

    def __init__(self, nodes: int = 1, limits: RequestLimits | None = None, **config) -> None:
        self.ports = free_ports(nodes)
        self.fakes = [FakeDecode(f"fake-{i}") for i in range(nodes)]
        self.limits = limits
        self.config = {"write_timeout_s": WRITE_TIMEOUT_S, "health_interval_s": 0.2, "health_timeout_s": 2.0,
                       **config}
        self.servers: list[grpc.aio.Server] = []

    async def __aenter__(self) -> Rig:
        for fake, port in zip(self.fakes, self.ports, strict=True):
            self.servers.append(await start_fake(fake, port))
        config = RouterConfig(port=0, decode_nodes=tuple(f"127.0.0.1:{p}" for p in self.ports), **self.config)
        self.router = RouterServer(config, HttpConfig(port=0), self.limits)
        port = await self.router.start()
        await async_wait_until(lambda: len(self.router.pool.healthy()) == len(self.fakes), WAIT, "every fake healthy")
        self.grpc_address = f"127.0.0.1:{port}"
        self.channel = grpc.aio.insecure_channel(self.grpc_address)
        self.stub = generate_pb2_grpc.GenerateServiceStub(self.channel)
        self.http_url = f"http://127.0.0.1:{self.router.http_port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.router.stop(grace=0.5)
        for server in self.servers:
            await server.stop(0)

    async def complete_grpc(self, text: str = "hi", metadata=None) -> list[generate_pb2.GenerateResponse]:
        call = self.stub.Generate(generate_pb2.GenerateRequest(text=text), timeout=WAIT, metadata=metadata)
        return [m async for m in call]

    async def post(self, body: dict, headers: dict | None = None) -> tuple[int, dict[str, str], str]:
        async with aiohttp.ClientSession(self.http_url) as session:
            async with session.post("/v1/completions", json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
                return r.status, dict(r.headers), await r.text()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 6 * WAIT))


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def slow_sse_client(port: int, body: dict) -> socket.socket:
    """A raw TCP client with a small receive buffer (set before connecting, so the window stays
    small) that sends one streaming request and never reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    await loop.sock_sendall(sock, head + payload)
    return sock


# ---- the write deadline ----------------------------------------------------------------------


def test_sse_clients_that_never_read_are_cut_their_slots_freed_and_the_node_call_cancelled():
    async def go():
        async with Rig(max_inflight_requests=2) as rig:
            fake, gate = rig.fakes[0], rig.router.gate
            cuts0 = counter("pdserve:router_stream_write_timeouts_total", api="http")
            socks = [await slow_sse_client(rig.router.http_port, {"prompt": "flood", "stream": True,
                                                                  "max_tokens": 100000}) for _ in range(2)]
            try:
                await async_wait_until(lambda: len(fake.seen) == 2 and gate.inflight == 2, WAIT,
                                       "both slow streams admitted and flooding")
                status, headers, _ = await rig.post({"prompt": "hi", "max_tokens": 2})
                assert status == 429 and headers["Retry-After"] == "1"   # pinned: every slot is theirs
                await async_wait_until(lambda: gate.inflight == 0, FREED_WITHIN_S,
                                       "the slow streams' slots freed by the write deadline")
                await async_wait_until(lambda: fake.cancelled >= set(fake.seen), WAIT,
                                       "both flood calls cancelled on the decode node")
                assert counter("pdserve:router_stream_write_timeouts_total", api="http") == cuts0 + 2
                for sock in socks:   # the router dropped the connection: after what was buffered, EOF or RST
                    assert await _drained_to_close(sock), "the router kept a cut connection open"
            finally:
                for sock in socks:
                    sock.close()
            status, _, text = await rig.post({"prompt": "hi", "max_tokens": 2})
            assert status == 200, text
            assert json.loads(text)["choices"][0]["text"] == "a b"

    run(go())


async def _drained_to_close(sock: socket.socket) -> bool:
    """Read what the peer sent until it closes (True), or WAIT passes (False)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(WAIT):
            while await loop.sock_recv(sock, 1 << 16):
                pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_grpc_streams_never_read_are_cut_with_deadline_exceeded_and_their_slots_freed():
    async def go():
        async with Rig(max_inflight_requests=2) as rig:
            fake, gate = rig.fakes[0], rig.router.gate
            cuts0 = counter("pdserve:router_stream_write_timeouts_total", api="grpc")
            channels = [grpc.aio.insecure_channel(rig.grpc_address) for _ in range(2)]
            try:
                calls = [generate_pb2_grpc.GenerateServiceStub(ch).Generate(
                    generate_pb2.GenerateRequest(text="flood"), timeout=6 * WAIT) for ch in channels]
                await async_wait_until(lambda: len(fake.seen) == 2 and gate.inflight == 2, WAIT,
                                       "both unread streams admitted and flooding")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await rig.complete_grpc()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await async_wait_until(lambda: gate.inflight == 0, FREED_WITHIN_S,
                                       "the unread streams' slots freed by the write deadline")
                await async_wait_until(lambda: fake.cancelled >= set(fake.seen), WAIT,
                                       "both flood calls cancelled on the decode node")
                assert counter("pdserve:router_stream_write_timeouts_total", api="grpc") == cuts0 + 2
                for call in calls:   # what was buffered, then the status of the cut
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in call:
                            pass
                    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert "read nothing" in err.value.details()
            finally:
                for ch in channels:
                    await ch.close()
            out = await rig.complete_grpc()
            assert [m.token_ids[0] for m in out] == [1, 2]
            assert out[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH

    run(go())


def test_a_client_that_reads_keeps_its_stream_past_the_write_deadline():
    # The deadline is per message, not per stream: a stream longer than it, read as it comes, is whole.
    async def go():
        async with Rig() as rig:
            fake = rig.fakes[0]
            call = rig.stub.Generate(generate_pb2.GenerateRequest(text="hold"), timeout=WAIT)
            first = await call.read()
            assert first.token_ids[0] == 1
            await asyncio.sleep(2 * WRITE_TIMEOUT_S)   # idle, nothing to write: not a slow client
            fake.release.set()
            last = await call.read()
            assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert await call.code() == grpc.StatusCode.OK

    run(go())


# ---- the per-client cap ------------------------------------------------------------------------


def test_client_keys_are_the_api_key_hash_or_the_peer_host():
    a = http_client("Bearer sk-secret-a", "10.0.0.7")
    assert a.startswith("key:") and "secret" not in a
    assert a == grpc_client([("authorization", "Bearer sk-secret-a")], "ipv4:10.0.0.9:4000")
    assert a != http_client("Bearer sk-secret-b", "10.0.0.7")
    assert http_client(None, "10.0.0.7") == http_client("Basic abc", "10.0.0.7") == "peer:10.0.0.7"
    assert grpc_client([], "ipv4:10.0.0.7:5123") == "peer:10.0.0.7"
    # the router's own gRPC token is every client's: keyed by peer
    assert grpc_client([("authorization", "Bearer cluster-token")], "ipv4:10.0.0.7:1", "cluster-token") == \
        "peer:10.0.0.7"
    assert peer_host("ipv6:[::1]:5123") == "::1" and peer_host("unix:/tmp/s") == "unix:/tmp/s"


def test_one_client_is_capped_by_key_or_peer_on_http_and_grpc_together():
    async def go():
        async with Rig(max_inflight_per_client=1, retry_after_s=3.0) as rig:
            fake = rig.fakes[0]
            refused0 = {api: counter("pdserve:router_client_cap_refusals_total", api=api) for api in ("http", "grpc")}
            key_a = {"Authorization": "Bearer key-a-0123456789"}
            held = asyncio.ensure_future(rig.post({"prompt": "hold", "max_tokens": 2}, headers=key_a))
            await async_wait_until(lambda: len(fake.seen) == 1, WAIT, "key a's request running")
            status, headers, text = await rig.post({"prompt": "hi", "max_tokens": 2}, headers=key_a)
            assert status == 429 and headers["Retry-After"] == "3", text
            assert "rate_limit_error" in text
            assert "per-client cap (max 1)" in json.loads(text)["error"]["message"]
            assert "key-a" not in text   # the key is named by its hash only
            with pytest.raises(grpc.aio.AioRpcError) as err:   # the same key over gRPC: the same client
                await rig.complete_grpc(metadata=(("authorization", key_a["Authorization"]),))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("retry-after", "3") in tuple(err.value.trailing_metadata())
            # Another key, and this host without a key, are other clients.
            status, _, text = await rig.post({"prompt": "hi", "max_tokens": 2},
                                             headers={"Authorization": "Bearer key-b-0123456789"})
            assert status == 200, text
            assert (await rig.complete_grpc())[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
            # Without a key the peer address is the client, across both APIs.
            stream = rig.stub.Generate(generate_pb2.GenerateRequest(text="hold"), timeout=WAIT)
            assert (await stream.read()).token_ids[0] == 1
            status, headers, _ = await rig.post({"prompt": "hi", "max_tokens": 2})
            assert status == 429 and headers["Retry-After"] == "3"
            fake.release.set()
            status, _, text = await held
            assert status == 200, text
            assert (await stream.read()).finish_reason == generate_pb2.FINISH_REASON_LENGTH
            assert counter("pdserve:router_client_cap_refusals_total", api="http") == refused0["http"] + 2
            assert counter("pdserve:router_client_cap_refusals_total", api="grpc") == refused0["grpc"] + 1
            # the handlers end just after their last message: wait for them
            await async_wait_until(lambda: rig.router.clients.inflight == {} and rig.router.gate.inflight == 0,
                                   WAIT, "every slot released")

    run(go())


# ---- size limits before parsing ----------------------------------------------------------------


def test_requests_over_the_message_limit_are_refused_before_parsing():
    limits = RequestLimits(max_prompt_bytes=1024, message_bytes=8192)

    async def go():
        async with Rig(limits=limits) as rig:
            fake = rig.fakes[0]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rig.complete_grpc(text="p" * 10000)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as err:   # over the prompt cap, under the message cap
                await rig.complete_grpc(text="p" * 2000)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2000 bytes" in err.value.details()
            status, _, text = await rig.post({"prompt": "p" * 10000})
            assert status == 413 and "8192" in json.loads(text)["error"]["message"]

            async def chunked():   # no Content-Length: refused once 8192 bytes were read
                yield json.dumps({"prompt": "p" * 10000}).encode()

            async with aiohttp.ClientSession(rig.http_url) as session:
                async with session.post("/v1/completions", data=chunked(),
                                        headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 413
            assert not fake.seen
            assert (await rig.complete_grpc())[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH

    run(go())


# ---- back-pressure reaches clients as 429 / RESOURCE_EXHAUSTED --------------------------------


def test_decode_nodes_answering_resource_exhausted_reach_clients_as_429_with_retry_after():
    # Whatever filled the decode node (its waiting cap, pages; a prefill gate once the decode node
    # passes it on as RESOURCE_EXHAUSTED): every node full is back-pressure, never a 500 or an OK
    # stream ending in FINISH_REASON_ERROR.
    async def go():
        async with Rig(nodes=2, retry_after_s=2.0) as rig:
            for i, fake in enumerate(rig.fakes):
                fake.full = f"fake-{i} has 4 requests waiting for their first token, its cap (max 4)"
            for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "stream": True}):
                status, headers, text = await rig.post(body)
                assert status == 429 and headers["Retry-After"] == "2", text
                error = json.loads(text)["error"]
                assert error["type"] == "rate_limit_error" and "every decode node is full" in error["message"]
            async with aiohttp.ClientSession(rig.http_url) as session:
                async with session.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "2"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rig.complete_grpc()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "fake-0 has 4 requests waiting" in err.value.details()
            assert ("retry-after", "2") in tuple(err.value.trailing_metadata())
            assert all(n.healthy for n in rig.router.pool.nodes)   # full is not down
            assert rig.router.gate.inflight == 0 and rig.router.clients.inflight == {}
            rig.fakes[1].full = None
            assert (await rig.complete_grpc())[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH

    run(go())



def test_one_node_full_and_the_other_unreachable_is_back_pressure_not_unavailable():
    # No poll after the first (health_interval_s far beyond the test): the router still counts the
    # stopped node healthy, so the request reaches the full node first (first by rank when idle),
    # then the stopped one, which fails UNAVAILABLE before answering: with nowhere left to go, the
    # answer is the full node's back-pressure.
    async def go():
        async with Rig(nodes=2, retry_after_s=2.0, health_interval_s=600.0) as rig:
            rig.fakes[0].full = "fake-0 has 4 requests waiting for their first token, its cap (max 4)"
            await rig.servers[1].stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rig.complete_grpc()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert "fake-0 has 4 requests waiting" in err.value.details()
            status, headers, text = await rig.post({"prompt": "hi", "max_tokens": 2})
            assert status == 429 and headers["Retry-After"] == "2", text

    run(go())


def test_the_new_settings_are_validated_naming_the_value():
    with pytest.raises(ValueError, match=r"max_inflight_per_client must be an integer >= 1, got 0"):
        RouterConfig(decode_nodes=("127.0.0.1:1",), max_inflight_per_client=0)
    with pytest.raises(ValueError, match=r"write_timeout_s must be > 0, got 0"):
        RouterConfig(decode_nodes=("127.0.0.1:1",), write_timeout_s=0)
    with pytest.raises(ValueError, match=r"message_bytes must be an integer >= 1024 .* got 10"):
        RequestLimits(message_bytes=10)
    assert RequestLimits(max_prompt_bytes=1024).max_message_bytes == 6 * 1024 + (1 << 20)
    assert RequestLimits(message_bytes=4096).max_message_bytes == 4096
