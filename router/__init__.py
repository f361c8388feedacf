"""pdserve's router: the cluster's front door (R1, R3, D2).

Clients call GenerateService (gRPC) or the OpenAI-compatible HTTP API on the router; it checks
each request, forwards it to a healthy decode node chosen by the routing policy (least outstanding
work, or prefix-aware), streams the answer back, and carries cancellation and Abort through. It
holds no model weights.

    python -m router --host 127.0.0.1 --port 50051 --http-port 8000 --decode 127.0.0.1:50061,127.0.0.1:50062

Modules: config (RouterConfig), limits (request checks shared by gRPC and HTTP), clients (who a
call's client is, for the per-client cap; the write deadline of streamed messages), policy (routing
policies), nodes (NodePool: health and load polling, selection through the policy), service (the
forwarding GenerateService), front (the service clients call: checks, forwarding, Health),
http_api (the OpenAI-compatible HTTP server), server (RouterServer: grpc.aio + HTTP servers,
health, reflection).

Failure handling (S8, S10): every Generate call has a deadline (RouterConfig.request_timeout_s, or
the gRPC client's when shorter); at most RouterConfig.max_inflight_requests run at once, and at most
RouterConfig.max_inflight_per_client of one client (its API key, else its peer address:
router.clients); one more is refused with RESOURCE_EXHAUSTED / HTTP 429 + Retry-After
(pdserve.serving.admission); a request larger than RequestLimits.max_message_bytes is refused
before it is parsed (RESOURCE_EXHAUSTED / HTTP 413); a client that takes no streamed message for
RouterConfig.write_timeout_s is cut and its slots freed; a node that answers RESOURCE_EXHAUSTED
(its waiting queue is full) is skipped for that request; a request whose
decode node fails mid-stream is resumed on another node after the tokens already streamed
(router.service), at most RouterConfig.max_migrations times.

Every blocking wait of the router, with its bound:
- a downstream Generate stream: the call's deadline (request_timeout_s from arrival, or the
  client's); a node that stops answering is cut off sooner, when the poll marks it down (about
  health_interval_s + health_timeout_s);
- a health Check: health_timeout_s; a GetNodeInfo: load_timeout_s (router.nodes, every
  health_interval_s);
- Abort and ListModels forwarded to a node: 5 x health_timeout_s each;
- an HTTP request body: HttpConfig.body_timeout_s (then 408); an HTTP connection that sends no
  request: HttpConfig.idle_timeout_s (then closed);
- the write of one streamed message (SSE event, gRPC stream message) to a client that reads
  nothing: RouterConfig.write_timeout_s (then the stream is cut: the connection dropped, or
  DEADLINE_EXCEEDED; the downstream call cancelled);
- any call on a connection that died silently: the channels' keepalive (pdserve.serving.channels)
  fails it UNAVAILABLE (a Generate stream then migrates);
- stopping: in-flight calls get shutdown_grace_s, then are cancelled.
Nothing else waits: admission never queues (a full gate refuses at once).
"""

from router.config import RouterConfig
from router.server import RouterServer, run, serve

__all__ = ["RouterConfig", "RouterServer", "run", "serve"]
