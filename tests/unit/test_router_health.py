"""The router's health poll: a node that answers its health Check late once stays in rotation; one
that misses `health_misses` Checks in a row, or refuses, or answers NOT_SERVING, is out (S8: a busy
node under a burst answers late now and then; taking it out would move every stream on it)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_api.v1 import node_pb2, node_pb2_grpc
from router.config import RouterConfig
from router.nodes import NodePool
from tests.support.net import free_port


class _Health(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.delay_s = 0.0
        self.status = health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request, context):
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=self.status)


class _Node(node_pb2_grpc.NodeServiceServicer):
    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id="d0", role=node_pb2.NODE_ROLE_DECODE, model="tiny")


def test_a_late_health_answer_is_tolerated_until_misses_in_a_row():
    async def main() -> None:
        health = _Health()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        node_pb2_grpc.add_NodeServiceServicer_to_server(_Node(), server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        pool = NodePool(RouterConfig(decode_nodes=(address,), health_interval_s=60, health_timeout_s=0.2,
                                     health_misses=2))
        try:
            await pool.start()
            (node,) = pool.nodes
            assert node.healthy
            health.delay_s = 0.5            # one late answer: still in rotation
            await pool.poll_all()
            assert node.healthy and node.missed == 1
            health.delay_s = 0.0            # on time again: the count starts over
            await pool.poll_all()
            assert node.healthy and node.missed == 0
            health.delay_s = 0.5            # two late answers in a row: out, and the reason says so
            await pool.poll_all()
            await pool.poll_all()
            assert not node.healthy and "DEADLINE_EXCEEDED" in node.reason and "2 in a row" in node.reason
            health.delay_s = 0.0            # back at the first poll that succeeds
            await pool.poll_all()
            assert node.healthy
            health.status = health_pb2.HealthCheckResponse.NOT_SERVING   # not serving: out at once
            await pool.poll_all()
            assert not node.healthy and "NOT_SERVING" in node.reason
            health.status = health_pb2.HealthCheckResponse.SERVING
            await pool.poll_all()
            assert node.healthy
            await server.stop(0)            # refused: out at once, no grace
            await pool.poll_all()
            assert not node.healthy and "UNAVAILABLE" in node.reason
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_health_misses_is_validated():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="health_misses"):
            RouterConfig(decode_nodes=("127.0.0.1:1",), health_misses=bad)
