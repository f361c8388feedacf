"""The decode node's gRPC front: thin GenerateService and NodeService servicers over DecodeNode.

`node_server(config, options)` describes the process to pdserve.serving.node_server.serve_node
(bind, build the node in a worker thread, SERVING, SIGTERM -> NOT_SERVING, stop, close).

Metrics (pdserve.serving.metrics, R5): TTFT, inter-token gaps, E2E and request_success_total as
this node streams them; request_queue_time_seconds from receipt to admission (pages allocated);
KV transfer bytes received and seconds from the Prefill dispatch to the last write landed
(side="decode", kv_messenger.decode.attempt). The engine's gauges come from an EngineCollector over
`EngineThread.last_metrics`. Logs: every line of a request's handler or transfer task carries
its request id.

Usage (R2): cached_prompt_tokens is the engine's prefix-cache hit when colocated; when the prompt
was prefilled remotely, the prefill node's (PrefillResponse.prefill_cached_tokens), since this
node computed none of the prompt but its last token. A locally prefilled fallback reports 0.
The handler waits (briefly, service.PREFILL_RESPONSE_WAIT_S) for the Prefill response when the
request finishes before it was processed, so that timings and usage never depend on that race.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from decode_node.service import DecodeNode, DecodeNodeConfig
from pdserve.serving.admission import AdmissionGate, ResourceExhaustedError
from pdserve.serving.convert import output_to_pb
from pdserve.serving.logs import bind_request_id
from pdserve.serving.metrics import RequestTimer, request_metrics
from pdserve.serving.node_request import prepare_generate
from pdserve.serving.node_server import NodeHolder, NodeServer, ServeOptions, service_names
from pdserve_api.servers import UnavailableError
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc, node_pb2, node_pb2_grpc

SERVICE_NAMES = service_names((generate_pb2.DESCRIPTOR, "GenerateService"), (node_pb2.DESCRIPTOR, "NodeService"))

_REASONS = {generate_pb2.FINISH_REASON_STOP: "stop", generate_pb2.FINISH_REASON_LENGTH: "length",
            generate_pb2.FINISH_REASON_ABORT: "abort"}


def msg_reason(msg: generate_pb2.GenerateResponse) -> str:
    """A final message's finish reason as request_success_total labels it (anything else: error)."""
    return _REASONS.get(msg.finish_reason, "error")


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, holder: NodeHolder[DecodeNode], gate: AdmissionGate | None = None) -> None:
        self._holder = holder
        self._gate = gate or AdmissionGate("this decode node", max_waiting=DecodeNodeConfig.max_waiting_requests)

    async def Generate(self, request, context):
        node = self._holder.require()
        if node.closing:
            raise UnavailableError(f"decode node {node.node_id} is shutting down")
        rid = request.request_id or f"{node.node_id}-{uuid.uuid4().hex[:12]}"
        if request.model and request.model != node.model_name:
            raise LookupError(f"unknown model {request.model[:100]!r}; this node serves {node.model_name!r}")
        # S6 checks (input caps, max_tokens vs the context left) and S10 resume: pdserve.serving.node_request
        prepared = await prepare_generate(request, node.tokenizer, node.max_model_len)
        params, prompt = prepared.params, prepared.prompt_ids
        t0 = time.monotonic()
        bind_request_id(rid)  # this handler task serves one request: every line it logs names it
        state = node.begin(rid)   # ValueError for an id in use here
        timer = RequestTimer(request_metrics(), node.model_name, start=t0)
        first = None
        gen = prepared.outputs(node.engine.generate(prompt, params, rid, role=node.request_role))
        try:
            ticket = self._gate.enter()  # S8: RESOURCE_EXHAUSTED past --max-waiting-requests (serving.admission)
        except ResourceExhaustedError:
            node.end(state)
            raise
        try:
            async for out in gen:
                if out.new_token_ids:
                    ticket.started()  # no longer waiting
                msg = output_to_pb(out, node.tokenizer)
                if out.first_scheduled_time is not None and not state.admitted:
                    state.admitted = out.first_scheduled_time
                if first is None and out.new_token_ids:
                    first = time.monotonic()
                timer.tokens(len(out.new_token_ids))
                if out.finished:
                    now = time.monotonic()
                    remote = await node.prefill_outcome(state)
                    call_start, prefill_s, tail_s = (t0, 0.0, 0.0) if remote is None else (
                        remote.call_start, remote.prefill_s, remote.tail_s)
                    if remote is not None:  # the prompt was computed (or taken from its cache) there
                        msg.usage.cached_prompt_tokens = remote.cached_tokens
                    if node.colocated and state.admitted:  # prefilled here: from admission to the first token
                        call_start, prefill_s = state.admitted, (first or now) - state.admitted
                    msg.timings.CopyFrom(generate_pb2.ServerTimings(
                        queue_time_s=call_start - t0, prefill_time_s=prefill_s + tail_s, kv_transfer_time_s=tail_s,
                        time_to_first_token_s=(first or now) - t0, e2e_time_s=now - t0,
                        decode_node=node.node_id, prefill_node=state.prefilled_on,
                    ))
                    timer.finish(msg_reason(msg), now)
                yield msg
        except (asyncio.CancelledError, GeneratorExit):
            timer.finish("abort")  # the client went away (a no-op once finished)
            raise
        finally:
            ticket.close()
            if state.admitted:
                node.metrics.queue_time.labels(model_name=node.model_name).observe(state.admitted - t0)
            await gen.aclose()
            node.end(state)

    async def Abort(self, request, context):
        return generate_pb2.AbortResponse(aborted=await self._holder.require().engine.abort(request.request_id))

    async def ListModels(self, request, context):
        node = self._holder.require()
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.ModelInfo(id=node.model_name, max_context_length=node.max_model_len)])


class NodeServicer(node_pb2_grpc.NodeServiceServicer):
    def __init__(self, holder: NodeHolder[DecodeNode]) -> None:
        self._holder = holder

    async def GetNodeInfo(self, request, context):
        return self._holder.require().node_info()


def node_server(config: DecodeNodeConfig, options: ServeOptions) -> NodeServer[DecodeNode]:
    """The decode node's process, for serve_node."""

    def add_servicers(server: grpc.aio.Server, holder: NodeHolder[DecodeNode]) -> None:
        gate = AdmissionGate(f"decode node {config.node_id}", max_waiting=config.max_waiting_requests)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(holder, gate), server)
        node_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(holder), server)

    def describe(node: DecodeNode, port: int) -> str:
        if config.colocated:
            mode = "colocated"
        else:
            assert node.transport is not None
            mode = f"prefill nodes {', '.join(config.prefill_addresses)}, provider {node.transport.provider}"
        return f"decode node {node.node_id} serving on {options.host}:{port} ({mode})"

    return NodeServer(role="decode node", node_id=config.node_id, options=options, service_names=SERVICE_NAMES,
                      add_servicers=add_servicers, build=lambda: DecodeNode(config), describe=describe)
