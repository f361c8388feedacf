"""How the harness sends one request and times its stream: gRPC (pdserve.tools.client) or the OpenAI HTTP API.

    async with make_backend("grpc", "127.0.0.1:50051") as backend:
        trace = await backend.send(request, options, request_id="bench-0")

A backend turns one BenchRequest into a StreamTrace: the send time, the arrival time and token
count of every message carrying output, the end of the stream, the finish reason and the server's
usage. Failures never raise out of `send`: they end the trace with `error` set (a failed call, an
error event in the stream, a stream that ends without a finish reason, a timeout). Cancelling the
task that awaits `send` cancels the call, which aborts the request on the server.

- GrpcBackend: GenerateService.Generate, server-streaming; a token message carries token ids; the
  last message has the finish reason and usage.
- OpenAIBackend: POST /v1/completions with stream=true and stream_options.include_usage; a token
  message is an SSE event whose choice has non-empty text (vLLM's rule: an empty delta carries no
  visible token); usage arrives in the last event before `data: [DONE]`. A server may close an
  idle keep-alive connection just as the next request goes out on it (llama-server does, between
  back-to-back requests): a request whose pooled connection breaks (ClientOSError,
  ServerDisconnectedError) before any part of the response head arrived is sent once more on a
  fresh connection. Nothing else is retried: not a request on a fresh connection (its failure is no
  idle close), not one after the response began, not a timeout, not a retry. The one case this
  rule cannot tell apart: a server that reads a request on a reused connection and dies without a
  byte of answer gets it a second time (RFC 9112 section 9.3.1 names this risk of retries).

Both belong to the event loop that enters them.
"""

from __future__ import annotations

import abc
import asyncio
import json
import time
from dataclasses import dataclass
from types import TracebackType

from pdserve.serving.channels import PLAINTEXT, ChannelSecurity
from pdserve.tools.bench.datasets import BenchRequest
from pdserve.tools.bench.records import StreamTrace

BACKENDS = ("grpc", "openai")


@dataclass(frozen=True)
class SendOptions:
    """Sampling for every request of a run. timeout_s: per request (None: none)."""

    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float | None = None
    model: str = ""


class _TraceBuilder:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.sent_at = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error: str | None = None

    def token_chunk(self, count: int) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(count)

    def fail(self, error: str) -> None:
        if self.error is None:
            self.error = error

    def build(self) -> StreamTrace:
        return StreamTrace(self.request_id, self.sent_at, tuple(self.times), tuple(self.tokens), time.perf_counter(),
                           self.finish_reason, self.prompt_tokens, self.completion_tokens, self.error)


class Backend(abc.ABC):
    """One connection to a server for a whole run; an async context manager."""

    name: str

    def __init__(self, url: str) -> None:
        self.url = url

    @abc.abstractmethod
    async def _stream(self, request: BenchRequest, options: SendOptions, trace: _TraceBuilder) -> None:
        """Send the request and fill `trace` as the stream goes; may raise (send() records it)."""

    async def send(self, request: BenchRequest, options: SendOptions, request_id: str) -> StreamTrace:
        trace = _TraceBuilder(request_id)
        try:
            if options.timeout_s is None:
                await self._stream(request, options, trace)
            else:
                await asyncio.wait_for(self._stream(request, options, trace), options.timeout_s)
        except asyncio.TimeoutError:
            trace.fail(f"no end of stream after {options.timeout_s} s (request timeout)")
        except self._errors() as e:
            trace.fail(f"{type(e).__name__}: {e}")
        if trace.error is None and trace.finish_reason is None:
            trace.fail("the stream ended without a finish reason")
        return trace.build()

    def _errors(self) -> tuple[type[BaseException], ...]:
        """The exceptions a failed call raises (recorded on the trace; anything else propagates)."""
        return (OSError, ValueError)

    async def open(self) -> None:  # noqa: B027 - optional: a backend without a connection keeps the no-op
        """Connect; called by __aenter__."""

    async def close(self) -> None:  # noqa: B027 - optional, as open
        """Release the connection; called by __aexit__."""

    async def __aenter__(self) -> Backend:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class GrpcBackend(Backend):
    name = "grpc"

    def __init__(self, url: str, security: ChannelSecurity = PLAINTEXT) -> None:
        super().__init__(url)
        self._security = security   # TLS / mTLS and the token of a secured cluster
        self._client = None

    async def open(self) -> None:
        from pdserve.tools.client import AsyncClient

        self._client = AsyncClient(self.url, security=self._security)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _errors(self) -> tuple[type[BaseException], ...]:
        from pdserve.tools.client import ClientError

        return (ClientError, OSError, ValueError)

    async def _stream(self, request: BenchRequest, options: SendOptions, trace: _TraceBuilder) -> None:
        from pdserve.engine.sampling_params import SamplingParams

        if self._client is None:
            raise RuntimeError("GrpcBackend used outside `async with`")
        sampling = SamplingParams(temperature=options.temperature, max_tokens=request.max_tokens,
                                  ignore_eos=options.ignore_eos)
        prompt = list(request.prompt) if isinstance(request.prompt, tuple) else request.prompt
        async for chunk in self._client.generate(prompt, sampling, request_id=trace.request_id, model=options.model):
            if chunk.token_ids:
                trace.token_chunk(len(chunk.token_ids))
            if chunk.finish_reason is not None:
                trace.finish_reason = chunk.finish_reason
                if chunk.error:
                    trace.fail(f"server error: {chunk.error}")
                if chunk.usage is not None:
                    trace.prompt_tokens = chunk.usage.prompt_tokens
                    trace.completion_tokens = chunk.usage.completion_tokens


class OpenAIBackend(Backend):
    """`url`: the server's base, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)."""

    name = "openai"

    def __init__(self, url: str) -> None:
        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            base = "http://" + base
        if base.endswith("/v1"):
            base = base[:-3]
        super().__init__(base)
        self._session = None

        self._fresh = None     # the retries' session: a new connection per request, closed after it
        self.retried = 0       # requests sent again after their pooled connection broke

    async def open(self) -> None:
        import aiohttp

        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_mark_reused)
        # limit=0: as many connections as requests in flight; no total timeout (SendOptions has one).
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None), trace_configs=[reuse])
        self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                            timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()

    def _errors(self) -> tuple[type[BaseException], ...]:
        import aiohttp

        return (aiohttp.ClientError, OSError, ValueError)

    async def _stream(self, request: BenchRequest, options: SendOptions, trace: _TraceBuilder) -> None:
        if self._session is None or self._fresh is None:
            raise RuntimeError("OpenAIBackend used outside `async with`")
        body = {
            "model": options.model,
            "prompt": list(request.prompt) if isinstance(request.prompt, tuple) else request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": options.temperature,
            "ignore_eos": options.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not options.model:
            del body["model"]
        url = f"{self.url}/v1/completions"
        attempt = _Attempt()
        try:
            resp = await self._session.post(url, json=body, trace_request_ctx=attempt)
        except Exception as e:  # re-raised unless _never_reached says the server cannot have had it
            if not _never_reached(attempt, e):
                raise
            self.retried += 1
            resp = await self._fresh.post(url, json=body)
        async with resp:
            if resp.status != 200:
                text = (await resp.text())[:500]
                trace.fail(f"HTTP {resp.status}: {text}")
                return
            done = False
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                self._event(json.loads(data), trace)
            if not done:
                trace.fail("the SSE stream ended without data: [DONE]")

    @staticmethod
    def _event(event: dict, trace: _TraceBuilder) -> None:
        if "error" in event:
            err = event["error"]
            trace.fail(f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
            trace.finish_reason = trace.finish_reason or "error"
            return
        for choice in event.get("choices") or ():
            if choice.get("text"):
                trace.token_chunk(1)
            if choice.get("finish_reason"):
                trace.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            trace.prompt_tokens = usage.get("prompt_tokens")
            trace.completion_tokens = usage.get("completion_tokens")


class _Attempt:
    """What one POST learned of its connection, filled by the session's trace hook."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False   # the connection came from the pool (it had carried an earlier request)


async def _mark_reused(session: object, ctx: object, params: object) -> None:
    attempt = getattr(ctx, "trace_request_ctx", None)
    if isinstance(attempt, _Attempt):
        attempt.reused = True


def _never_reached(attempt: _Attempt, error: BaseException) -> bool:
    """True when `error`, raised before the response head, is a pooled connection the server had
    closed: a reset or a close with no part of a response head parsed (ServerDisconnectedError
    carries the partial head it saw, else a plain message). Not a timeout, not a connect failure."""
    import aiohttp

    if not attempt.reused or isinstance(error, aiohttp.ServerTimeoutError | aiohttp.ClientConnectorError):
        return False
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return isinstance(error.message, str)
    return isinstance(error, aiohttp.ClientOSError | aiohttp.ClientConnectionResetError)


def make_backend(kind: str, url: str, security: ChannelSecurity = PLAINTEXT) -> Backend:
    if kind == "grpc":
        return GrpcBackend(url, security)
    if kind == "openai":
        return OpenAIBackend(url)
    raise ValueError(f"backend must be one of {BACKENDS}, got {kind!r}")
