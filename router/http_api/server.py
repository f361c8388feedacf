"""The router's OpenAI-compatible HTTP server (R2), on the router's asyncio loop beside gRPC.

    api = HttpApi(backend, HttpConfig(host="127.0.0.1", port=8000), limits)
    port = await api.start()
    ...
    await api.stop()

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (200 when a
decode node can take requests, 503 otherwise, with every node's state), GET /metrics (this
process's Prometheus registry, `pdserve.serving.metrics.render()`). Every error is OpenAI's JSON error
object (see errors.py), routing errors (404, 405) included.

A generation request is parsed (400 for a bad field), checked like a gRPC request
(`router.limits.check_request`), given an id (`cmpl-...` / `chatcmpl-...`, also its gRPC
request_id, so gRPC Abort takes it), and run through `backend.stream`. Errors that end the call
before its first message keep their status (400 bad input, 404 unknown model, 503 no decode node);
for a streamed request the SSE headers are only sent once the first message is there, so those
statuses reach streaming clients too. A failure after streaming began ends the stream with an
`{"error": ...}` event and `data: [DONE]`.

Cancellation (R4): the server runs with aiohttp's handler_cancellation, so a client that
disconnects cancels its handler task at once (mid-stream, or while waiting for the first token);
closing `backend.stream` then cancels the downstream gRPC call, and the decode node aborts the
request, its prefill included.

Slow clients (S8): every SSE event must be taken by the client within `write_timeout_s`
(RouterConfig.write_timeout_s, router.clients.write_deadline; a write waits only once the
client's socket buffers and the transport's are full): past it the connection is dropped, the
stream closed (freeing its admission slots and cancelling it on the decode node) and the cut
counted. A body larger than `limits.max_message_bytes` is answered 413 before it is parsed (one
whose Content-Length says so before it is read). Each request's client (router.clients.http_client:
its `Authorization: Bearer` key, else its peer address) is passed to `backend.stream` for the
per-client cap. aiohttp sets TCP_NODELAY on every accepted connection
(base_protocol.connection_made), so streamed chunks are not held back by Nagle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from pdserve.serving.convert import FieldError
from pdserve.serving.metrics import render
from pdserve_api.v1 import generate_pb2
from router.clients import WriteTimeoutError, http_client, write_deadline
from router.http_api.errors import ApiError, from_exception
from router.http_api.parse import ApiCall, parse_chat, parse_completion
from router.http_api.render import Renderer
from router.limits import RequestLimits, check_request

logger = logging.getLogger(__name__)

MAX_JSON_DEPTH = 32  # nesting of a request body: OpenAI bodies need 4 (chat content parts)


def json_depth(value: Any, limit: int) -> int:
    """How deep `value` (parsed JSON) nests lists and dicts (a scalar: 0), counted up to limit + 1."""
    depth, level = 0, [value]
    while level and depth <= limit:
        nested = []
        for v in level:
            if isinstance(v, dict):
                nested.extend(x for x in v.values() if isinstance(x, (dict, list)))
            elif isinstance(v, list):
                nested.extend(x for x in v if isinstance(x, (dict, list)))
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            break
        depth += 1
        level = nested
    return depth


class Backend(Protocol):
    """What the HTTP API needs from the router (router.server.RouterFront provides it)."""

    def stream(self, request: generate_pb2.GenerateRequest,
               client: str) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Forward a request of `client` (its per-client cap); closing the iterator early cancels it
        on every node."""

    async def list_models(self) -> generate_pb2.ListModelsResponse: ...

    async def health(self) -> generate_pb2.HealthResponse: ...

    def context_length(self) -> int | None:
        """The model's context length as the decode nodes report it (None before any answered)."""

    def default_model(self) -> str:
        """The id of the model a request without `model` gets ("" before any node answered)."""


@dataclass(frozen=True)
class HttpConfig:
    """Where the HTTP API listens (port 0: any free port, `HttpApi.start` returns it) and its
    connection timeouts (S8). idle_timeout_s: a connection that sends no complete request head for
    this long, from its opening or its previous response, is closed (aiohttp's keep-alive timer).
    body_timeout_s: a request body not read completely within this long is answered 408."""

    host: str = "127.0.0.1"
    port: int = 8000
    idle_timeout_s: float = 75.0
    body_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"http port must be in 0..65535, got {self.port!r}")
        for name in ("idle_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"http {name} must be > 0, got {value!r}")


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (unknown route, wrong method, body too large) in OpenAI's shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        if e.status == 404:
            message = f"no route {request.method} {request.path}"
        elif e.status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        return ApiError(e.status, message).response()


class HttpApi:
    """The aiohttp application and its site; `start()` binds, `stop()` closes."""

    def __init__(self, backend: Backend, config: HttpConfig, limits: RequestLimits,
                 shutdown_grace_s: float = 5.0, write_timeout_s: float = 30.0) -> None:
        if not write_timeout_s > 0:
            raise ValueError(f"write_timeout_s must be > 0, got {write_timeout_s!r}")
        self.backend = backend
        self.config = config
        self.limits = limits
        self.shutdown_grace_s = shutdown_grace_s
        self.write_timeout_s = write_timeout_s
        self.app = web.Application(client_max_size=limits.max_message_bytes, middlewares=[_json_errors])
        self.app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> int:
        runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=self.shutdown_grace_s,
                               keepalive_timeout=self.config.idle_timeout_s)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise OSError(f"router HTTP API could not bind {self.config.host}:{self.config.port}: {e}") from e
        self._runner = runner
        sockets = [s for s in runner.addresses if isinstance(s, tuple)]
        self.port = int(sockets[0][1]) if sockets else self.config.port
        logger.info("HTTP API serving on http://%s:%d/v1", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop listening; requests in flight get `shutdown_grace_s` to finish, then are cancelled."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- generation -------------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body is larger than {self.limits.max_message_bytes} bytes "
                        f"(router --max-message-bytes; prompts may have at most {self.limits.max_prompt_bytes} bytes)")

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        declared = request.content_length
        if declared is not None and declared > self.limits.max_message_bytes:
            raise self._too_large()   # before reading any of it
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                raw = await request.read()
        except TimeoutError as e:
            raise ApiError(408, f"the request body was not received within {self.config.body_timeout_s:g} s "
                                "(router --http-body-timeout-s)") from e
        except web.HTTPRequestEntityTooLarge as e:
            raise self._too_large() from e
        # As FastAPI (vLLM): no Content-Type is read as JSON, another media type than JSON is refused.
        media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media and media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise ApiError(415, f"the body must be application/json, got Content-Type {media!r}")
        try:
            body = json.loads(raw)
        except RecursionError as e:  # the C scanner's own guard, far above MAX_JSON_DEPTH
            raise ApiError(400, f"the body nests JSON arrays or objects more than {MAX_JSON_DEPTH} levels deep") from e
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
        if json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ApiError(400, f"the body nests JSON arrays or objects more than {MAX_JSON_DEPTH} levels deep")
        return body

    def _parse(self, body: dict[str, Any], kind: str) -> ApiCall:
        if kind == "chat":
            return parse_chat(body, default_max_tokens=self.backend.context_length())
        return parse_completion(body)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            call = self._parse(await self._read_json(request), kind)
            try:
                check_request(call.request, self.limits, self.backend.context_length())
            except ValueError as e:
                param = e.field if isinstance(e, FieldError) else "messages" if kind == "chat" else "prompt"
                raise ApiError(400, str(e), param=param) from e
        except ApiError as e:
            logger.info("%s %s answered %d: %s", request.method, request.path, e.status, e.message[:200])
            return e.response()
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        call.request.request_id = response_id
        renderer = Renderer(call, response_id, call.model or self.backend.default_model(), int(time.time()))
        client = http_client(request.headers.get("Authorization"), request.remote)
        async with contextlib.aclosing(self.backend.stream(call.request, client)) as stream:
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                return ApiError(500, f"request {response_id}: the decode node ended the stream without "
                                     "any message").response()
            except Exception as e:  # every failure is answered with its status
                error = from_exception(e)
                logger.info("request_id=%s answered %d: %s", response_id, error.status, error.message[:200])
                return error.response()
            if call.stream:
                return await self._stream(request, renderer, first, stream)
            return await self._collect(renderer, first, stream)

    async def _collect(self, renderer: Renderer, first: generate_pb2.GenerateResponse,
                       stream: AsyncIterator[generate_pb2.GenerateResponse]) -> web.Response:
        msg = first
        while True:
            if msg.finish_reason == generate_pb2.FINISH_REASON_ERROR:
                return ApiError(500, msg.error or "the request failed").response()
            renderer.add(msg)
            if msg.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                break
            try:
                msg = await anext(stream)
            except StopAsyncIteration:
                return ApiError(500, "the stream ended without a finish_reason").response()
        return web.json_response(renderer.response())

    async def _stream(self, request: web.Request, renderer: Renderer, first: generate_pb2.GenerateResponse,
                      stream: AsyncIterator[generate_pb2.GenerateResponse]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

        async def send(event: Any) -> None:
            data = event if isinstance(event, str) else json.dumps(event)
            async with write_deadline(self.write_timeout_s, "http", renderer.id):
                await response.write(f"data: {data}\n\n".encode())

        try:
            async with write_deadline(self.write_timeout_s, "http", renderer.id):
                await response.prepare(request)
            msg: generate_pb2.GenerateResponse | None = first
            while msg is not None:
                if msg.finish_reason == generate_pb2.FINISH_REASON_ERROR:
                    await send(ApiError(500, msg.error or "the request failed").body())
                    break
                for event in renderer.chunks(msg):
                    await send(event)
                if msg.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                    if renderer.call.include_usage:
                        await send(renderer.usage_chunk())
                    break
                msg = await anext(stream, None)
            else:
                await send(ApiError(500, "the stream ended without a finish_reason").body())
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:
            logger.info("request_id=%s: the client went away mid-stream; cancelling", renderer.id)
        except WriteTimeoutError:
            # Drop the connection (what is buffered for it is discarded): nothing more is written,
            # and returning closes `stream`, which frees the slots and cancels the request downstream.
            if request.transport is not None:
                request.transport.abort()
        return response

    # --- the rest ---------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        try:
            reply = await self.backend.list_models()
        except Exception as e:  # answered with its status
            return from_exception(e).response()
        data = [{"id": m.id, "object": "model", "created": 0, "owned_by": "pdserve",
                 "max_model_len": m.max_context_length} for m in reply.models]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        reply = await self.backend.health()
        nodes = [{"address": n.address, "node_id": n.node_id, "serving": n.serving, "reason": n.reason,
                  "inflight": n.router_inflight} for n in reply.nodes]
        body = {"status": "ok" if reply.serving else "unavailable", "nodes": nodes}
        return web.json_response(body, status=200 if reply.serving else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = render()
        return web.Response(body=body, headers={"Content-Type": content_type})
