"""The router's serving model (router/nodes.py NodePool._serving_model: the model most decode nodes
serve, which a node of another model is taken out for) is computed once per change of a node's
model, of its health or of the node list, and never per request or per steady poll round; it always
equals a fresh count of the votes, and routing follows it as before. Real gRPC decode-node stubs."""

from __future__ import annotations

import asyncio

from support.node_stubs import InfoOnlyDecode, serve_node_services

from pdserve_api.v1 import generate_pb2
from router.config import RouterConfig
from router.nodes import NodePool


class CountingPool(NodePool):
    """The real pool, counting how often it counts the votes."""

    counted = 0

    def _count_votes(self) -> str:
        self.counted += 1
        return super()._count_votes()


def test_the_serving_model_is_counted_once_per_change_and_routing_is_unchanged():
    async def main() -> None:
        decoders = [InfoOnlyDecode("d0", "other"), InfoOnlyDecode("d1", "tiny"), InfoOnlyDecode("d2", "tiny")]
        servers = await serve_node_services(decoders)
        a = [addr for _, addr in servers]
        pool = CountingPool(RouterConfig(decode_nodes=tuple(a), health_interval_s=60))
        request = generate_pb2.GenerateRequest(text="hello")

        def routed(n: int = 30) -> set[str]:
            return {pool.route(request)[0].address for _ in range(n)}

        def fresh() -> str:   # the count itself, past the cache
            return NodePool._count_votes(pool)

        try:
            await pool.start()
            assert pool._serving_model() == fresh() == "tiny"
            assert routed() == {a[1], a[2]}
            pool.counted = 0
            assert routed(200) == {a[1], a[2]}
            await pool.poll_all()                       # a steady round: nothing changed
            assert pool.counted == 0
            assert routed() == {a[1], a[2]}

            decoders[0].model = "tiny"                  # d0 restarted with the others' model: back
            await pool.poll_all()
            assert 1 <= pool.counted <= len(a)
            assert pool._serving_model() == fresh() == "tiny"
            assert routed() == set(a)

            pool.counted = 0
            pool.mark_failed(pool.nodes[1], "unreachable")   # a call found d1 down: its vote goes
            assert pool._serving_model() == fresh() == "tiny" and pool.counted == 1
            assert routed() == {a[0], a[2]}

            decoders[0].model = decoders[2].model = "new"    # two against one, the other way
            await pool.poll_all()                            # d1 back too (its poll succeeds)
            assert pool._serving_model() == fresh() == "new"
            assert routed() == {a[0], a[2]}
            assert pool.nodes[1].reason == "serves model 'tiny'; the other decode nodes serve 'new'"
            pool.counted = 0
            await pool.poll_all()
            assert pool.counted == 0 and routed(100) == {a[0], a[2]}
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))
