"""The router's front door: the GenerateService clients call, and the same calls for the HTTP API.

    front = RouterFront(forward, pool, limits)      # forward: router.service.RouterGenerateService
    add_GenerateServiceServicer_to_server(front, server)
    HttpApi(front, http_config, limits)            # front is also the HTTP API's Backend

What it adds to forwarding (router.service): every Generate request is checked first
(router.limits.check_request: INVALID_ARGUMENT for malformed requests, before any node is
bothered), then admitted through one AdmissionGate for gRPC and HTTP together (S8: more than
RouterConfig.max_inflight_requests at once are refused with RESOURCE_EXHAUSTED, HTTP 429 with
Retry-After; pdserve.serving.admission), after a per-client cap (RouterConfig.max_inflight_per_client:
one client, by API key or peer address, router.clients, is refused the same way past it, so that it
cannot take every slot), and Health answers with every decode node's state. A gRPC stream's every
message must be taken by the client within RouterConfig.write_timeout_s (router.clients.write_deadline):
a client that reads nothing is cut (DEADLINE_EXCEEDED), its slots freed and the forwarded call
closed, which cancels it on the decode node; the HTTP API applies the same deadline to SSE events.
A gRPC RESOURCE_EXHAUSTED answer carries the retry hint (HTTP's Retry-After, whole seconds) as
trailing metadata `retry-after`.
Generate, Abort and ListModels are otherwise the forwarder's, unchanged, for gRPC and HTTP alike:
an HTTP request is one more Generate call, whose cancellation reaches the nodes the same way (R4).

Runs on the router's asyncio loop, like everything in the router.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc

from pdserve.serving.admission import AdmissionGate, ClientGate, ResourceExhaustedError
from pdserve.serving.metrics import router_metrics
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc
from router.clients import grpc_client, write_deadline
from router.config import RouterConfig
from router.limits import RequestLimits, check_request
from router.nodes import NodePool
from router.service import RouterGenerateService

RETRY_AFTER_KEY = "retry-after"   # trailing metadata of a RESOURCE_EXHAUSTED answer: seconds to wait


class _NoDeadline:
    """The part of grpc.aio.ServicerContext that the forwarder reads, for calls that come over HTTP
    (an HTTP request brings no deadline of its own: the router's request_timeout_s bounds it)."""

    def time_remaining(self) -> float | None:
        return None


class RouterFront(generate_pb2_grpc.GenerateServiceServicer):
    """GenerateService as clients see it; also the HTTP API's backend (router.http_api.Backend)."""

    def __init__(self, forward: RouterGenerateService, pool: NodePool, limits: RequestLimits,
                 gate: AdmissionGate | None = None, clients: ClientGate | None = None,
                 write_timeout_s: float = RouterConfig.write_timeout_s, shared_token: str | None = None) -> None:
        self.forward = forward
        self.pool = pool
        self.limits = limits
        self.gate = gate or AdmissionGate("the router", max_inflight=RouterConfig.max_inflight_requests)
        self.clients = clients or ClientGate("the router", max_per_client=RouterConfig.max_inflight_per_client)
        self.write_timeout_s = write_timeout_s
        self._shared_token = shared_token   # the router's gRPC --auth-token: names no one client

    @contextlib.contextmanager
    def admit(self, client: str, api: str) -> Iterator[None]:
        """One Generate call of `client` in flight: its per-client slot, then the router's
        (ResourceExhaustedError when either is full); both released on leaving."""
        try:
            mine = self.clients.enter(client)
        except ResourceExhaustedError:
            router_metrics().client_refused.labels(api=api).inc()
            raise
        with mine, self.gate.enter() as ticket:
            ticket.started()
            yield

    # --- gRPC -------------------------------------------------------------------------------------

    async def Generate(  # gRPC method name
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Written with context.write, not yielded, so that each write has its deadline.
        check_request(request, self.limits, self.context_length())
        try:
            with self.admit(grpc_client(context.invocation_metadata(), context.peer(), self._shared_token), "grpc"):
                async with contextlib.aclosing(self.forward.Generate(request, context)) as stream:
                    async for response in stream:
                        async with write_deadline(self.write_timeout_s, "grpc", request.request_id):
                            await context.write(response)
        except ResourceExhaustedError as e:   # HTTP's Retry-After, as trailing metadata (whole seconds)
            context.set_trailing_metadata(((RETRY_AFTER_KEY, e.retry_after_header),))
            raise

    async def Abort(  # gRPC method name
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        return await self.forward.Abort(request, context)

    async def ListModels(  # gRPC method name
        self, request: generate_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ListModelsResponse:
        return await self.forward.ListModels(request, context)

    async def Health(  # gRPC method name
        self, request: generate_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.HealthResponse:
        return await self.health()

    # --- the HTTP API's backend -------------------------------------------------------------------

    async def stream(self, request: generate_pb2.GenerateRequest,
                     client: str) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Generate for an HTTP request of `client` (router.clients.http_client); errors surface at
        the first `anext`, closing cancels it."""
        check_request(request, self.limits, self.context_length())
        with self.admit(client, "http"):
            async with contextlib.aclosing(self.forward.Generate(request, _NoDeadline())) as stream:  # type: ignore[arg-type]
                async for response in stream:
                    yield response

    async def list_models(self) -> generate_pb2.ListModelsResponse:
        return await self.forward.ListModels(generate_pb2.ListModelsRequest(), _NoDeadline())  # type: ignore[arg-type]

    async def health(self) -> generate_pb2.HealthResponse:
        reply = generate_pb2.HealthResponse(serving=bool(self.pool.healthy()))
        for node in self.pool.nodes:
            entry = reply.nodes.add(address=node.address, node_id=node.node_id, serving=node.healthy,
                                    reason=node.reason, router_inflight=len(node.inflight))
            if node.info is not None:
                entry.load.CopyFrom(node.info.load)
        return reply

    def context_length(self) -> int | None:
        known = [n.info.max_context_length for n in self.pool.healthy() if n.info is not None
                 and n.info.max_context_length]
        return min(known) if known else None

    def default_model(self) -> str:
        for node in self.pool.healthy():
            if node.info is not None and node.info.model:
                return node.info.model
        return ""
