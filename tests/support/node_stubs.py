"""Decode nodes that only answer NodeInfo, on real gRPC servers on loopback: what a router's node
pool polls (tests of its model vote and version-skew checks)."""

from __future__ import annotations

import grpc

from pdserve_api.servers import add_standard_services_aio
from pdserve_api.v1 import node_pb2, node_pb2_grpc
from support.net import free_port


class InfoOnlyDecode(node_pb2_grpc.NodeServiceServicer):
    """A decode node's NodeService answering its id and model, nothing else."""

    def __init__(self, node_id: str, model: str) -> None:
        self.node_id, self.model = node_id, model

    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id=self.node_id, role=node_pb2.NODE_ROLE_DECODE, model=self.model)


async def serve_node_services(servicers) -> list[tuple[grpc.aio.Server, str]]:
    """Start one aio server per NodeService servicer (serving health included, for NodeService and
    for a decode node's GenerateService, the readiness the router polls): (server, address) each,
    in order; the caller stops them."""
    servers = []
    for servicer in servicers:
        server = grpc.aio.server()
        node_pb2_grpc.add_NodeServiceServicer_to_server(servicer, server)
        await add_standard_services_aio(server, ["pdserve.api.v1.GenerateService", "pdserve.api.v1.NodeService"],
                                        serving=True)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        servers.append((server, address))
    return servers
