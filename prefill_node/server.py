"""The prefill node's gRPC front: thin PrefillService and NodeService servicers over PrefillNode.

`node_server(config, options)` describes the process to pdserve.serving.node_server.serve_node,
which binds the port first (health NOT_SERVING), builds the node in a worker thread, turns health
SERVING and prints the serving line; on SIGTERM/SIGINT it turns health NOT_SERVING, the node
refuses new prefills and fails the in-flight ones with UNAVAILABLE, the server stops, and the node
closes its sender, engine and fabric endpoint.

Metrics (R5), with a metrics port: the engine's gauges (EngineCollector over
EngineThread.last_metrics) once it has loaded; per answered Prefill, pdserve:prefill_requests_total
by outcome and, for the ones that succeeded, the queue time (receipt to first scheduled chunk), the
prefill time (first chunk to last layer), and the KV bytes sent and seconds its writes were in
flight (side="prefill").

Exceptions raised by the handlers become statuses through AioExceptionToStatusInterceptor
(ValueError -> INVALID_ARGUMENT, UnavailableError -> UNAVAILABLE, TimeoutError -> DEADLINE_EXCEEDED,
AbortedError -> ABORTED).

Blocking waits and their bounds (every handler on the serving loop; no executor thread is parked
by a handler):
- Prefill: PrefillNode.prefill (prefill_node.service): the request's `deadline_s` (then at most
  ABORT_WAIT_S more for the aborted transfer), else the call's own gRPC deadline or the caller's
  cancellation; its handshake with a new decode fabric peer, 5 s. Admission never waits: past
  MAX_INFLIGHT_PREFILLS calls at once, RESOURCE_EXHAUSTED.
- AbortPrefill: PrefillNode.abort, at most ABORT_WAIT_S for an active transfer's release; the
  fence is posted, never awaited.
- GetNodeInfo: none (PrefillNode.load reads the engine's last snapshots).
- While the node builds, every handler answers UNAVAILABLE at once (NodeHolder.require).
- The process (pdserve.serving.node_server.serve_node): the model load (none: it takes what it
  takes); drain, prefill_node.service.DRAIN_WAIT_S; the server's stop, STOP_GRACE_S; close,
  CLOSE_JOIN_S + CLOSE_WAIT_S + the fabric endpoint's FABRIC_CLOSE_WAIT_S and its own bounds.
"""

from __future__ import annotations

import logging

import grpc

from kv_messenger.prefill_transfers import (
    ACTIVE,
    CONNECTION_FAILED,
    FINISHED,
    REFUSED,
    UNKNOWN,
    WRONG_ENGINE,
    AbortedError,
    AbortSpec,
)
from kv_messenger.ticket import TransferKey, TransferTicket, peer_from_bytes, peer_to_bytes, remote_from_bytes
from pdserve.serving.admission import AdmissionGate
from pdserve.serving.channels import caller_identity
from pdserve.serving.logs import bind_request_id
from pdserve.serving.metrics import node_metrics, prefill_metrics
from pdserve.serving.node_server import NodeHolder, NodeServer, ServeOptions, service_names
from pdserve_api.servers import UnavailableError
from pdserve_api.v1 import common_pb2, node_pb2, node_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prefill_node.authz import PeerBindings, authorize_abort, authorize_prefill
from prefill_node.service import PrefillNode, PrefillNodeConfig, PrefillOutcome, PrefillSpec

logger = logging.getLogger(__name__)

MAX_INFLIGHT_PREFILLS = 1024  # Prefill calls a node holds at once (queued or running); more: RESOURCE_EXHAUSTED

SERVICE_NAMES = service_names((prefill_pb2.DESCRIPTOR, "PrefillService"), (node_pb2.DESCRIPTOR, "NodeService"))


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
        target=TransferTicket.from_pb(req),
        peer=peer,
        model=req.model,
        deadline_s=_deadline(req),
        decode_tp_size=req.sharding.tp_size if req.HasField("sharding") else 1,
        cached_tokens=req.cached_tokens,
        context_capacity=req.context.capacity,
        context_top_k=req.context.logits_top_k,
        attempt=req.attempt,
    )


_STATES = {UNKNOWN: prefill_pb2.TRANSFER_STATE_UNKNOWN, ACTIVE: prefill_pb2.TRANSFER_STATE_ACTIVE,
           FINISHED: prefill_pb2.TRANSFER_STATE_FINISHED, REFUSED: prefill_pb2.TRANSFER_STATE_REFUSED,
           CONNECTION_FAILED: prefill_pb2.TRANSFER_STATE_CONNECTION_FAILED,
           WRONG_ENGINE: prefill_pb2.TRANSFER_STATE_WRONG_ENGINE}


def abort_from_pb(req: prefill_pb2.AbortPrefillRequest) -> AbortSpec:
    """The wire AbortPrefill -> an AbortSpec; malformed fields raise ValueError naming them."""
    if not req.request_id:
        raise ValueError("request_id is empty")
    if not req.decode_engine_id or not req.prefill_engine_id:
        raise ValueError(f"abort of {req.request_id}: decode_engine_id and prefill_engine_id are required "
                         f"(got {req.decode_engine_id!r}, {req.prefill_engine_id!r})")
    region = remote_from_bytes(req.fence_region) if req.fence_region else None
    if req.fence_tag and region is None:
        raise ValueError(f"abort of {req.request_id}: fence_tag {req.fence_tag} without a fence_region")
    return AbortSpec(TransferKey(req.decode_engine_id, req.request_id, req.attempt), req.prefill_engine_id,
                     req.fence_tag, region)


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
    def __init__(self, holder: NodeHolder[PrefillNode]) -> None:
        self._holder = holder
        self._bindings = PeerBindings()   # S9: decode engine -> the certificate identity its Prefills had
        # S8: Prefill calls served at once; one more is RESOURCE_EXHAUSTED (the decode node tries another)
        self._gate = AdmissionGate("this prefill node", max_inflight=MAX_INFLIGHT_PREFILLS)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> prefill_pb2.PrefillResponse:
        node = self._holder.require()
        bind_request_id(request.request_id)  # this handler task serves one request
        try:
            spec = spec_from_pb(request)
            # S9: writes only into the memory of the (authenticated) decode node that asks
            caller = caller_identity(context)
            authorize_prefill(caller, request.decode_node_id, spec, node.peer)
            if caller.authenticated:
                self._bindings.bind(spec.peer.engine_id, request.decode_node_id)
            logger.debug("request %s: prefill of %d tokens into %d pages", spec.request_id, len(spec.token_ids),
                         len(spec.target.dst_pages))
            with self._gate.enter():
                out = await node.prefill(spec)
        except Exception as e:  # counted by kind, then raised on to the interceptor unchanged
            prefill_metrics().requests.labels(model_name=node.model_name, outcome=outcome_of(e)).inc()
            raise
        observe(node.model_name, out)
        r = out.result
        return prefill_pb2.PrefillResponse(
            request_id=spec.request_id, num_writes=r.num_writes, bytes_written=r.bytes_written,
            prefill_cached_tokens=out.cached_tokens, kv_checksums=r.kv_checksums, num_kv_checksums=r.num_kv_checksums,
            timings=prefill_pb2.PrefillTimings(queue_time_s=out.queue_time_s, compute_time_s=out.compute_time_s,
                                               last_layer_to_completion_s=out.last_layer_to_completion_s),
        )

    async def AbortPrefill(self, request: prefill_pb2.AbortPrefillRequest, context: grpc.aio.ServicerContext
                           ) -> prefill_pb2.AbortPrefillResponse:
        node = self._holder.require()
        spec = abort_from_pb(request)
        authorize_abort(caller_identity(context), spec, self._bindings)   # S9: the fence is a write too
        out = await node.abort(spec)
        return prefill_pb2.AbortPrefillResponse(confirmed=out.confirmed, prefill_engine_id=node.peer.engine_id,
                                                state=_STATES[out.state], fence_posted=out.fence_posted)


class NodeServicer(node_pb2_grpc.NodeServiceServicer):
    def __init__(self, holder: NodeHolder[PrefillNode]) -> None:
        self._holder = holder

    async def GetNodeInfo(self, request: node_pb2.GetNodeInfoRequest, context: grpc.aio.ServicerContext
                          ) -> node_pb2.NodeInfo:
        node = self._holder.require()
        load = await node.load()
        return node_pb2.NodeInfo(
            node_id=node.node_id,
            role=node_pb2.NODE_ROLE_PREFILL,
            model=node.model_name,
            sharding=common_pb2.ShardingScheme(tp_size=node.tp_size, kv_heads_per_rank=node.kv_heads_per_rank,
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
            transfers=node_pb2.TransferInfo(held_requests=load.held_requests,
                                            active_transfers=load.outstanding_requests),
            build=node.identity.to_pb(),
        )


def node_server(config: PrefillNodeConfig, options: ServeOptions) -> NodeServer[PrefillNode]:
    """The prefill node's process, for serve_node."""

    def add_servicers(server: grpc.aio.Server, holder: NodeHolder[PrefillNode]) -> None:
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(holder), server)
        node_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(holder), server)
        node_metrics()  # registered now: /metrics names every family from the start
        prefill_metrics()

    def describe(node: PrefillNode, port: int) -> str:
        return f"prefill node {node.node_id} serving on {options.host}:{port} (provider {node.provider})"

    return NodeServer(role="prefill node", node_id=config.node_id, options=options, service_names=SERVICE_NAMES,
                      add_servicers=add_servicers, build=lambda: PrefillNode(config), describe=describe)
