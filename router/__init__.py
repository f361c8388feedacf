"""pdserve's router: the cluster's front door (R1, R3, D2).

Clients call GenerateService (gRPC) or the OpenAI-compatible HTTP API on the router; it checks
each request, forwards it to a healthy decode node chosen by the routing policy (least outstanding
work, or prefix-aware), streams the answer back, and carries cancellation and Abort through. It
holds no model weights.

    python -m router --host 127.0.0.1 --port 50051 --http-port 8000 --decode 127.0.0.1:50061,127.0.0.1:50062

Modules: config (RouterConfig), limits (request checks shared by gRPC and HTTP), policy (routing
policies), nodes (NodePool: health and load polling, selection through the policy), service (the
forwarding GenerateService), front (the service clients call: checks, forwarding, Health),
http_api (the OpenAI-compatible HTTP server), server (RouterServer: grpc.aio + HTTP servers,
health, reflection).
"""

from router.config import RouterConfig
from router.server import RouterServer, run, serve

__all__ = ["RouterConfig", "RouterServer", "run", "serve"]
