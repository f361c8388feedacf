"""Discovery (K4, pdserve.serving.discovery): `dns:NAME:PORT` entries beside static addresses, resolved
at every poll round through the resolver seam. The router's NodePool and the decode node's
PrefillPool pick up nodes that join, leave or come back at a new address, without a restart: here
against real gRPC servers on loopback (grpc.health.v1 and NodeService), the names fed by a test
resolver as a headless Service's records would change."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest
from support.net import free_port

from decode_node.prefill_pool import PrefillPool
from pdserve.serving.discovery import FileResolver, Membership, StaticResolver, Target, parse_targets
from pdserve_api.servers import add_standard_services_aio
from pdserve_api.v1 import generate_pb2, node_pb2, node_pb2_grpc
from router.config import RouterConfig
from router.nodes import NodePool

NAME = "pdserve-decode.pdserve.svc.cluster.local"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_targets_parse_static_and_dns_entries_and_name_bad_ones():
    static, dynamic = parse_targets(f"127.0.0.1:50071, dns:{NAME}:50071")
    assert (static.dynamic, static.host, static.port) == (False, "127.0.0.1", 50071)
    assert (dynamic.dynamic, dynamic.host, dynamic.port) == (True, NAME, 50071)
    assert Target.parse("[::1]:9").host == "::1"
    for bad in ("dns:name", "dns::80", "host:0", "host:http"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            Target.parse(bad)


def test_membership_follows_the_records_and_keeps_the_last_answer_on_a_resolver_error():
    resolver = StaticResolver({NAME: ["127.0.0.2:50071", "127.0.0.3:50071"]})
    m = Membership(("127.0.0.9:1", f"dns:{NAME}:50071"), resolver)
    assert m.current == m.static == ("127.0.0.9:1",)
    change = run(m.refresh())
    assert change.added == ("127.0.0.2:50071", "127.0.0.3:50071") and change.removed == ()
    assert run(m.refresh()) is None
    resolver.set(NAME, ["127.0.0.3:50071", "127.0.0.4:50071"])   # one pod replaced by another
    change = run(m.refresh())
    assert (change.added, change.removed) == (("127.0.0.4:50071",), ("127.0.0.2:50071",))
    assert change.current == ("127.0.0.9:1", "127.0.0.3:50071", "127.0.0.4:50071")
    empty = StaticResolver()   # the name stops resolving (NXDOMAIN, DNS down): keep what we had
    m.resolver = empty
    assert run(m.refresh()) is None and len(m.current) == 3
    m.resolver = StaticResolver({NAME: []})   # resolves to nothing: its share is gone
    assert run(m.refresh()).current == ("127.0.0.9:1",)


def test_the_dns_resolver_and_the_file_resolver(tmp_path):
    m = Membership(("dns:localhost:50071",))   # the default resolver: the system's
    change = run(m.refresh())
    assert "127.0.0.1:50071" in change.current
    records = tmp_path / "records.json"
    records.write_text(json.dumps({NAME: ["127.0.0.5:1"]}))
    assert FileResolver(records).resolve(NAME, 1) == ("127.0.0.5:1",)
    with pytest.raises(socket.gaierror):
        FileResolver(records).resolve("other", 1)


class _Node(node_pb2_grpc.NodeServiceServicer):
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id=self.node_id)


async def _serve(node_id: str) -> tuple[grpc.aio.Server, str]:
    """A real gRPC server on loopback with what the pools poll: grpc.health.v1 (SERVING, the whole
    server and a decode node's readiness, GenerateService) and NodeService."""
    server = grpc.aio.server()
    node_pb2_grpc.add_NodeServiceServicer_to_server(_Node(node_id), server)
    await add_standard_services_aio(server, ["pdserve.api.v1.GenerateService", "pdserve.api.v1.NodeService"],
                                    serving=True)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


def test_the_router_picks_up_decode_nodes_that_join_and_leave_without_a_restart():
    async def main() -> None:
        (a, addr_a), (b, addr_b), (c, addr_c) = [await _serve(f"decode-{i}") for i in range(3)]
        resolver = StaticResolver({NAME: [addr_a]})
        pool = NodePool(RouterConfig(decode_nodes=(f"dns:{NAME}:50071",), health_interval_s=0.1), resolver=resolver)
        request = generate_pb2.GenerateRequest(text="hello")
        try:
            await pool.start()
            assert [n.address for n in pool.healthy()] == [addr_a]
            resolver.set(NAME, [addr_a, addr_b])   # a pod joins
            await pool.poll_all()
            assert sorted(n.address for n in pool.healthy()) == sorted([addr_a, addr_b])
            node, _ = pool.route(request)
            node.begin("r1", 10)   # a request in flight on it when it leaves
            leaving = node
            staying = addr_b if leaving.address == addr_a else addr_a
            resolver.set(NAME, [staying, addr_c])   # one pod gone, a new one at a new address
            await pool.poll_all()
            assert sorted(n.address for n in pool.healthy()) == sorted([staying, addr_c])
            assert leaving.channel is not None, "a node that left keeps its channel while a request runs there"
            assert {pool.route(request)[0].address for _ in range(4)} <= {staying, addr_c}
            leaving.end("r1")
            await pool.poll_all()
            assert leaving.channel is None
        finally:
            await pool.close()
            for s in (a, b, c):
                await s.stop(0)

    run(main())


def test_a_static_router_list_is_unchanged():
    async def main() -> None:
        server, address = await _serve("decode-0")
        pool = NodePool(RouterConfig(decode_nodes=(address,)), resolver=StaticResolver())
        try:
            await pool.start()
            await pool.poll_all()
            assert [n.address for n in pool.nodes] == [address] and pool.healthy()
        finally:
            await pool.close()
            await server.stop(0)

    run(main())


def test_the_decode_nodes_prefill_pool_follows_the_records():
    name = "pdserve-prefill.pdserve.svc.cluster.local"

    async def main() -> None:
        (a, addr_a), (b, addr_b) = [await _serve(f"prefill-{i}") for i in range(2)]
        pool = PrefillPool([f"dns:{name}:50061"])
        resolver = StaticResolver({name: [addr_a]})
        pool.members.resolver = resolver
        try:
            await pool.refresh()
            assert [(n.address, n.node_id) for n in pool.nodes] == [(addr_a, "prefill-0")]
            resolver.set(name, [addr_a, addr_b])
            await pool.refresh()
            assert sorted((n.address, n.node_id) for n in pool.nodes) == sorted(
                [(addr_a, "prefill-0"), (addr_b, "prefill-1")])
            (first,) = [n for n in pool.nodes if n.address == addr_a]
            first.sent_tokens = 7   # a prefill in flight there
            resolver.set(name, [addr_b])
            await pool.refresh()
            assert [n.address for n in pool.nodes] == [addr_b]
            assert first in pool._retired
            first.sent_tokens = 0
            first.holds = 1         # a quarantine still asks it to confirm an abort: channel kept
            await pool.refresh()
            assert first in pool._retired
            first.holds = 0
            await pool.refresh()
            assert first not in pool._retired
        finally:
            await pool.close()
            for s in (a, b):
                await s.stop(0)

    run(main())
