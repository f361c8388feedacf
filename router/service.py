"""GenerateService as the router serves it: forward each call to a decode node (R1, R3, R4, D2, S8, S10).

Runs on the router's asyncio event loop; each Generate call is one grpc.aio handler task.

- Generate: assigns `router-<uuid>` when request_id is empty, asks the pool's routing policy for a
  healthy node (least-loaded or prefix-aware, router/policy.py), forwards the request and streams
  every response back. A node found unreachable before it answered anything (UNAVAILABLE) is taken
  out and the request goes to the next node; a node whose queue is full (RESOURCE_EXHAUSTED) is
  skipped for this request (RESOURCE_EXHAUSTED once every node refused, or every other one was
  unreachable: back-pressure, which the HTTP API answers 429 with Retry-After). Any other downstream
  status is re-raised and keeps its code (the server's AioExceptionToStatusInterceptor maps a
  grpc.RpcError to its own code).
- Migration (S10): when the node serving a request fails mid-stream (its stream breaks with
  UNAVAILABLE, it ends the stream with an ERROR message of ERROR_CAUSE_NODE: its engine thread died
  or shut down, never a request's own error; or the pool marks it down: a failed health check or
  call; a node marked down keeps its streams when they could not move anyway), the request is re-sent
  to another healthy node with `resume` = the tokens already streamed (and how much text), its
  max_tokens lowered by them; that node continues exactly after them (pdserve.serving.node_request:
  greedy output equals an uninterrupted run; text held back by the failed node, and stop strings
  across the seam, come right), and the client's stream goes on unbroken. A seeded sampled request
  continues the seed's stream exactly (SamplingParams.rng_skip_tokens): an uninterrupted run's tokens. At most
  `RouterConfig.max_migrations` per request; past that, or with no other node, or past the
  deadline, the stream ends with a final FINISH_REASON_ERROR message naming the node (S1).
- Deadline (S8): every Generate call ends by its deadline, `RouterConfig.request_timeout_s` from its
  arrival or the gRPC client's own deadline when shorter (HTTP calls have none of their own),
  migrations included: DEADLINE_EXCEEDED before the first message, a final ERROR message after.
- A cancelled client call cancels the downstream call, so the decode node aborts the request and
  frees its pages (R4).
- Abort: forwarded to the node that holds the request; an id the router does not know is sent to
  every healthy node (it may have come through another router).
- ListModels: the first healthy node that answers.

Blocking waits, each bounded: a downstream Generate stream (the call's deadline, above; a node
that stops answering is also cut off when the pool marks it down, within about
health_interval_s + health_timeout_s); Abort and ListModels calls (5 x health_timeout_s each).

Metrics (pdserve.serving.metrics, R5): TTFT, inter-token gaps and E2E latency as the client sees them
through the router (from the call's arrival, retries and migrations included),
request_success_total by finish reason, labelled with the serving node's model;
router_request_errors_total by status code for calls that failed before streaming;
router_request_migrations_total by the node a request moved off.

Logs carry request ids (on every line of a call), nodes and sizes, never prompt text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import grpc

from pdserve.serving.admission import ResourceExhaustedError
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


@dataclass
class Progress:
    """What one request's client has received so far, over every attempt (a migration resumes from it)."""

    messages: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    migrations: int = 0
    finished: bool = False

    def add(self, response: generate_pb2.GenerateResponse) -> None:
        self.messages += 1
        self.token_ids.extend(response.token_ids)
        self.text_chars += len(response.text)
        if response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished = True


def _node_error(response: generate_pb2.GenerateResponse) -> bool:
    """A final ERROR message that the node caused (ERROR_CAUSE_NODE) and that carries no tokens."""
    return (response.finish_reason == generate_pb2.FINISH_REASON_ERROR and not response.token_ids
            and response.error_cause == generate_pb2.ERROR_CAUSE_NODE)


@dataclass
class Attempt:
    """One try of a request on one node, and how it ended (the forwarder's verdict)."""

    node: DecodeNode
    outcome: Literal["done", "next", "migrate"] = "done"  # next: try another node now; migrate: resume on one
    node_down: bool = False     # the pool marked the node down while this attempt streamed
    reason: str = ""            # why it ended, for logs and a final error message
    full: str | None = None     # the node refused it with RESOURCE_EXHAUSTED (this message)
    tried: tuple[DecodeNode, ...] = ()  # nodes this request will not go to again (this one included)


@dataclass(frozen=True)
class _RpcEnding:
    """How an attempt whose downstream call failed with a status ends (RouterGenerateService._on_rpc_error)."""

    finish: str                 # the attempt's finish label in the router's log line
    error: str | None = None    # a final error message to stream to the client
    reraise: bool = False       # the client's stream has not begun: the status is the client's


def resume_request(request: generate_pb2.GenerateRequest, progress: Progress,
                   default_max_tokens: int) -> generate_pb2.GenerateRequest | None:
    """`request` continued after what the client already has (S10), or None when nothing is left
    to generate (max_tokens already streamed)."""
    if not progress.token_ids:
        return request
    resumed = generate_pb2.GenerateRequest()
    resumed.CopyFrom(request)
    prior = request.resume if request.HasField("resume") else generate_pb2.ResumeFrom()
    resumed.resume.token_ids[:] = [*prior.token_ids, *progress.token_ids]
    resumed.resume.text_chars = prior.text_chars + progress.text_chars
    sampling = request.sampling
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else default_max_tokens
    left = max_tokens - len(progress.token_ids)
    if left < 1:
        return None
    resumed.sampling.max_tokens = left
    if not sampling.HasField("max_tokens"):  # the server's default, which a node lowers to fit: still so
        resumed.sampling.clamp_max_tokens = True
    return resumed


class RouterGenerateService(generate_pb2_grpc.GenerateServiceServicer):
    """Forwards GenerateService calls to the decode nodes of a NodePool."""

    def __init__(self, config: RouterConfig, pool: NodePool) -> None:
        self._config = config
        self._pool = pool
        self._running: dict[str, DecodeNode] = {}  # request id -> the node serving it

    @property
    def running(self) -> dict[str, DecodeNode]:
        return dict(self._running)

    def deadline(self, context: grpc.aio.ServicerContext) -> float:
        """The monotonic time by which a call arriving now must end: the router's request timeout, or
        the client's own deadline when shorter."""
        budget = self._config.request_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            budget = min(budget, max(remaining, 0.0))
        return time.monotonic() + budget

    async def Generate(  # gRPC method name
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        timer = RequestTimer(request_metrics())
        deadline = self.deadline(context)
        if not request.request_id:
            request.request_id = new_request_id()
        rid = request.request_id
        bind_request_id(rid)  # this handler task serves one request: every line it logs names it
        if rid in self._running:
            raise ValueError(f"request_id {rid!r} is already running (on {self._running[rid].address}); "
                             "ids must be unique among running requests")
        work = estimate_work(request, self._config.default_max_tokens)
        progress = Progress()
        tried: list[DecodeNode] = []   # nodes this request will not go to again
        full: list[str] = []           # the nodes that refused it as full, and what they said
        failed = False
        try:
            attempt_request: generate_pb2.GenerateRequest | None = request
            while attempt_request is not None:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"request {rid} passed its deadline of {self._config.request_timeout_s:g} s "
                                       "(or the client's) before a decode node could take it")
                try:
                    node, route = self._pool.route(attempt_request, exclude=tried)
                except UnavailableError:
                    if full:  # every node left was full: back-pressure, not an outage
                        raise ResourceExhaustedError(f"every decode node is full ({'; '.join(full)})",
                                                     self._config.retry_after_s) from None
                    raise
                tried.append(node)
                timer.model_name = node.info.model if node.info is not None else ""
                attempt = Attempt(node, tried=tuple(tried))
                async with contextlib.aclosing(self._forward(attempt, attempt_request, work, deadline, route.reason,
                                                             timer, progress)) as stream:
                    async for item in stream:
                        yield item
                if attempt.outcome == "done":
                    return
                if attempt.full is not None:
                    full.append(attempt.full)
                if attempt.outcome == "migrate":
                    progress.migrations += 1
                    router_metrics().migrations.labels(node=node.node_id).inc()
                    attempt_request = resume_request(request, progress, self._config.default_max_tokens)
                    logger.warning("request_id=%s migrating from node=%s after %d tokens (migration %d of %d): %s",
                                   rid, node.address, len(progress.token_ids), progress.migrations,
                                   self._config.max_migrations, attempt.reason)
            # Every token max_tokens allowed was streamed before the node failed: the request is done.
            timer.finish("length")
            yield generate_pb2.GenerateResponse(
                request_id=rid, finish_reason=generate_pb2.FINISH_REASON_LENGTH,
                usage=generate_pb2.Usage(completion_tokens=len(progress.token_ids)))
        except grpc.aio.AioRpcError as e:
            failed = True
            if full and e.code() == grpc.StatusCode.UNAVAILABLE:  # the others were full: back-pressure
                router_metrics().rejected.labels(code=grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc()
                raise ResourceExhaustedError(
                    f"every decode node is full or unreachable ({'; '.join(full)}; {tried[-1].address}: "
                    f"{e.code().name}: {e.details()})", self._config.retry_after_s) from e
            router_metrics().rejected.labels(code=e.code().name).inc()
            raise
        except (UnavailableError, ResourceExhaustedError, TimeoutError) as e:
            failed = True
            if progress.messages:  # the client's stream has begun: end it with a message, not a status
                yield self._error(rid, str(e), timer)
                return
            code = e.code if not isinstance(e, TimeoutError) else grpc.StatusCode.DEADLINE_EXCEEDED
            router_metrics().rejected.labels(code=code.name).inc()
            raise
        finally:
            if not failed:
                timer.finish("abort")  # cut short (the client went away); a no-op once finished

    def _error(self, rid: str, error: str, timer: RequestTimer) -> generate_pb2.GenerateResponse:
        timer.finish("error")
        return generate_pb2.GenerateResponse(request_id=rid, finish_reason=generate_pb2.FINISH_REASON_ERROR,
                                             error=error)

    def _can_move(self, attempt: Attempt, progress: Progress, deadline: float) -> bool:
        """Another node may take the rest of this request now (S10's bounds)."""
        # only nodes the next route() may choose: a tried one would refuse it, and a stream cut
        # for nowhere to go ends in an error where the slow node could still have finished it
        others = [n for n in self._pool.healthy() if all(n is not t for t in (attempt.node, *attempt.tried))]
        return bool(others) and time.monotonic() < deadline and (
            not progress.token_ids or progress.migrations < self._config.max_migrations)

    async def _forward(
        self, attempt: Attempt, request: generate_pb2.GenerateRequest, work: int, deadline: float,
        reason: str, timer: RequestTimer, progress: Progress,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Stream one attempt on `attempt.node`; sets attempt.outcome when another node should go on."""
        node = attempt.node
        rid = request.request_id
        assert node.generate is not None
        logger.info("generate request_id=%s node=%s route=%s prompt=%s est_tokens=%d inflight=%d resumed=%d",
                    rid, node.address, reason, request.WhichOneof("prompt"), work, len(node.inflight),
                    len(request.resume.token_ids))
        self._running[rid] = node
        node.begin(rid, work)
        start = time.monotonic()
        call = node.generate.Generate(request, timeout=max(deadline - start, 1e-3))

        def node_down() -> None:  # the pool marked the node down: stop waiting on it, move the request
            if progress.finished or not self._can_move(attempt, progress, deadline):
                return  # nowhere to go: a slow node may still finish it, so keep the stream
            attempt.node_down = True
            call.cancel()

        node.watchers.add(node_down)
        sent = 0
        finish = "cancelled"
        try:
            async for response in call:
                if _node_error(response) and self._can_move(attempt, progress, deadline):
                    # The node, not the request, failed it (its engine stopped): move it like a broken stream.
                    finish = "node error"
                    attempt.reason = f"decode node {node.address} failed mid-stream: {response.error}"
                    self._pool.mark_failed(node, f"Generate ended with a node error: {response.error}")
                    self._failed_mid_stream(attempt, progress, deadline)
                    return
                sent += 1
                progress.add(response)
                timer.tokens(len(response.token_ids))
                if response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                    finish = generate_pb2.FinishReason.Name(response.finish_reason)
                    timer.finish(_REASONS.get(response.finish_reason, "error"))
                yield response
            if sent == 0:
                finish = "empty stream"
            if not progress.finished:  # the node ended without a final message
                yield self._error(rid, f"decode node {node.address} ended the stream without a finish_reason", timer)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not attempt.node_down or (task is not None and task.cancelling()):
                raise  # the client went away (or the server stops): not the node's failure
            finish = "node down"
            error = self._moved_off_down_node(attempt, progress, deadline)
            if error is not None:
                yield self._error(rid, error, timer)
        except grpc.aio.AioRpcError as e:
            ending = self._on_rpc_error(e, attempt, progress, deadline, sent, rid)
            finish = ending.finish
            if ending.reraise:
                raise
            if ending.error is not None:
                yield self._error(rid, ending.error, timer)
        finally:
            node.watchers.discard(node_down)
            call.cancel()  # no-op when finished; aborts the request downstream otherwise (R4)
            node.end(rid)
            if self._running.get(rid) is node:
                del self._running[rid]
            logger.info("done request_id=%s node=%s finish=%s messages=%d elapsed_s=%.3f",
                        rid, node.address, finish, sent, time.monotonic() - start)

    def _moved_off_down_node(self, attempt: Attempt, progress: Progress, deadline: float) -> str | None:
        """The pool marked the node down mid-stream (its call was cancelled for it): migrate if S10's
        bounds allow; returns the final error message to stream when the request cannot move."""
        attempt.reason = f"decode node {attempt.node.address} failed mid-stream: marked down ({attempt.node.reason})"
        self._failed_mid_stream(attempt, progress, deadline)
        return attempt.reason if attempt.outcome == "done" else None

    def _on_rpc_error(self, e: grpc.aio.AioRpcError, attempt: Attempt, progress: Progress, deadline: float,
                      sent: int, rid: str) -> _RpcEnding:
        """What a downstream status means for this attempt: try another node, migrate, end the
        client's stream with an error message, or re-raise the status (the stream has not begun).
        Raises TimeoutError when the call's deadline passed before the client had a message."""
        node = attempt.node
        code, details = e.code(), e.details()
        attempt.reason = f"{code.name}: {details}"
        if code == grpc.StatusCode.CANCELLED and attempt.node_down:
            return _RpcEnding(code.name, self._moved_off_down_node(attempt, progress, deadline))
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline - 0.05:
            message = (f"request {rid} passed its deadline of {self._config.request_timeout_s:g} s "
                       "(router --request-timeout-s) or the client's")
            if not progress.messages:
                raise TimeoutError(message) from e
            return _RpcEnding(code.name, message)
        if sent == 0 and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            logger.info("request_id=%s node=%s is full (%s); trying another node", rid, node.address, details)
            attempt.outcome, attempt.full = "next", f"{node.address}: {details}"
            return _RpcEnding(code.name)
        if code == grpc.StatusCode.UNAVAILABLE:
            self._pool.mark_failed(node, f"Generate failed: {code.name}: {details}")
            if sent == 0 and not progress.token_ids:
                if self._can_move(attempt, progress, deadline):
                    logger.warning("request_id=%s node=%s unavailable (%s); retrying on another node",
                                   rid, node.address, details)
                    attempt.outcome = "next"
                    return _RpcEnding("retried")
            else:
                self._failed_mid_stream(attempt, progress, deadline)
                if attempt.outcome != "done":
                    return _RpcEnding("migrated")
        if not progress.messages:
            return _RpcEnding(code.name, reraise=True)
        logger.warning("request_id=%s node=%s failed after %d messages: %s: %s",
                       rid, node.address, sent, code.name, details)
        return _RpcEnding(code.name, f"decode node {node.address} failed mid-stream: {code.name}: {details}")

    def _failed_mid_stream(self, attempt: Attempt, progress: Progress, deadline: float) -> None:
        """The node failed after streaming part of the answer: migrate if S10's bounds allow."""
        if progress.finished:
            return
        if self._can_move(attempt, progress, deadline):
            attempt.outcome = "migrate" if progress.token_ids else "next"
        else:
            logger.warning("cannot move the request off node=%s (migrations %d of %d, %d healthy nodes)",
                           attempt.node.address, progress.migrations, self._config.max_migrations,
                           len(self._pool.healthy()))

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
