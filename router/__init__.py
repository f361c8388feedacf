"""pdserve's router: the cluster's front door (R1, R3, D2).

Clients call GenerateService on the router; it forwards each request unchanged to the decode node
with the least outstanding work among the healthy ones, streams the answer back, and carries
cancellation and Abort through. It holds no model weights.

    python -m router --host 127.0.0.1 --port 50051 --decode 127.0.0.1:50061,127.0.0.1:50062

Modules: config (RouterConfig), nodes (NodePool: health and load polling, selection), service
(the forwarding GenerateService), server (RouterServer: grpc.aio server, health, reflection).
"""

from router.config import RouterConfig
from router.server import RouterServer, run, serve

__all__ = ["RouterConfig", "RouterServer", "run", "serve"]
