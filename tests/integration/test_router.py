"""The router (R1, R3, R4) and the client against it, with in-process fake decode nodes.

The fake nodes are grpc.aio servers speaking the real contract (GenerateService, NodeService,
health): they echo tokens, record cancellations and aborts, and answer bad input with
INVALID_ARGUMENT. Router, nodes and AsyncClient share one event loop per test. One test runs the
router as a real process with no reachable node. Real-node routing is covered in test_cluster.py.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from support.net import free_ports
from support.paths import ROOT
from support.wait import async_wait_until

from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.metrics import REGISTRY
from pdserve.tools.client import AsyncClient, Client, ClientError, build_request
from pdserve_api.servers import AioExceptionToStatusInterceptor, add_standard_services_aio
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc, node_pb2, node_pb2_grpc
from router.config import RouterConfig
from router.http_api import HttpConfig
from router.policy import RoutingConfig, make_policy, prompt_hashes
from router.server import GENERATE_SERVICE, RouterServer

WAIT = 10.0  # every wait in this file is bounded by this many seconds


class FakeDecode(generate_pb2_grpc.GenerateServiceServicer, node_pb2_grpc.NodeServiceServicer):
    """A decode node without a model: answers token t of a request with id 1000 + t."""

    def __init__(self, node_id: str, delay_s: float = 0.0) -> None:
        self.node_id = node_id
        self.delay_s = delay_s
        self.seen: list[str] = []
        self.cancelled: set[str] = set()
        self.aborted: set[str] = set()
        self.running: dict[str, asyncio.Event] = {}
        self.progress: dict[str, int] = {}  # request id -> tokens sent
        self.info_error: str | None = None  # GetNodeInfo raises RuntimeError(info_error) when set
        self.requests: dict[str, generate_pb2.GenerateRequest] = {}  # request id -> the request as received
        self.full: str | None = None  # Generate answers RESOURCE_EXHAUSTED(full) when set

    async def Generate(self, request, context):
        rid = request.request_id or "node-assigned"
        if request.text == "bad":
            raise ValueError("prompt 'bad' is invalid here")
        if self.full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.full)
        self.seen.append(rid)
        self.requests[rid] = request
        abort = self.running[rid] = asyncio.Event()
        n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 4
        first = len(request.resume.token_ids)  # a resumed request continues the numbering (S10)
        try:
            for t in range(first, first + n):
                if self.delay_s:
                    try:
                        await asyncio.wait_for(abort.wait(), self.delay_s)
                    except TimeoutError:
                        pass
                if abort.is_set():
                    yield generate_pb2.GenerateResponse(request_id=rid, finish_reason=generate_pb2.FINISH_REASON_ABORT)
                    return
                yield generate_pb2.GenerateResponse(request_id=rid, token_ids=[1000 + t], text=f"t{t} ")
                self.progress[rid] = t + 1
            final = generate_pb2.GenerateResponse(request_id=rid, finish_reason=generate_pb2.FINISH_REASON_LENGTH)
            final.usage.prompt_tokens = len(request.token_ids.ids)
            final.usage.completion_tokens = n
            final.timings.decode_node = self.node_id
            yield final
        except asyncio.CancelledError:
            self.cancelled.add(rid)
            raise
        finally:
            self.running.pop(rid, None)

    async def Abort(self, request, context):
        event = self.running.get(request.request_id)
        if event is None:
            return generate_pb2.AbortResponse(aborted=False)
        self.aborted.add(request.request_id)
        event.set()
        return generate_pb2.AbortResponse(aborted=True)

    async def ListModels(self, request, context):
        return generate_pb2.ListModelsResponse(models=[generate_pb2.ModelInfo(id="fake", max_context_length=64)])

    async def GetNodeInfo(self, request, context):
        if self.info_error:
            raise RuntimeError(self.info_error)
        return node_pb2.NodeInfo(node_id=self.node_id, role=node_pb2.NODE_ROLE_DECODE, model="fake")


async def start_fake(fake: FakeDecode, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(interceptors=[AioExceptionToStatusInterceptor()])
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(fake, server)
    node_pb2_grpc.add_NodeServiceServicer_to_server(fake, server)
    fake.health = await add_standard_services_aio(server, [GENERATE_SERVICE])
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


def until(predicate, what: str):
    """Wait (on the test's event loop, at most WAIT s) until `predicate()` is true; `what` names it on a timeout."""
    return async_wait_until(predicate, WAIT, what)


class Rig:
    """Two fake decode nodes behind an in-process router, and an AsyncClient to the router."""

    def __init__(self, delay_s: float = 0.0, routing: RoutingConfig | None = None, http: bool = False,
                 **config) -> None:
        self.routing = routing
        self.http = HttpConfig(port=0) if http else None
        self.config = config
        self.ports = free_ports(2)
        self.fakes = [FakeDecode(f"fake-{i}", delay_s) for i in range(2)]
        self.servers: list[grpc.aio.Server | None] = [None, None]

    async def __aenter__(self) -> Rig:
        for i in range(2):
            self.servers[i] = await start_fake(self.fakes[i], self.ports[i])
        config = RouterConfig(port=0, decode_nodes=tuple(f"127.0.0.1:{p}" for p in self.ports),
                              health_interval_s=0.2, health_timeout_s=0.5, **self.config)
        self.router = RouterServer(config, self.http)
        if self.routing is not None:
            self.router.pool.policy = make_policy(self.routing)
        port = await self.router.start()
        self.client = AsyncClient(f"127.0.0.1:{port}", timeout=WAIT)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.router.stop(grace=0.5)
        for server in self.servers:
            if server is not None:
                await server.stop(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 4 * WAIT))


# ---- a router process with no node -------------------------------------------------------------


def test_router_process_without_healthy_node_answers_unavailable_and_serves_health():
    router_port, dead_port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "router", "--port", str(router_port),
                             "--decode", f"127.0.0.1:{dead_port}", "--health-interval", "0.2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"127.0.0.1:{router_port}"
        with grpc.insecure_channel(url) as channel:
            grpc.channel_ready_future(channel).result(timeout=WAIT)
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert health.Check(health_pb2.HealthCheckRequest(service=GENERATE_SERVICE), timeout=WAIT).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
            assert GENERATE_SERVICE in services and "grpc.health.v1.Health" in services
        with Client(url, timeout=WAIT) as client:
            for call in (lambda: client.complete("hello"), client.list_models):
                with pytest.raises(ClientError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                assert "no healthy decode node" in err.value.message
                assert f"127.0.0.1:{dead_port}" in err.value.message
            assert client.abort("nobody") is False
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, out.decode()
    assert b"hello" not in out  # prompts stay out of the logs


def test_router_config_rejects_bad_addresses():
    with pytest.raises(ValueError, match="at least one decode node"):
        RouterConfig(decode_nodes=())
    with pytest.raises(ValueError, match="HOST:PORT"):
        RouterConfig(decode_nodes=("localhost",))
    with pytest.raises(ValueError, match="distinct"):
        RouterConfig(decode_nodes="a:1,a:1")


# ---- forwarding -------------------------------------------------------------------------------


def test_forwarding_keeps_ids_streams_unchanged_and_spreads_load():
    async def go():
        async with Rig(delay_s=0.05) as rig:
            params = SamplingParams(temperature=0, max_tokens=3)
            chunks = [c async for c in rig.client.generate([1, 2, 3], params, request_id="mine")]
            assert [c.token_ids for c in chunks] == [(1000,), (1001,), (1002,), ()]
            assert "".join(c.text for c in chunks) == "t0 t1 t2 "
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.prompt_tokens == 3
            assert all(c.request_id == "mine" for c in chunks)

            done = await rig.client.complete("hi", params)
            assert done.request_id.startswith("router-") and done.token_ids == (1000, 1001, 1002)

            results = await asyncio.gather(*(rig.client.complete([7] * 8, params) for _ in range(6)))
            by_node = [r.timings.decode_node for r in results]
            assert sorted(by_node) == ["fake-0"] * 3 + ["fake-1"] * 3, by_node
            assert (await rig.client.list_models())[0].id == "fake"
            assert rig.router.service.running == {}

    run(go())


def test_downstream_status_code_is_kept():
    async def go():
        async with Rig() as rig:
            with pytest.raises(ClientError) as err:
                await rig.client.complete("bad")
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt 'bad' is invalid" in err.value.message

    run(go())


def test_client_cancellation_and_abort_reach_the_node():
    async def go():
        async with Rig(delay_s=0.2) as rig:
            long = SamplingParams(max_tokens=200)
            stream = rig.client.generate([1], long, request_id="to-cancel")
            first = await stream.__anext__()
            assert first.token_ids == (1000,)
            await stream.aclose()  # the client goes away mid-stream
            await until(lambda: any("to-cancel" in f.cancelled for f in rig.fakes), "the node's call cancelled")
            await until(lambda: rig.router.service.running == {}, "the router to forget the request")

            task = asyncio.create_task(rig.client.complete([1], long, request_id="to-abort"))
            await until(lambda: any("to-abort" in f.running for f in rig.fakes), "the request to run")
            assert await rig.client.abort("to-abort") is True
            done = await asyncio.wait_for(task, WAIT)
            assert done.finish_reason == "abort"
            assert any("to-abort" in f.aborted for f in rig.fakes)
            assert await rig.client.abort("to-abort") is False

    run(go())


def test_duplicate_running_request_id_is_rejected():
    async def go():
        async with Rig(delay_s=0.2) as rig:
            task = asyncio.create_task(rig.client.complete([1], SamplingParams(max_tokens=50), request_id="dup"))
            await until(lambda: "dup" in rig.router.service.running, "the first request")
            with pytest.raises(ClientError) as err:
                await rig.client.complete([1], request_id="dup")
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "already running" in err.value.message
            await rig.client.abort("dup")
            await asyncio.wait_for(task, WAIT)

    run(go())


def test_dead_node_leaves_rotation_and_returns_after_restart():
    async def go():
        async with Rig() as rig:
            params = SamplingParams(max_tokens=2)
            await rig.servers[0].stop(0)
            rig.servers[0] = None
            # Immediately, before any poll noticed: the router retries on the live node.
            results = [await rig.client.complete([1], params) for _ in range(4)]
            assert {r.timings.decode_node for r in results} == {"fake-1"}
            await until(lambda: not rig.router.pool.nodes[0].healthy, "node 0 out of rotation")

            rig.servers[0] = await start_fake(rig.fakes[0], rig.ports[0])
            await until(lambda: rig.router.pool.nodes[0].healthy, "node 0 back in rotation")
            results = await asyncio.gather(*(rig.client.complete([1], params) for _ in range(4)))
            assert {r.timings.decode_node for r in results} == {"fake-0", "fake-1"}

            for i in range(2):
                await rig.servers[i].stop(0)
                rig.servers[i] = None
            await until(lambda: not rig.router.pool.healthy(), "every node out")
            with pytest.raises(ClientError) as err:
                await rig.client.complete([1], params)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE

    run(go())


async def started_stream(rig: Rig, request_id: str, max_tokens: int):
    """A Generate stream through the router, its first message, and the index of the fake node serving it."""
    stream = rig.client.generate([1], SamplingParams(max_tokens=max_tokens), request_id=request_id)
    got = [await stream.__anext__()]
    holder = next(i for i, f in enumerate(rig.fakes) if request_id in f.running)
    return stream, got, holder


async def not_serving(fake) -> None:
    """What a stopping node reports: the whole server and its services NOT_SERVING."""
    for service in ("", GENERATE_SERVICE):
        await fake.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)


def test_a_live_node_that_is_not_ready_gets_no_requests():
    # A decode node whose prefill nodes do not answer is alive ("" SERVING) but not ready (its
    # GenerateService NOT_SERVING): the router polls readiness, so it is kept out of rotation.
    async def go():
        async with Rig() as rig:
            await rig.fakes[0].health.set(GENERATE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
            await until(lambda: not rig.router.pool.nodes[0].healthy, "node 0 out of rotation")
            results = await asyncio.gather(*(rig.client.complete([1]) for _ in range(3)))
            assert {r.timings.decode_node for r in results} == {"fake-1"}
            await rig.fakes[0].health.set(GENERATE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            await until(lambda: rig.router.pool.nodes[0].healthy, "node 0 back in rotation")

    run(go())


def test_node_whose_get_node_info_fails_leaves_rotation():
    async def go():
        async with Rig() as rig:
            rig.fakes[0].info_error = "engine thread is not running"
            await until(lambda: not rig.router.pool.nodes[0].healthy, "node 0 out of rotation")
            assert "engine thread is not running" in rig.router.pool.nodes[0].reason
            results = await asyncio.gather(*(rig.client.complete([1]) for _ in range(3)))
            assert {r.timings.decode_node for r in results} == {"fake-1"}
            rig.fakes[0].info_error = None
            await until(lambda: rig.router.pool.nodes[0].healthy, "node 0 back in rotation")

    run(go())


def test_node_dying_mid_stream_moves_the_request_or_ends_it_with_an_error_message_when_none_is_left():
    # S10 (this test asserted an error ending before migration existed): the stream goes on, on the
    # other node, resumed after the tokens already streamed, with max_tokens lowered by them.
    async def go():
        async with Rig(delay_s=0.2) as rig:
            stream, got, holder = await started_stream(rig, "orphan", max_tokens=8)
            moved = sample("pdserve:router_request_migrations_total", node=f"fake-{holder}")
            await rig.servers[holder].stop(0)
            rig.servers[holder] = None
            got += [c async for c in stream]
            assert got[-1].finish_reason == "length" and not got[-1].error
            tokens = [t for c in got for t in c.token_ids]
            assert tokens == [1000 + t for t in range(8)]          # nothing lost, nothing repeated
            resumed = rig.fakes[1 - holder].requests["orphan"]
            streamed = list(resumed.resume.token_ids)
            assert streamed == tokens[:len(streamed)] and streamed
            assert resumed.resume.text_chars == sum(len(f"t{t} ") for t in range(len(streamed)))
            assert resumed.sampling.max_tokens == 8 - len(streamed) and list(resumed.token_ids.ids) == [1]
            assert sample("pdserve:router_request_migrations_total", node=f"fake-{holder}") == moved + 1
            # complete() turns an error ending into ClientError
            other = 1 - holder
            task = asyncio.create_task(rig.client.complete([1], SamplingParams(max_tokens=100), request_id="o2"))
            await until(lambda: rig.fakes[other].progress.get("o2", 0) >= 2, "the second request to stream")
            await rig.servers[other].stop(0)
            rig.servers[other] = None
            with pytest.raises(ClientError, match="failed mid-stream"):
                await asyncio.wait_for(task, WAIT)

    run(go())


# ---- back-pressure, deadlines, migration on a node marked down (S8, S10) ------------------------


def test_the_router_caps_requests_in_flight_with_resource_exhausted_and_http_429():
    async def go():
        async with Rig(delay_s=0.3, http=True, max_inflight_requests=1, retry_after_s=2.0) as rig:
            stream = rig.client.generate([1], SamplingParams(max_tokens=3), request_id="first")
            await stream.__anext__()
            with pytest.raises(ClientError) as err:
                await rig.client.complete([1], SamplingParams(max_tokens=1))
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1 requests in flight, its cap (max 1)" in str(err.value)
            async with aiohttp.ClientSession(f"http://127.0.0.1:{rig.router.http_port}") as session:
                async with session.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "2"
                    assert (await r.json())["error"]["type"] == "rate_limit_error"
            rest = [c async for c in stream]
            assert rest[-1].finish_reason == "length"
            assert (await rig.client.complete([1], SamplingParams(max_tokens=1))).finish_reason == "length"
            assert rig.router.gate.inflight == 0 and rig.router.gate.refused == 2

    run(go())


def test_a_full_node_is_skipped_and_every_node_full_is_resource_exhausted():
    async def go():
        async with Rig() as rig:
            rig.fakes[0].full = "fake-0 has 9 requests waiting, its cap (max 9)"
            for i in range(4):  # round-robin would reach fake-0 twice
                assert (await rig.client.complete([1], SamplingParams(max_tokens=1),
                                                  request_id=f"r{i}")).finish_reason == "length"
            assert len(rig.fakes[1].seen) == 4 and not rig.fakes[0].seen
            rig.fakes[1].full = "fake-1 is full too"
            with pytest.raises(ClientError) as err:
                await rig.client.complete([1], SamplingParams(max_tokens=1))
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "every decode node is full" in str(err.value)
            assert all(n.healthy for n in rig.router.pool.nodes)  # full is not down

    run(go())


def test_the_router_deadline_bounds_every_call():
    async def go():
        async with Rig(delay_s=0.4, request_timeout_s=1.0) as rig:
            with pytest.raises(ClientError) as err:  # the fake needs ~2 s for 5 tokens
                await rig.client.complete([1], SamplingParams(max_tokens=5))
            # the deadline hit after the stream began: it ends with an error message naming it
            assert "deadline of 1 s" in str(err.value)
            rig.fakes[0].delay_s = rig.fakes[1].delay_s = 2.0
            with pytest.raises(ClientError) as err:   # before the first message: DEADLINE_EXCEEDED
                await rig.client.complete([1], SamplingParams(max_tokens=5))
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: not any(f.running for f in rig.fakes), "both nodes to see their calls end")

    run(go())


def test_a_node_marked_down_mid_stream_hands_its_streams_to_another_node():
    # A node that stops answering (SIGSTOP, a partition) is marked down by the health poll; its
    # streams move at once instead of hanging until their deadline (S10).
    async def go():
        async with Rig(delay_s=0.3) as rig:
            stream, got, holder = await started_stream(rig, "moved", max_tokens=6)
            await not_serving(rig.fakes[holder])
            got += [c async for c in stream]
            assert [t for c in got for t in c.token_ids] == [1000 + t for t in range(6)]
            assert got[-1].finish_reason == "length" and "moved" in rig.fakes[1 - holder].requests
            await until(lambda: "moved" in rig.fakes[holder].cancelled, "the down node's call to be cancelled")

    run(go())


def test_a_node_marked_down_keeps_the_streams_that_cannot_move():
    # With no migration left (max_migrations=0 here), a slow node marked down may still finish: its
    # streams are not cut.
    async def go():
        async with Rig(delay_s=0.3, max_migrations=0) as rig:
            stream, got, holder = await started_stream(rig, "stays", max_tokens=5)
            await not_serving(rig.fakes[holder])
            await until(lambda: not rig.router.pool.nodes[holder].healthy, "the node to be marked down")
            got += [c async for c in stream]
            assert [t for c in got for t in c.token_ids] == [1000 + t for t in range(5)]
            assert got[-1].finish_reason == "length" and "stays" not in rig.fakes[1 - holder].requests

    run(go())


def test_a_node_marked_down_keeps_a_stream_whose_other_nodes_were_all_tried():
    # Node 0 (first by rank when both are idle) refuses the request as full, so node 1 serves it;
    # node 1 is then marked down. The only other healthy node was tried already (a move would
    # end in an error), so the slow node may still finish: the stream is not cut.
    async def go():
        async with Rig(delay_s=0.3) as rig:
            rig.fakes[0].full = "busy"
            stream = rig.client.generate([1], SamplingParams(max_tokens=5), request_id="tried")
            got = [await stream.__anext__()]
            assert "tried" in rig.fakes[1].running and "tried" not in rig.fakes[0].requests
            await not_serving(rig.fakes[1])
            await until(lambda: not rig.router.pool.nodes[1].healthy, "node 1 to be marked down")
            assert rig.router.pool.nodes[0].healthy
            got += [c async for c in stream]
            assert [t for c in got for t in c.token_ids] == [1000 + t for t in range(5)]
            assert got[-1].finish_reason == "length" and "tried" not in rig.fakes[1].cancelled

    run(go())


# ---- the client alone --------------------------------------------------------------------------


def test_build_request_prompt_kinds_and_errors():
    assert build_request("x").text == "x"
    assert list(build_request([1, 2]).token_ids.ids) == [1, 2]
    msgs = build_request([{"role": "user", "content": "hi"}, ("assistant", "yo")]).messages.messages
    assert [(m.role, m.content) for m in msgs] == [("user", "hi"), ("assistant", "yo")]
    req = build_request([1], SamplingParams(temperature=0, max_tokens=5), request_id="r")
    assert req.request_id == "r" and req.sampling.max_tokens == 5 and req.sampling.temperature == 0
    for bad, match in (([], "empty"), ([1, -2], ">= 0"), ([{"role": "user"}], "chat message"), (3.5, "prompt must")):
        with pytest.raises(ValueError, match=match):
            build_request(bad)


def test_client_maps_connection_failure_to_client_error():
    (port,) = free_ports(1)
    with Client(f"127.0.0.1:{port}", timeout=2.0) as client:
        with pytest.raises(ClientError) as err:
            client.complete("x")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.message


# ---- prefix routing and the router's metrics ------------------------------------------------------


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_prefix_routing_keeps_each_family_on_one_node_and_metrics_count_every_request():
    families = [f"family {i}: " + "shared system prompt text " * 10 for i in range(4)]

    async def go():
        async with Rig(routing=RoutingConfig(policy="prefix")) as rig:
            ok0 = sample("pdserve:request_success_total", model_name="fake", finished_reason="length")
            ttft0 = sample("pdserve:time_to_first_token_seconds_count", model_name="fake")
            itl0 = sample("pdserve:inter_token_latency_seconds_count", model_name="fake")
            e2e0 = sample("pdserve:e2e_request_latency_seconds_count", model_name="fake")
            prefix0 = sum(sample("pdserve:router_requests_routed_total", node=f"fake-{i}", reason="prefix")
                          for i in range(2))
            bad0 = sample("pdserve:router_request_errors_total", code="INVALID_ARGUMENT")
            params = SamplingParams(max_tokens=3)
            first = [await rig.client.complete(f + "first question", params) for f in families]
            homes = [r.timings.decode_node for r in first]
            assert sorted(homes) == ["fake-0", "fake-0", "fake-1", "fake-1"], homes  # idle: alternating
            for round_ in range(3):
                results = await asyncio.gather(*(rig.client.complete(f + f"question {round_}", params)
                                                 for f in families))
                assert [r.timings.decode_node for r in results] == homes
            with pytest.raises(ClientError):
                await rig.client.complete("bad")
            n = 4 * 4
            assert sample("pdserve:request_success_total", model_name="fake", finished_reason="length") == \
                ok0 + n
            assert sample("pdserve:time_to_first_token_seconds_count", model_name="fake") == ttft0 + n
            assert sample("pdserve:inter_token_latency_seconds_count", model_name="fake") == itl0 + 2 * n
            assert sample("pdserve:e2e_request_latency_seconds_count", model_name="fake") == e2e0 + n
            prefix = sum(sample("pdserve:router_requests_routed_total", node=f"fake-{i}", reason="prefix")
                         for i in range(2))
            assert prefix == prefix0 + 3 * 4
            assert sample("pdserve:router_request_errors_total", code="INVALID_ARGUMENT") == bad0 + 1

            # a node out of rotation is forgotten: its families move, and stay where they moved
            await rig.servers[0].stop(0)
            rig.servers[0] = None
            await until(lambda: not rig.router.pool.nodes[0].healthy, "node 0 out of rotation")
            moved = [await rig.client.complete(f + "later", params) for f in families]
            assert {r.timings.decode_node for r in moved} == {"fake-1"}
            policy = rig.router.pool.policy
            for f in families:
                held = policy.index.matches(prompt_hashes(build_request(f + "x"), policy.config))
                assert set(held) == {rig.router.pool.nodes[1].address}, held

    run(go())
