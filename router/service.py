"""GenerateService as the router serves it: forward each call to a decode node (R1, R3, R4, D2).

Runs on the router's asyncio event loop; each Generate call is one grpc.aio handler task.

- Generate: assigns `router-<uuid>` when request_id is empty, asks the pool's routing policy for a
  healthy node (least-loaded or prefix-aware, router/policy.py), forwards the request and streams
  every response back unchanged. A node found unreachable before
  it answered anything (UNAVAILABLE) is taken out and the request goes to the next node. Any other
  downstream status is re-raised and keeps its code (the server's AioExceptionToStatusInterceptor
  maps a grpc.RpcError to its own code). A failure after the stream started ends the stream with a
  final FINISH_REASON_ERROR message naming the node (S1). A cancelled client call cancels the
  downstream call, so the decode node aborts the request and frees its pages (R4).
- Abort: forwarded to the node that holds the request; an id the router does not know is sent to
  every healthy node (it may have come through another router).
- ListModels: the first healthy node that answers.

Metrics (pdserve.serving.metrics, R5): TTFT, inter-token gaps and E2E latency as the client sees them
through the router (from the call's arrival, retries included), request_success_total by finish
reason, labelled with the serving node's model; router_request_errors_total by status code for
calls that failed before streaming.

Logs carry request ids (on every line of a call), nodes and sizes, never prompt text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from pdserve.serving.logs import bind_request_id
from pdserve.serving.metrics import RequestTimer, request_metrics, router_metrics
from pdserve_api.servers import UnavailableError
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc
from router.config import RouterConfig
from router.nodes import DecodeNode, NodePool, estimate_work

logger = logging.getLogger(__name__)


_REASONS = {generate_pb2.FINISH_REASON_STOP: "stop", generate_pb2.FINISH_REASON_LENGTH: "length",
            generate_pb2.FINISH_REASON_ABORT: "abort", generate_pb2.FINISH_REASON_ERROR: "error"}


def new_request_id() -> str:
    return f"router-{uuid.uuid4().hex}"


class RouterGenerateService(generate_pb2_grpc.GenerateServiceServicer):
    """Forwards GenerateService calls to the decode nodes of a NodePool."""

    def __init__(self, config: RouterConfig, pool: NodePool) -> None:
        self._config = config
        self._pool = pool
        self._running: dict[str, DecodeNode] = {}  # request id -> the node serving it

    @property
    def running(self) -> dict[str, DecodeNode]:
        return dict(self._running)

    async def Generate(  # gRPC method name
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        timer = RequestTimer(request_metrics())
        if not request.request_id:
            request.request_id = new_request_id()
        rid = request.request_id
        bind_request_id(rid)  # this handler task serves one request: every line it logs names it
        if rid in self._running:
            raise ValueError(f"request_id {rid!r} is already running (on {self._running[rid].address}); "
                             "ids must be unique among running requests")
        work = estimate_work(request, self._config.default_max_tokens)
        tried: list[DecodeNode] = []
        failed = False
        try:
            while True:
                node, route = self._pool.route(request, exclude=tried)
                tried.append(node)
                timer.model_name = node.info.model if node.info is not None else ""
                retry = False
                async with contextlib.aclosing(self._forward(node, request, work, context, route.reason,
                                                             timer)) as stream:
                    async for item in stream:
                        if item is None:  # unreachable before answering: try the next node
                            retry = True
                            break
                        yield item
                if not retry:
                    return
        except grpc.aio.AioRpcError as e:
            failed = True
            router_metrics().rejected.labels(code=e.code().name).inc()
            raise
        except UnavailableError:
            failed = True
            router_metrics().rejected.labels(code=grpc.StatusCode.UNAVAILABLE.name).inc()
            raise
        finally:
            if not failed:
                timer.finish("abort")  # cut short (the client went away); a no-op once finished

    async def _forward(
        self, node: DecodeNode, request: generate_pb2.GenerateRequest, work: int,
        context: grpc.aio.ServicerContext, reason: str, timer: RequestTimer,
    ) -> AsyncIterator[generate_pb2.GenerateResponse | None]:
        """Stream one attempt on `node`; yields a lone None when the node was unreachable up front."""
        rid = request.request_id
        assert node.generate is not None
        logger.info("generate request_id=%s node=%s route=%s prompt=%s est_tokens=%d inflight=%d",
                    rid, node.address, reason, request.WhichOneof("prompt"), work, len(node.inflight))
        self._running[rid] = node
        node.begin(rid, work)
        start = time.monotonic()
        call = node.generate.Generate(request, timeout=context.time_remaining())
        sent = 0
        finish = "cancelled"
        try:
            async for response in call:
                sent += 1
                timer.tokens(len(response.token_ids))
                if response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                    finish = generate_pb2.FinishReason.Name(response.finish_reason)
                    timer.finish(_REASONS.get(response.finish_reason, "error"))
                yield response
            if sent == 0:
                finish = "empty stream"
            timer.finish("error")  # a no-op after a final message; the node ended without one otherwise
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details()
            if sent == 0 and code == grpc.StatusCode.UNAVAILABLE:
                self._pool.mark_failed(node, f"Generate failed: {code.name}: {details}")
                others = [n for n in self._pool.healthy() if n is not node]
                if others:
                    logger.warning("request_id=%s node=%s unavailable (%s); retrying on another node",
                                   rid, node.address, details)
                    finish = "retried"
                    yield None
                    return
            if sent == 0:
                finish = code.name
                raise
            finish = f"ERROR ({code.name})"
            logger.warning("request_id=%s node=%s failed after %d messages: %s: %s",
                           rid, node.address, sent, code.name, details)
            timer.finish("error")
            yield generate_pb2.GenerateResponse(
                request_id=rid, finish_reason=generate_pb2.FINISH_REASON_ERROR,
                error=f"decode node {node.address} failed mid-stream: {code.name}: {details}")
        finally:
            call.cancel()  # no-op when finished; aborts the request downstream otherwise (R4)
            node.end(rid)
            if self._running.get(rid) is node:
                del self._running[rid]
            logger.info("done request_id=%s node=%s finish=%s messages=%d elapsed_s=%.3f",
                        rid, node.address, finish, sent, time.monotonic() - start)

    async def Abort(  # gRPC method name
        self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.AbortResponse:
        rid = request.request_id
        if not rid:
            raise ValueError("Abort needs a request_id")
        holder = self._running.get(rid)
        timeout = self._config.health_timeout_s * 5
        if holder is not None:
            assert holder.generate is not None
            logger.info("abort request_id=%s node=%s", rid, holder.address)
            return await holder.generate.Abort(request, timeout=timeout)
        nodes = self._pool.healthy()
        logger.info("abort request_id=%s unknown to the router; asking %d nodes", rid, len(nodes))
        replies = await asyncio.gather(*(n.generate.Abort(request, timeout=timeout) for n in nodes if n.generate),
                                       return_exceptions=True)
        aborted = any(isinstance(r, generate_pb2.AbortResponse) and r.aborted for r in replies)
        return generate_pb2.AbortResponse(aborted=aborted)

    async def ListModels(  # gRPC method name
        self, request: generate_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ListModelsResponse:
        errors: list[str] = []
        for node in self._pool.healthy():
            assert node.generate is not None
            try:
                return await node.generate.ListModels(request, timeout=self._config.health_timeout_s * 5)
            except grpc.aio.AioRpcError as e:
                errors.append(f"{node.address}: {e.code().name}: {e.details()}")
        if errors:
            raise UnavailableError(f"no decode node answered ListModels ({'; '.join(errors)})")
        raise UnavailableError(self._pool.unavailable_message())
