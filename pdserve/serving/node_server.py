"""What both node servers share: their command-line flags, and one process lifecycle.

    serve_node(NodeServer(...))   bind gRPC (health NOT_SERVING) and the metrics port -> build the
                                  node in a worker thread (the model loads) -> node.start() ->
                                  health SERVING, print the serving line -> wait for SIGTERM/SIGINT
                                  (or a dead engine thread: NOT_SERVING, and keep answering so the
                                  router sees why) -> health NOT_SERVING -> node.drain() -> stop the
                                  server (STOP_GRACE_S) -> node.close().

Readiness: a node may offer `readiness() -> str` ('' when it can take work, else why not; the
decode node: no prefill node reachable and no local fallback). The watchdog asks it every
WATCHDOG_S and sets the node's service names (the readiness probe's, e.g. GenerateService)
NOT_SERVING while it answers a reason, SERVING again once it answers ''; the whole server ("",
liveness and the startup probe) stays SERVING, since the process is alive and its NodeInfo answers.

Exit codes: 0 after a clean stop; 1 when a port cannot be bound or the node fails to start; 2 when
the node refuses its configuration (a ValueError while building: bad options, a model it cannot
serve). While the node is being built its servicers answer UNAVAILABLE (`NodeHolder.require`).

Flags (`add_node_args`) have the same names and defaults on both node kinds: a prefill node and a
decode node started by hand with their defaults can talk to each other.

Security (S9): `--tls-cert/--tls-key/--tls-ca` serve mTLS and `--auth-token-file` (or
$PDSERVE_AUTH_TOKEN) checks a shared token on every call (pdserve.serving.channels); the server
also pings its clients (keepalive), so a stopped peer's calls fail within seconds.

Blocking waits, with their bounds: the node's build (none: a model load takes what it takes, and
SIGTERM during it is honoured once it ends); drain (the node's own bound); server stop
(STOP_GRACE_S); close (the node's own bound). The engine watchdog polls every
WATCHDOG_S.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health as grpc_health, health_pb2

from pdserve.engine.engine_thread import EngineThread
from pdserve.serving.channels import (
    PLAINTEXT,
    ChannelSecurity,
    add_security_args,
    add_server_port,
    aio_server,
    security_from_args,
)
from pdserve.serving.logs import add_log_args
from pdserve.serving.metrics import REGISTRY
from pdserve.serving.metrics.engine_collector import EngineCollector
from pdserve.serving.metrics.server import MetricsServer
from pdserve_api.servers import AioExceptionToStatusInterceptor, UnavailableError, add_standard_services_aio

logger = logging.getLogger(__name__)

STOP_GRACE_S = 2.0     # in-flight RPCs get this long once the server stops
WATCHDOG_S = 1.0       # how often the engine thread's liveness is checked
PREFILL_PORT = 50061   # default gRPC port of a prefill node
DECODE_PORT = 50071    # default gRPC port of a decode node
# Both node kinds use the same default provider, so that defaults pair: $FI_PROVIDER, else shm
# (one host; name "tcp;ofi_rxm", "verbs;ofi_rxm" or "efa" across hosts).
DEFAULT_PROVIDER = os.environ.get("FI_PROVIDER") or "shm"


def add_node_args(p: argparse.ArgumentParser, role: str, default_port: int) -> argparse._ArgumentGroup:
    """The flags every node server takes (listen address, id, fabric, metrics, logs)."""
    g = p.add_argument_group("node")
    g.add_argument("--host", default="127.0.0.1", help="gRPC listen address (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=default_port,
                   help=f"gRPC listen port; 0 lets the OS pick (the serving line names it) (default: {default_port})")
    g.add_argument("--node-id", default=None, help=f"this node's id in NodeInfo, logs and metrics "
                                                   f"(default: {role}-PORT)")
    g.add_argument("--provider", default=DEFAULT_PROVIDER,
                   help='libfabric provider: "shm" (same host), "tcp;ofi_rxm", "verbs;ofi_rxm", "efa"; prefill '
                        f'and decode nodes must use the same one (default: $FI_PROVIDER, else shm; now '
                        f'{DEFAULT_PROVIDER!r})')
    g.add_argument("--fabric-node", default=None, metavar="ADDRESS",
                   help="local address the fabric endpoint binds, e.g. 127.0.0.1 (ignored by shm; default: "
                        "the provider's choice)")
    g.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="serve Prometheus metrics at http://HOST:P/metrics (default 0: no metrics server)")
    add_security_args(g)
    add_log_args(g)
    return g


def check_ports(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag if --port or --metrics-port is not a port number."""
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if not 0 <= port <= 65535:
            raise ValueError(f"{flag} {port} is not a port number")


class ServedNode(Protocol):
    """What a node object offers the lifecycle."""

    node_id: str
    model_name: str
    engine: EngineThread

    async def start(self) -> None: ...      # on the serving loop, once built
    async def drain(self) -> None: ...      # refuse new work, end the in-flight work (bounded)
    async def close(self) -> None: ...      # stop the engine and the fabric (bounded)


N = TypeVar("N", bound=ServedNode)


class NodeHolder(Generic[N]):
    """The node once it is built (None while the model loads); servicers reach it through this."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.node: N | None = None

    def require(self) -> N:
        if self.node is None:
            raise UnavailableError(f"node {self.node_id} is starting (model loading)")
        return self.node


@dataclass(frozen=True)
class ServeOptions:
    """Where a node server listens."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0   # GET /metrics on host:metrics_port; 0: no metrics server
    security: ChannelSecurity = PLAINTEXT   # TLS / mTLS and the token of the gRPC port

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            v = getattr(self, name)
            if not 0 <= v < 65536:
                raise ValueError(f"{name} must be in 0..65535, got {v}")


@dataclass(frozen=True)
class NodeServer(Generic[N]):
    """One node server: how to build its node and which servicers it serves."""

    role: str                                          # "prefill node", "decode node": for logs
    node_id: str
    options: ServeOptions
    service_names: tuple[str, ...]                     # full names, for health and reflection
    add_servicers: Callable[[grpc.aio.Server, NodeHolder[N]], None]
    build: Callable[[], N]                             # slow (loads the model): runs in a worker thread
    describe: Callable[[N, int], str]                  # the serving line, given the bound port


class _HealthReporter:
    """The grpc.health.v1 statuses of one node server (its serving loop): the whole server ("") and
    the readiness services, set from the node's readiness() and its engine thread's life."""

    def __init__(self, health: grpc_health.aio.HealthServicer, service_names: tuple[str, ...], name: str) -> None:
        self._health = health               # the servicer add_standard_services_aio made
        self._service_names = service_names
        self._name = name
        self._ready: bool | None = None     # whether the service names are SERVING; None before the first check

    async def set(self, status: int, services: Sequence[str] | None = None) -> None:
        for service in ("", *self._service_names) if services is None else services:
            await self._health.set(service, status)

    async def check_ready(self, readiness: Callable[[], str]) -> None:
        why = readiness()
        if (not why) == self._ready:
            return
        names = ", ".join(self._service_names)
        if why:
            logger.warning("%s: not ready, reporting %s NOT_SERVING: %s", self._name, names, why)
            await self.set(health_pb2.HealthCheckResponse.NOT_SERVING, self._service_names)
        else:
            if self._ready is not None:
                logger.info("%s: ready again, reporting %s SERVING", self._name, names)
            await self.set(health_pb2.HealthCheckResponse.SERVING, self._service_names)
        self._ready = not why

    async def watchdog(self, engine: EngineThread, readiness: Callable[[], str]) -> None:
        # An engine thread that died cannot serve: say so to health checks (the router stops routing here).
        while engine.is_running:
            await asyncio.sleep(WATCHDOG_S)
            await self.check_ready(readiness)
        logger.critical("%s: engine thread is dead; reporting NOT_SERVING", self._name)
        await self.set(health_pb2.HealthCheckResponse.NOT_SERVING)


async def serve_node(spec: NodeServer[N]) -> int:
    """Run a node server until SIGTERM/SIGINT; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    opts, name = spec.options, f"{spec.role} {spec.node_id}"
    holder: NodeHolder[N] = NodeHolder(spec.node_id)
    server = aio_server(opts.security, interceptors=[AioExceptionToStatusInterceptor()],
                        options=[("grpc.so_reuseport", 0)])
    spec.add_servicers(server, holder)
    health = await add_standard_services_aio(server, spec.service_names, serving=False)
    try:
        port = add_server_port(server, f"{opts.host}:{opts.port}", opts.security)
    except (RuntimeError, OSError) as e:
        logger.error("%s cannot bind %s:%d: %s", name, opts.host, opts.port, e)
        return 1
    metrics = MetricsServer(opts.host, opts.metrics_port) if opts.metrics_port else None
    if metrics is not None:
        try:
            await metrics.start()
        except OSError as e:
            logger.error("%s: %s", name, e)
            await server.stop(0)
            return 1
    await server.start()
    logger.info("%s: gRPC bound on %s:%d (%s), loading the model", name, opts.host, port,
                opts.security.describe())

    build = asyncio.ensure_future(asyncio.to_thread(spec.build))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([build, stopping], return_when=asyncio.FIRST_COMPLETED)
    try:
        node = await build   # a stop during the load still waits for it, then closes it
    except Exception as e:   # reported and turned into the exit code: nothing to serve with
        logger.error("%s failed to start: %s: %s", name, type(e).__name__, e)
        stopping.cancel()
        await server.stop(0)
        if metrics is not None:
            await metrics.stop()
        return 2 if isinstance(e, ValueError) else 1
    holder.node = node
    REGISTRY.register(EngineCollector(lambda: node.engine.last_metrics, node.model_name))
    await node.start()

    readiness: Callable[[], str] = getattr(node, "readiness", None) or (lambda: "")
    reporter = _HealthReporter(health, spec.service_names, name)
    watch = None
    if not stop.is_set():
        await reporter.set(health_pb2.HealthCheckResponse.SERVING, ("",))
        await reporter.check_ready(readiness)   # the service names: SERVING now, or once the node is ready
        line = spec.describe(node, port)
        logger.info("%s", line)
        print(line, flush=True)
        watch = asyncio.create_task(reporter.watchdog(node.engine, readiness))
        await stopping
    logger.info("%s: shutting down", name)
    if watch is not None:
        watch.cancel()
    await health.enter_graceful_shutdown()
    await node.drain()
    await server.stop(STOP_GRACE_S)
    await node.close()
    if metrics is not None:
        await metrics.stop()
    logger.info("%s: stopped", name)
    return 0


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The ServeOptions of add_node_args' flags (ValueError naming a bad TLS or token file)."""
    return ServeOptions(host=args.host, port=args.port, metrics_port=args.metrics_port,
                        security=security_from_args(args))


def service_names(*descriptors: tuple[object, str]) -> tuple[str, ...]:
    """Full names of services, given (file descriptor, service name) pairs of generated modules."""
    return tuple(d.services_by_name[s].full_name for d, s in descriptors)  # type: ignore[attr-defined]


def run_main(build_parser: Callable[[], argparse.ArgumentParser], make: Callable[[argparse.Namespace], NodeServer],
             argv: Sequence[str] | None) -> int:
    """`__main__` of a node: parse, set logging up, check flags (exit 2 naming the problem), serve."""
    import sys

    from pdserve.serving.logs import setup_logging

    args = build_parser().parse_args(argv)
    try:
        setup_logging(args.log_level, args.log_format)
        check_ports(args)
        spec = make(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve_node(spec))
