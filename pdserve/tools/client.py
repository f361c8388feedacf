"""gRPC client for a pdserve cluster (R6): the router, or a decode node directly.

    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("The capital of France is", SamplingParams(max_tokens=8)):
            print(chunk.text, end="", flush=True)
        print(client.complete([1, 2, 3], SamplingParams(temperature=0, max_tokens=4)).token_ids)

    async with AsyncClient("127.0.0.1:50051") as client:
        async for chunk in client.generate([{"role": "user", "content": "Hi"}]):
            ...

`security` (pdserve.serving.channels.ChannelSecurity: a CA to verify the server, a client certificate
for mTLS, the shared token) secures the channel; the default is plaintext with no token. Channels
send keepalive pings, so a stopped server fails the calls in flight within seconds.
`Client` uses a blocking grpc channel and may be shared by threads; `AsyncClient` uses grpc.aio and
belongs to the event loop that first calls it. A prompt is text, token ids (used as given), or chat
messages (a list of {"role", "content"} mappings or (role, content) pairs). A failed call raises
`ClientError(code, message)` carrying the gRPC status; a request that fails after streaming began
ends with a chunk whose finish_reason is "error" (and `complete` raises ClientError for it).
Breaking off a `generate` iteration (break, close, task cancelled) cancels the call, which aborts
the request on every node (R4); `abort(request_id)` does the same from anywhere.

Everything a GenerateRequest can say is reachable: sampling (SamplingParams: temperature, top_p,
top_k, min_p, seed, max_tokens, stop strings and token ids, ignore_eos, logprobs,
skip_special_tokens), the model id, the request id. With `SamplingParams(logprobs=n)` each chunk
carries one `PositionLogprobs` per token (the sampled token and the n most likely), and
`Completion.logprobs` has them all. `health()` tells whether the server takes requests and, on a
router, every decode node's state; `list_models()` lists the models.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.channels import (
    PLAINTEXT,
    ChannelSecurity,
    add_security_args,
    open_channel,
    open_sync_channel,
    security_from_args,
)
from pdserve.serving.convert import finish_reason_from_pb, sampling_to_pb
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)

ChatMessage = Union[Mapping[str, str], tuple[str, str]]
Prompt = Union[str, Sequence[int], Sequence[ChatMessage]]

_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 64 * 1024 * 1024),)


class ClientError(Exception):
    """A call failed with a gRPC status: `code` (grpc.StatusCode) and the server's `message`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> ClientError:
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request (OpenAI's usage object)."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class ServerTimings:
    """Server-measured durations of one request, in seconds (see generate.proto ServerTimings)."""

    queue_time_s: float
    prefill_time_s: float
    kv_transfer_time_s: float
    time_to_first_token_s: float
    e2e_time_s: float
    decode_node: str
    prefill_node: str


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its natural-log probability (as sampled: after temperature and filtering) and text."""

    token_id: int
    logprob: float
    text: str = ""

    @classmethod
    def from_pb(cls, m: generate_pb2.TokenLogprob) -> TokenLogprob:
        return cls(m.token_id, m.logprob, m.text)


@dataclass(frozen=True)
class PositionLogprobs:
    """Logprobs at one generated position: the sampled token and the n most likely, best first."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_pb(cls, m: generate_pb2.PositionLogprobs) -> PositionLogprobs:
        return cls(TokenLogprob.from_pb(m.sampled), tuple(TokenLogprob.from_pb(x) for x in m.top))


@dataclass(frozen=True)
class NodeHealth:
    """One decode node as a router sees it (see generate.proto NodeHealth)."""

    address: str
    node_id: str
    serving: bool
    reason: str
    router_inflight: int
    free_kv_blocks: int | None = None  # None until the node reported its load
    total_kv_blocks: int | None = None


@dataclass(frozen=True)
class HealthReport:
    """Whether a server takes requests now; on a router, every decode node behind it."""

    serving: bool
    nodes: tuple[NodeHealth, ...] = ()

    @classmethod
    def from_pb(cls, m: generate_pb2.HealthResponse) -> HealthReport:
        return cls(m.serving, tuple(
            NodeHealth(n.address, n.node_id, n.serving, n.reason, n.router_inflight,
                       n.load.free_kv_blocks if n.HasField("load") else None,
                       n.load.total_kv_blocks if n.HasField("load") else None) for n in m.nodes))


@dataclass(frozen=True)
class GenerationChunk:
    """One streamed piece: new token ids and text; the last one has finish_reason and usage."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None before the last chunk
    error: str | None = None
    usage: Usage | None = None
    timings: ServerTimings | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token in token_ids when logprobs were asked for

    @classmethod
    def from_pb(cls, m: generate_pb2.GenerateResponse) -> GenerationChunk:
        finished = m.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
        which = m.WhichOneof("stop_reason")
        return cls(
            request_id=m.request_id,
            token_ids=tuple(m.token_ids),
            text=m.text,
            finish_reason=finish_reason_from_pb(m.finish_reason),
            error=m.error or None,
            usage=Usage(m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.cached_prompt_tokens)
            if m.HasField("usage") else None,
            timings=ServerTimings(m.timings.queue_time_s, m.timings.prefill_time_s, m.timings.kv_transfer_time_s,
                                  m.timings.time_to_first_token_s, m.timings.e2e_time_s, m.timings.decode_node,
                                  m.timings.prefill_node) if finished and m.HasField("timings") else None,
            stop_reason=getattr(m, which) if which else None,
            logprobs=tuple(PositionLogprobs.from_pb(x) for x in m.logprobs),
        )


@dataclass(frozen=True)
class Completion:
    """A finished request: all its text and generated token ids (EOS included when it ended it)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None = None
    timings: ServerTimings | None = None
    stop_reason: str | int | None = None
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per generated token when logprobs were asked for


class _Collector:
    """Folds chunks into a Completion."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.last: GenerationChunk | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.text.append(chunk.text)
        self.ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.last = chunk

    def result(self) -> Completion:
        last = self.last
        if last is None:
            raise ClientError(grpc.StatusCode.INTERNAL, "the server ended the stream without any message")
        if last.finish_reason == "error":
            raise ClientError(grpc.StatusCode.INTERNAL, f"request {last.request_id} failed: {last.error}")
        if last.finish_reason is None:
            raise ClientError(grpc.StatusCode.INTERNAL,
                              f"request {last.request_id}: the stream ended without a finish_reason")
        return Completion(last.request_id, "".join(self.text), tuple(self.ids), last.finish_reason, last.usage,
                          last.timings, last.stop_reason, tuple(self.logprobs))


def build_request(prompt: Prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                  model: str = "") -> generate_pb2.GenerateRequest:
    """A GenerateRequest for `prompt`; raises ValueError (naming what is wrong) for a malformed prompt."""
    req = generate_pb2.GenerateRequest(request_id=request_id or "", model=model)
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, (bytes, bytearray)):
        raise ValueError("prompt must be str, a list of token ids, or chat messages, got bytes")
    elif isinstance(prompt, Sequence) or hasattr(prompt, "__iter__"):
        items = list(prompt)
        if not items:
            raise ValueError("prompt is empty (no token ids or messages)")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            bad = [t for t in items if t < 0]
            if bad:
                raise ValueError(f"token ids must be >= 0, got {bad[:5]}")
            req.token_ids.ids.extend(items)
        else:
            for i, m in enumerate(items):
                if isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
                    role, content = m["role"], m["content"]
                elif isinstance(m, tuple) and len(m) == 2 and all(isinstance(x, str) for x in m):
                    role, content = m
                else:
                    raise ValueError(f"prompt item {i} is neither a token id nor a chat message "
                                     f"{{'role': str, 'content': str}}: {type(m).__name__}")
                req.messages.messages.add(role=role, content=content)
    else:
        raise ValueError(f"prompt must be str, a list of token ids, or chat messages, got {type(prompt).__name__}")
    if sampling is not None:
        req.sampling.CopyFrom(sampling_to_pb(sampling))
    return req


def _target(url: str) -> str:
    for scheme in ("grpc://", "http://"):
        if url.startswith(scheme):
            url = url[len(scheme):]
    url = url.rstrip("/")
    if not url or ":" not in url:
        raise ValueError(f"url must be HOST:PORT, got {url!r}")
    return url


class Client:
    """Blocking client. `timeout`: default deadline in seconds of every call (None: none)."""

    def __init__(self, url: str, timeout: float | None = None, security: ChannelSecurity = PLAINTEXT) -> None:
        self.url = _target(url)
        self.timeout = timeout
        self._channel = open_sync_channel(self.url, security, options=_CHANNEL_OPTIONS)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                 model: str = "", timeout: float | None = None) -> Iterator[GenerationChunk]:
        """Stream chunks as the server produces them. Closing the iterator early cancels the request."""
        req = build_request(prompt, sampling, request_id, model)
        return self._stream(req, timeout if timeout is not None else self.timeout)

    def _stream(self, req: generate_pb2.GenerateRequest, timeout: float | None) -> Iterator[GenerationChunk]:
        call = self._stub.Generate(req, timeout=timeout)
        try:
            for m in call:
                yield GenerationChunk.from_pb(m)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e) from None
        finally:
            call.cancel()

    def complete(self, prompt: Prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                 model: str = "", timeout: float | None = None) -> Completion:
        """Run a request to the end; raises ClientError when it fails."""
        acc = _Collector()
        for chunk in self.generate(prompt, sampling, request_id, model, timeout):
            acc.add(chunk)
        return acc.result()

    def abort(self, request_id: str) -> bool:
        """Abort a running request; True when it was running."""
        try:
            return self._stub.Abort(generate_pb2.AbortRequest(request_id=request_id), timeout=self.timeout).aborted
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e) from None

    def list_models(self) -> list[generate_pb2.ModelInfo]:
        try:
            return list(self._stub.ListModels(generate_pb2.ListModelsRequest(), timeout=self.timeout).models)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e) from None

    def health(self) -> HealthReport:
        """The server's Health answer (routers; a decode node may answer UNIMPLEMENTED)."""
        try:
            return HealthReport.from_pb(self._stub.Health(generate_pb2.HealthRequest(), timeout=self.timeout))
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client (grpc.aio). `timeout`: default deadline in seconds of every call (None: none)."""

    def __init__(self, url: str, timeout: float | None = None, security: ChannelSecurity = PLAINTEXT) -> None:
        self.url = _target(url)
        self.timeout = timeout
        self._channel = open_channel(self.url, security, options=_CHANNEL_OPTIONS)
        self._stub = generate_pb2_grpc.GenerateServiceStub(self._channel)

    async def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                       model: str = "", timeout: float | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream chunks as the server produces them. Stopping early (or cancelling) cancels the request."""
        req = build_request(prompt, sampling, request_id, model)
        call = self._stub.Generate(req, timeout=timeout if timeout is not None else self.timeout)
        try:
            async for m in call:
                yield GenerationChunk.from_pb(m)
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc(e) from None
        finally:
            call.cancel()

    async def complete(self, prompt: Prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                       model: str = "", timeout: float | None = None) -> Completion:
        """Run a request to the end; raises ClientError when it fails."""
        acc = _Collector()
        async for chunk in self.generate(prompt, sampling, request_id, model, timeout):
            acc.add(chunk)
        return acc.result()

    async def abort(self, request_id: str) -> bool:
        try:
            reply = await self._stub.Abort(generate_pb2.AbortRequest(request_id=request_id), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc(e) from None
        return reply.aborted

    async def list_models(self) -> list[generate_pb2.ModelInfo]:
        try:
            reply = await self._stub.ListModels(generate_pb2.ListModelsRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc(e) from None
        return list(reply.models)

    async def health(self) -> HealthReport:
        """The server's Health answer (routers; a decode node may answer UNIMPLEMENTED)."""
        try:
            reply = await self._stub.Health(generate_pb2.HealthRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc(e) from None
        return HealthReport.from_pb(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# --- `pdserve generate --url HOST:PORT` -------------------------------------------------------------


def add_remote_args(p: argparse.ArgumentParser) -> None:
    """The flags `pdserve generate` needs for remote mode (call on its sub-parser)."""
    p.add_argument("--url", default=None, metavar="HOST:PORT",
                   help="generate on a running cluster (router or decode node) instead of loading the model here")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="deadline of each remote request")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: add each generated token's logprob and the N most likely "
                        "alternatives (0..20)")
    add_security_args(p)


def logprobs_json(p: PositionLogprobs) -> dict[str, object]:
    """One position's logprobs as `pdserve generate --json --logprobs N` prints them."""
    return {"token_id": p.sampled.token_id, "logprob": p.sampled.logprob,
            "top": [[t.token_id, t.logprob] for t in p.top]}


def cmd_generate_remote(args: argparse.Namespace) -> int:
    """`pdserve generate --url HOST:PORT ...`: the local command's output, produced by a cluster.

    Prompts run one after another; text streams to stdout as it arrives, one line per prompt, or
    with --json one object per prompt: {"text", "token_ids" (generated only), "finish_reason"},
    plus "logprobs" with --logprobs N: per generated token {"token_id", "logprob", "top": [[id,
    logprob], ...]}. Exit 1 with "error: CODE: message" on stderr when a request fails.
    """
    logprobs = getattr(args, "logprobs", None)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos, logprobs=logprobs,
    )
    try:
        security = security_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with Client(args.url, timeout=getattr(args, "timeout", None), security=security) as client:
        for text in args.prompts:
            prompt: Prompt = [{"role": "user", "content": text}] if args.chat else text
            acc = _Collector()
            try:
                for chunk in client.generate(prompt, sampling):
                    acc.add(chunk)
                    if not args.json and chunk.text:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                done = acc.result()
            except ClientError as e:
                if not args.json:
                    sys.stdout.write("\n")
                print(f"error: {e}", file=sys.stderr)
                return 1
            if args.json:
                line: dict[str, object] = {"text": done.text, "token_ids": list(done.token_ids),
                                           "finish_reason": done.finish_reason}
                if logprobs is not None:
                    line["logprobs"] = [logprobs_json(p) for p in done.logprobs]
                print(json.dumps(line))
            else:
                sys.stdout.write("\n")
    return 0
