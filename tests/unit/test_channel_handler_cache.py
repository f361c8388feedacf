"""aio_server's interceptors (pdserve/serving/channels.py) build each method's wrapper once: the
malformed-request parse wrapper per (method, handler object), the token refusal per method and
handler kind; and the server behaves as before, call after call, with the exception-mapping
interceptor the nodes and the router chain: a good call answers, a missing token is refused
UNAUTHENTICATED (health Check exempt), bytes that do not parse are INVALID_ARGUMENT naming the
type, a handler's ValueError is INVALID_ARGUMENT (AioExceptionToStatusInterceptor), a sync
UNIMPLEMENTED stub stays UNIMPLEMENTED. A real grpc.aio server on loopback."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from pdserve.serving.channels import (
    ChannelSecurity,
    MalformedRequestInterceptor,
    TokenAuthInterceptor,
    add_server_port,
    aio_server,
)
from pdserve_api.servers import AioExceptionToStatusInterceptor, add_standard_services_aio
from pdserve_api.v1 import generate_pb2_grpc, node_pb2, node_pb2_grpc

TOKEN = "t0ken-for-the-cache-tests-1234"
METHOD = "/pdserve.api.v1.NodeService/GetNodeInfo"


class _Node(node_pb2_grpc.NodeServiceServicer):
    def __init__(self) -> None:
        self.fail = False

    async def GetNodeInfo(self, request, context):
        if self.fail:
            raise ValueError("asked to fail")
        return node_pb2.NodeInfo(node_id="d0", model="tiny")


def _handler(servicer: _Node) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(servicer.GetNodeInfo,
                                               request_deserializer=node_pb2.GetNodeInfoRequest.FromString,
                                               response_serializer=node_pb2.NodeInfo.SerializeToString)


@dataclass(frozen=True)
class _Details:   # grpc.HandlerCallDetails: what an interceptor reads
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


def test_each_methods_wrapper_is_built_once_per_handler():
    async def main() -> None:
        handler, other = _handler(_Node()), _handler(_Node())
        current = [handler]

        async def continuation(details):
            return current[0]

        parse = MalformedRequestInterceptor()
        call = _Details(METHOD, ())
        first = await parse.intercept_service(continuation, call)
        assert first is not handler and first.request_deserializer is None   # the parse moved inside
        assert await parse.intercept_service(continuation, call) is first
        current[0] = other                                   # another handler object: its own wrapper
        second = await parse.intercept_service(continuation, call)
        assert second is not first and await parse.intercept_service(continuation, call) is second

        token = TokenAuthInterceptor(TOKEN)
        current[0] = handler
        refused = await token.intercept_service(continuation, call)
        assert refused is not handler and await token.intercept_service(continuation, call) is refused
        good = _Details(METHOD, (("authorization", f"Bearer {TOKEN}"),))
        assert await token.intercept_service(continuation, good) is handler

    asyncio.run(main())


def test_the_server_answers_as_before_call_after_call():
    identity = lambda b: b  # noqa: E731 - raw bytes on the wire

    async def main() -> list[dict[str, tuple[str, str]]]:
        security = ChannelSecurity(token=TOKEN)
        node = _Node()
        server = aio_server(security, interceptors=[AioExceptionToStatusInterceptor()])
        node_pb2_grpc.add_NodeServiceServicer_to_server(node, server)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(generate_pb2_grpc.GenerateServiceServicer(), server)
        await add_standard_services_aio(server, [])
        address = f"127.0.0.1:{add_server_port(server, '127.0.0.1:0', security)}"
        await server.start()
        token = (("authorization", f"Bearer {TOKEN}"),)
        rounds = []
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                async def status(fn, body: bytes, metadata=token) -> tuple[str, str]:
                    try:
                        reply = await fn(body, metadata=metadata, timeout=10)
                        return "OK", node_pb2.NodeInfo.FromString(reply).node_id if fn is info else ""
                    except grpc.aio.AioRpcError as e:
                        return e.code().name, e.details() or ""

                info = channel.unary_unary(METHOD, request_serializer=identity, response_deserializer=identity)
                check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=identity,
                                            response_deserializer=identity)
                abort = channel.unary_unary("/pdserve.api.v1.GenerateService/Abort", request_serializer=identity,
                                            response_deserializer=identity)
                for _ in range(3):
                    got = {"good": await status(info, b""), "no token": await status(info, b"", None),
                           "garbage": await status(info, b"\xff" * 9),
                           "garbage no token": await status(info, b"\xff" * 9, None),
                           "health no token": await status(check, b"", None),
                           "unimplemented": await status(abort, b"")}
                    node.fail = True
                    got["handler ValueError"] = await status(info, b"")
                    node.fail = False
                    rounds.append(got)
        finally:
            await server.stop(0)
        return rounds

    rounds = asyncio.run(main())
    for got in rounds:
        assert got["good"] == ("OK", "d0")
        assert got["no token"][0] == got["garbage no token"][0] == "UNAUTHENTICATED"   # the token check first
        assert f"{METHOD}: missing or wrong auth token" in got["no token"][1]
        assert got["garbage"][0] == "INVALID_ARGUMENT"
        assert f"{METHOD}: 9 request bytes are not a valid GetNodeInfoRequest" in got["garbage"][1]
        assert got["health no token"][0] == "OK"
        assert got["unimplemented"][0] == "UNIMPLEMENTED"
        assert got["handler ValueError"] == ("INVALID_ARGUMENT", "asked to fail")
    assert rounds[0] == rounds[1] == rounds[2]
