"""The prefill node's gRPC front: PrefillService, NodeService, health and reflection on grpc.aio.

`serve(options)` binds the port first (health NOT_SERVING), builds the engine and the fabric
endpoint in a worker thread, turns health SERVING and prints the serving line; on SIGTERM/SIGINT
it turns health NOT_SERVING, refuses new prefills, fails the in-flight ones with UNAVAILABLE,
stops the server, closes the fabric endpoint and the engine, and returns 0.

Metrics (R5), with `ServeOptions.metrics_port` set: GET /metrics on the loop (MetricsServer), bound
with the gRPC port before the model loads; the engine's gauges (EngineCollector over
AsyncEngine.last_metrics) once it has loaded; per answered Prefill, pdserve:prefill_requests_total
by outcome and, for the ones that succeeded, the queue time (receipt to first scheduled chunk), the
prefill time (first chunk to last layer), and the KV bytes sent and seconds its writes were in
flight (side="prefill").

Threads: everything here runs on the asyncio loop, except the node's construction (a worker
thread) and its final `close` (blocking, after the server has stopped). Exceptions raised by the
handlers become statuses through AioExceptionToStatusInterceptor (ValueError -> INVALID_ARGUMENT,
UnavailableError -> UNAVAILABLE, TimeoutError -> DEADLINE_EXCEEDED, AbortedError -> ABORTED).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from pdserve_api.convert import peer_from_bytes, peer_to_bytes, target_from_pb
from pdserve_api.servers import AioExceptionToStatusInterceptor, UnavailableError, add_standard_services_aio
from pdserve_api.v1 import common_pb2, node_pb2, node_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from pdserve.serving.logs import bind_request_id
from pdserve.serving.metrics import REGISTRY, node_metrics, prefill_metrics
from pdserve.serving.metrics.engine_collector import EngineCollector
from pdserve.serving.metrics.server import MetricsServer
from prefill_node.service import AbortedError, NodeConfig, PrefillNode, PrefillOutcome, PrefillSpec

logger = logging.getLogger(__name__)

SERVICE_NAMES = (
    prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name,
    node_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
)
STOP_GRACE_S = 2.0


class _Holder:
    """The node once it is built (None while the model loads)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.node: PrefillNode | None = None

    def require(self) -> PrefillNode:
        if self.node is None:
            raise UnavailableError(f"prefill node {self.node_id} is starting (model loading)")
        return self.node


def spec_from_pb(req: prefill_pb2.PrefillRequest) -> PrefillSpec:
    """The wire request -> a PrefillSpec; malformed fields raise ValueError naming them."""
    rid = req.request_id
    if not rid:
        raise ValueError("request_id is empty")
    if not req.token_ids:
        raise ValueError(f"request {rid}: no tokens to prefill (token_ids is empty)")
    if not req.HasField("peer") or not req.peer.descriptor:
        raise ValueError(f"request {rid}: the decode node's fabric peer is missing")
    if not req.HasField("context") or not req.context.descriptor:
        raise ValueError(f"request {rid}: a context slot is required (its write is part of expected_writes)")
    peer = peer_from_bytes(req.peer.descriptor)
    if req.peer.provider and req.peer.provider != peer.provider:
        raise ValueError(f"request {rid}: peer.provider {req.peer.provider!r} differs from the descriptor's "
                         f"{peer.provider!r}")
    return PrefillSpec(
        request_id=rid,
        token_ids=list(req.token_ids),
        target=target_from_pb(req),
        peer=peer,
        model=req.model,
        deadline_s=_deadline(req),
        decode_tp_size=req.sharding.tp_size if req.HasField("sharding") else 1,
        cached_tokens=req.cached_tokens,
        context_capacity=req.context.capacity,
        context_top_k=req.context.logits_top_k,
    )


def _deadline(req: prefill_pb2.PrefillRequest) -> float | None:
    if not req.HasField("deadline_s"):
        return None
    d = req.deadline_s
    if not d > 0 or d != d or d == float("inf"):
        raise ValueError(f"request {req.request_id}: deadline_s={d!r} must be a finite number of seconds > 0")
    return d


def outcome_of(e: BaseException) -> str:
    """The `outcome` label of a Prefill that raised `e`."""
    if isinstance(e, ValueError):
        return "invalid"
    if isinstance(e, AbortedError):
        return "aborted"
    if isinstance(e, UnavailableError):
        return "unavailable"
    if isinstance(e, TimeoutError):
        return "timeout"
    return "error"


def observe(model_name: str, out: PrefillOutcome) -> None:
    """Metrics of one Prefill that succeeded."""
    node, prefill = node_metrics(), prefill_metrics()
    r = out.result
    prefill.requests.labels(model_name=model_name, outcome="ok").inc()
    prefill.prefill_time.labels(model_name=model_name).observe(out.compute_time_s)
    node.queue_time.labels(model_name=model_name).observe(out.queue_time_s)
    node.kv_transfer_bytes.labels(model_name=model_name, side="prefill").inc(r.bytes_written)
    node.kv_transfer_seconds.labels(model_name=model_name, side="prefill").observe(
        max(0.0, r.done_time - r.first_post_time))


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, holder: _Holder) -> None:
        self._holder = holder

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> prefill_pb2.PrefillResponse:
        node = self._holder.require()
        bind_request_id(request.request_id)  # this handler task serves one request
        try:
            spec = spec_from_pb(request)
            logger.debug("request %s: prefill of %d tokens into %d pages", spec.request_id, len(spec.token_ids),
                         len(spec.target.dst_pages))
            out = await node.prefill(spec)
        except Exception as e:  # counted by kind, then raised on to the interceptor unchanged
            prefill_metrics().requests.labels(model_name=node.model_name, outcome=outcome_of(e)).inc()
            raise
        observe(node.model_name, out)
        r = out.result
        return prefill_pb2.PrefillResponse(
            request_id=spec.request_id, num_writes=r.num_writes, bytes_written=r.bytes_written,
            prefill_cached_tokens=out.cached_tokens,
            timings=prefill_pb2.PrefillTimings(queue_time_s=out.queue_time_s, compute_time_s=out.compute_time_s,
                                               last_layer_to_completion_s=out.last_layer_to_completion_s),
        )

    async def AbortPrefill(self, request: prefill_pb2.AbortPrefillRequest, context: grpc.aio.ServicerContext
                           ) -> prefill_pb2.AbortPrefillResponse:
        node = self._holder.require()
        return prefill_pb2.AbortPrefillResponse(confirmed=await node.abort(request.request_id))


class NodeServicer(node_pb2_grpc.NodeServiceServicer):
    def __init__(self, holder: _Holder) -> None:
        self._holder = holder

    async def GetNodeInfo(self, request: node_pb2.GetNodeInfoRequest, context: grpc.aio.ServicerContext
                          ) -> node_pb2.NodeInfo:
        node = self._holder.require()
        load = await node.load()
        return node_pb2.NodeInfo(
            node_id=node.node_id,
            role=node_pb2.NODE_ROLE_PREFILL,
            model=node.model_name,
            sharding=common_pb2.ShardingScheme(tp_size=1, kv_heads_per_rank=node.num_kv_heads,
                                               total_kv_heads=node.num_kv_heads),
            load=common_pb2.NodeLoad(
                outstanding_requests=load.outstanding_requests, outstanding_tokens=load.outstanding_tokens,
                waiting_requests=load.waiting_requests, running_requests=load.running_requests,
                free_kv_blocks=load.free_kv_blocks, total_kv_blocks=load.total_kv_blocks,
                page_size=node.page_size,
            ),
            num_layers=node.num_layers,
            max_context_length=node.max_model_len,
            fabric_peer=peer_to_bytes(node.peer),
        )


@dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    node: NodeConfig
    metrics_port: int = 0  # GET /metrics on host:metrics_port; 0: no metrics server

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")


async def serve(opts: ServeOptions) -> int:
    """Run the node until SIGTERM/SIGINT; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node_id = opts.node.node_id
    holder = _Holder(node_id)
    server = grpc.aio.server(interceptors=[AioExceptionToStatusInterceptor()],
                             options=[("grpc.so_reuseport", 0)])
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(holder), server)
    node_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(holder), server)
    health = await add_standard_services_aio(server, SERVICE_NAMES, serving=False)
    try:
        port = server.add_insecure_port(f"{opts.host}:{opts.port}")
    except RuntimeError as e:
        logger.error("prefill node %s cannot bind %s:%d: %s", node_id, opts.host, opts.port, e)
        return 1
    metrics = MetricsServer(opts.host, opts.metrics_port) if opts.metrics_port else None
    if metrics is not None:
        try:
            await metrics.start()
        except OSError as e:
            logger.error("prefill node %s: %s", node_id, e)
            await server.stop(0)
            return 1
    node_metrics()  # registered now: /metrics names every family from the start
    prefill_metrics()
    await server.start()
    logger.info("prefill node %s: gRPC bound on %s:%d, loading the model", node_id, opts.host, port)

    build = asyncio.ensure_future(asyncio.to_thread(PrefillNode, opts.node, loop))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([build, stopping], return_when=asyncio.FIRST_COMPLETED)
    try:
        node = await build   # a stop during the load still waits for it, then closes it
    except Exception as e:   # reported and turned into the exit code: nothing to serve with
        logger.error("prefill node %s failed to start: %s: %s", node_id, type(e).__name__, e)
        stopping.cancel()
        await server.stop(0)
        if metrics is not None:
            await metrics.stop()
        return 1
    holder.node = node
    REGISTRY.register(EngineCollector(lambda: node.engine.last_metrics, node.model_name))
    if not stop.is_set():
        for name in ("", *SERVICE_NAMES):
            await health.set(name, _serving())
        line = f"prefill node {node_id} serving on {opts.host}:{port} (provider {node.provider})"
        logger.info("%s", line)
        print(line, flush=True)
        await stopping
    logger.info("prefill node %s: shutting down", node_id)
    await health.enter_graceful_shutdown()
    await node.drain()
    await server.stop(STOP_GRACE_S)
    await asyncio.to_thread(node.close)
    if metrics is not None:
        await metrics.stop()
    logger.info("prefill node %s: stopped", node_id)
    return 0


def _serving() -> int:
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.SERVING
