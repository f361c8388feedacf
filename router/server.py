"""The router's servers: gRPC (GenerateService, grpc.health.v1, reflection; R1) and, when asked,
the OpenAI-compatible HTTP API (R2), both on one asyncio event loop.

    server = RouterServer(RouterConfig(port=0, decode_nodes=("127.0.0.1:50061",)),
                          http=HttpConfig(port=0))          # http=None: gRPC only
    port = await server.start()                             # server.http_port: the HTTP port
    ...
    await server.stop()

One asyncio event loop runs everything: the grpc.aio server's handler tasks, the aiohttp server's
handler tasks and the NodePool's poller task. Both APIs go through one RouterFront (router.front):
requests checked against `limits` (router.limits), then forwarded (router.service). Health: the
whole server ("") is SERVING while the router runs, and only once the HTTP API (if any) listens;
the GenerateService entry is SERVING only while at least one decode node is healthy (a readiness
probe can watch it). Both APIs refuse a request larger than `limits.max_message_bytes` before
parsing it (gRPC: the server's max receive message length, RESOURCE_EXHAUSTED; HTTP: 413); that
limit is above max_prompt_bytes, so that a prompt a little too large gets INVALID_ARGUMENT naming
its size.
`run(config, http, limits)` serves until SIGTERM or SIGINT, then stops gracefully and returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health_pb2

from pdserve.serving.admission import AdmissionGate, ClientGate
from pdserve.serving.channels import add_server_port, aio_server
from pdserve_api.servers import AioExceptionToStatusInterceptor, add_standard_services_aio
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc
from router.config import RouterConfig
from router.front import RouterFront
from router.http_api import HttpApi, HttpConfig
from router.limits import RequestLimits
from router.nodes import NodePool
from router.service import RouterGenerateService

logger = logging.getLogger(__name__)

GENERATE_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


class RouterServer:
    """A started router: `start()` binds and serves, `stop()` drains and closes."""

    def __init__(self, config: RouterConfig, http: HttpConfig | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.config = config
        self.limits = limits or RequestLimits()
        self.pool = NodePool(config, on_health_change=self._on_health_change)
        self.service = RouterGenerateService(config, self.pool)
        self.gate = AdmissionGate("the router", max_inflight=config.max_inflight_requests,
                                  retry_after_s=config.retry_after_s)
        self.clients = ClientGate("the router", max_per_client=config.max_inflight_per_client,
                                  retry_after_s=config.retry_after_s)
        self.front = RouterFront(self.service, self.pool, self.limits, self.gate, self.clients, config.write_timeout_s,
                                 config.security.token)
        self.http = HttpApi(self.front, http, self.limits, config.shutdown_grace_s,
                            config.write_timeout_s) if http is not None else None
        self._server: grpc.aio.Server | None = None
        self._health = None
        self.port: int | None = None

    @property
    def http_port(self) -> int | None:
        """The HTTP API's bound port (None without an HTTP API or before start)."""
        return self.http.port if self.http is not None else None

    async def start(self) -> int:
        """Bind, register services, poll the nodes once, serve; returns the bound gRPC port."""
        # Checked by gRPC before the message is parsed: RESOURCE_EXHAUSTED naming both sizes.
        options = [("grpc.max_receive_message_length", self.limits.max_message_bytes)]
        server = aio_server(self.config.security, interceptors=[AioExceptionToStatusInterceptor()], options=options)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(self.front, server)
        self._health = await add_standard_services_aio(server, [GENERATE_SERVICE], serving=False)
        port = add_server_port(server, self.config.listen_address, self.config.security)  # OSError if it cannot
        self._server, self.port = server, port
        await self.pool.start()
        await server.start()
        if self.http is not None:
            await self.http.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        http = f", HTTP on http://{self.http.config.host}:{self.http.port}/v1" if self.http is not None else ""
        logger.info("router serving on %s:%d%s, decode nodes %s (%d healthy)", self.config.host, port, http,
                    ",".join(self.config.decode_nodes), len(self.pool.healthy()))
        return port

    async def _on_health_change(self, any_healthy: bool) -> None:
        if self._health is None:
            return
        status = health_pb2.HealthCheckResponse.SERVING if any_healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set(GENERATE_SERVICE, status)
        if not any_healthy:
            logger.warning("no healthy decode node: %s", self.pool.unavailable_message())

    async def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, let in-flight calls finish for `grace` seconds, close node channels."""
        grace = self.config.shutdown_grace_s if grace is None else grace
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        stopping = []
        if self.http is not None:
            stopping.append(self.http.stop())
        if self._server is not None:
            stopping.append(self._server.stop(grace))
            self._server = None
        await asyncio.gather(*stopping)
        await self.pool.close()
        logger.info("router stopped")

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


async def serve(config: RouterConfig, stop: asyncio.Event | None = None, http: HttpConfig | None = None,
                limits: RequestLimits | None = None) -> None:
    """Serve until `stop` is set (or SIGTERM/SIGINT when `stop` is None)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    server = RouterServer(config, http, limits)
    await server.start()
    if server.http_port is not None:
        print(f"router HTTP API on http://{config.host}:{server.http_port}/v1", flush=True)
    try:
        await stop.wait()
        logger.info("router shutting down")
    finally:
        await server.stop()


def run(config: RouterConfig, http: HttpConfig | None = None, limits: RequestLimits | None = None) -> int:
    """Blocking entry point: serve until SIGTERM or SIGINT; returns the exit status (0)."""
    asyncio.run(serve(config, http=http, limits=limits))
    return 0
