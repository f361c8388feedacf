"""The one place that makes gRPC server ports and client channels (S9), with TLS / mTLS, a shared
token, and keepalive on every connection.

    security = ChannelSecurity.load(cert_file="node.pem", key_file="node.key", ca_file="ca.pem",
                                    token_file="token")                  # or ChannelSecurity() (plaintext)
    server = aio_server(security, interceptors=[...], options=[...])     # token check + keepalive
    port = add_server_port(server, "127.0.0.1:0", security)              # mTLS when a cert is given
    channel = open_channel("127.0.0.1:50061", security)                  # grpc.aio; sync: open_sync_channel
    identity = caller_identity(context)                                  # the caller's verified cert names

Security (ChannelSecurity, validated when built: files exist and parse, the key matches the
certificate, the token is long enough):
- TLS is on when a certificate (servers, and clients that present one) or a CA (clients) is given.
  A server with TLS asks every client for a certificate signed by the CA (mTLS,
  `require_client_auth`); a client verifies the server's certificate against the CA and presents
  its own when it has one. One certificate per process serves both ways (the router and the
  decode nodes are servers and clients), so node certificates carry both serverAuth and
  clientAuth usage, and a DNS or IP SAN for the address clients dial (`server_name` overrides
  the name checked).
- The token (from a file, else $PDSERVE_AUTH_TOKEN) is sent by every channel as
  `authorization: Bearer <token>` call metadata, and a server with a token refuses every call
  without the same token with UNAUTHENTICATED (constant-time compare), except grpc.health.v1
  Check/Watch (orchestrator probes send no metadata; a health status is no secret). Without TLS
  the token crosses the network in plaintext: it keeps out callers that cannot read the traffic,
  nothing more.
- `caller_identity(context)` is what a handler knows about its caller: the names (CN and DNS SANs)
  of its verified client certificate (empty without mTLS) and the host it called from.

Malformed requests (every server from aio_server): bytes that do not parse as the method's request
message are answered INVALID_ARGUMENT naming the method, the type and the parser's error
(MalformedRequestInterceptor; grpc.aio alone answers them UNKNOWN).

Interceptor order (aio_server): the token check outermost (it refuses before anything else runs),
then the caller's interceptors, then MalformedRequestInterceptor innermost, next to the servicer's
own handlers: those are the same objects at every call, so each method's parsing wrapper is built
once and cached (by handler identity; a caller's interceptor such as AioExceptionToStatusInterceptor
builds a new handler per call, which would defeat the cache if it sat inside). The token check
caches its refusing handler per method and handler kind. Both caches hold at most
MAX_CACHED_HANDLERS entries (methods a server registers; beyond that, handlers are built per call).

Keepalive (every server and channel): a channel pings after KEEPALIVE_TIME_MS without traffic,
also with no call in flight, and drops the connection (failing its calls with UNAVAILABLE) when a
ping is not answered within KEEPALIVE_TIMEOUT_MS, so a stopped or partitioned peer is noticed in
about ten seconds instead of never; servers ping their clients the same way and accept client
pings as often as every MIN_PING_INTERVAL_MS, so clients are never sent GOAWAY for pinging.

Blocking waits: none here; `ChannelSecurity.load` reads small files.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import inspect
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError

TOKEN_ENV = "PDSERVE_AUTH_TOKEN"      # the token, when no --auth-token-file is given
TOKEN_HEADER = "authorization"        # metadata key; the value is "Bearer <token>"
MIN_TOKEN_CHARS = 16
# Methods a server with a token still answers without one.
TOKEN_EXEMPT = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})

MAX_CACHED_HANDLERS = 1024   # per interceptor: far above the methods a server registers (~20)

KEEPALIVE_TIME_MS = 5_000       # idle time before a keepalive ping
KEEPALIVE_TIMEOUT_MS = 5_000    # an unanswered ping this long closes the connection
MIN_PING_INTERVAL_MS = 1_000    # servers accept client pings this often (below KEEPALIVE_TIME_MS)

CHANNEL_KEEPALIVE: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # what gRPC core enforces (not the keepalive timeout)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),          # 0: no cap on pings between data frames
)
SERVER_KEEPALIVE: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # what gRPC core enforces (not the keepalive timeout)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),                # 0: never GOAWAY a client for its pings
)

# gRPC core parks calls that reached a server before the application took them, and past
# max_pending_requests (core's default 1000, hard limit 3000) drops new ones at random with a bare
# CANCELLED: a burst of 2000 streams on one connection lost ~10% that way. Far above the
# application's own caps (the router's --max-inflight-requests, 4096 by default; a decode node's
# --max-waiting-requests, 2048), so that those refuse explicitly with RESOURCE_EXHAUSTED first.
SERVER_PENDING_REQUESTS = 16_384
SERVER_PENDING_REQUESTS_HARD = 32_768
SERVER_BACKLOG: tuple[tuple[str, int], ...] = (
    ("grpc.server.max_pending_requests", SERVER_PENDING_REQUESTS),
    ("grpc.server.max_pending_requests_hard_limit", SERVER_PENDING_REQUESTS_HARD),
)

Options = Sequence[tuple[str, Any]]


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror or e}") from None


@dataclass(frozen=True)
class ChannelSecurity:
    """How one process's gRPC servers and channels are secured. The default: plaintext, no token.

    cert_file, key_file: this process's PEM certificate (chain) and private key; both or neither.
    ca_file: PEM CA bundle that signs the peers' certificates (clients' and servers').
    require_client_auth: a TLS server refuses clients without a certificate the CA signed (mTLS).
    token: the shared secret every call carries and every server checks (None: no token).
    server_name: the name a client checks in the server's certificate instead of the dialled host.
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_auth: bool = True
    token: str | None = field(default=None, repr=False)
    server_name: str | None = None
    _cert: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _key: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _ca: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(f"a TLS certificate needs its key and a key its certificate: got cert_file="
                             f"{self.cert_file!r}, key_file={self.key_file!r}")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError(f"TLS with certificate {self.cert_file!r} needs the CA that signs the peers' "
                             f"certificates (ca_file / --tls-ca)")
        if self.cert_file is not None:
            cert, key = _read(self.cert_file, "TLS certificate"), _read(self.key_file or "", "TLS key")
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"TLS certificate {self.cert_file!r} with key {self.key_file!r} does not load "
                                 f"(not PEM, or the key does not match): {e}") from None
            object.__setattr__(self, "_cert", cert)
            object.__setattr__(self, "_key", key)
        if self.ca_file is not None:
            ca = _read(self.ca_file, "TLS CA")
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=self.ca_file)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"TLS CA {self.ca_file!r} holds no PEM certificate: {e}") from None
            object.__setattr__(self, "_ca", ca)
        if self.token is not None:
            bad = [c for c in self.token if not (c.isascii() and c.isprintable()) or c.isspace()]
            if len(self.token) < MIN_TOKEN_CHARS or bad:
                raise ValueError(f"the auth token must be at least {MIN_TOKEN_CHARS} printable ASCII characters "
                                 f"without spaces, got {len(self.token)} characters"
                                 f"{' with ' + repr(''.join(sorted(set(bad)))[:20]) if bad else ''}")

    @classmethod
    def load(cls, cert_file: str | None = None, key_file: str | None = None, ca_file: str | None = None,
             token_file: str | None = None, require_client_auth: bool = True, server_name: str | None = None,
             token_env: str | None = TOKEN_ENV) -> ChannelSecurity:
        """A ChannelSecurity whose token is read from `token_file` (one line; surrounding whitespace
        dropped), else from $`token_env` when set; ValueError naming a file that is missing or bad."""
        token: str | None = None
        if token_file is not None:
            raw = _read(token_file, "auth token file")
            try:
                token = raw.decode("ascii").strip()
            except UnicodeDecodeError:
                raise ValueError(f"auth token file {token_file!r} is not ASCII text") from None
        elif token_env and os.environ.get(token_env):
            token = os.environ[token_env].strip()
        return cls(cert_file=cert_file, key_file=key_file, ca_file=ca_file, require_client_auth=require_client_auth,
                   token=token, server_name=server_name)

    @property
    def tls(self) -> bool:
        return self.cert_file is not None or self.ca_file is not None

    @property
    def mtls(self) -> bool:
        """Servers ask for client certificates and clients present one."""
        return self.cert_file is not None and self.require_client_auth

    def describe(self) -> str:
        """'plaintext', 'TLS', 'mTLS', each '+ token' when there is one (for serving lines and logs)."""
        kind = "mTLS" if self.mtls else "TLS" if self.tls else "plaintext"
        return f"{kind} + token" if self.token else kind


PLAINTEXT = ChannelSecurity()


# --- servers ----------------------------------------------------------------------------------------

class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>` with UNAUTHENTICATED
    (compared in constant time), except the methods in `exempt`."""

    def __init__(self, token: str, exempt: frozenset[str] = TOKEN_EXEMPT) -> None:
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt
        # (method, request streaming, response streaming, deserializer, serializer) -> refusing handler:
        # everything _refusing reads, so a hit is the handler it would build
        self._refusals: dict[tuple[Any, ...], grpc.RpcMethodHandler] = {}

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        got = b""
        for key, value in metadata or ():
            if key == TOKEN_HEADER:
                got = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
                break
        return hmac.compare_digest(got, self._expected)

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._exempt:
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        key = (handler_call_details.method, bool(handler.request_streaming), bool(handler.response_streaming),
               handler.request_deserializer, handler.response_serializer)
        refusal = self._refusals.get(key)
        if refusal is None:
            refusal = _refusing(handler, handler_call_details.method)
            if len(self._refusals) < MAX_CACHED_HANDLERS:
                self._refusals[key] = refusal
        return refusal


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED."""
    message = f"{method}: missing or wrong auth token (metadata '{TOKEN_HEADER}: Bearer <token>')"

    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not parse as its method's message with INVALID_ARGUMENT naming
    the method, the message type and the parser's error. (grpc.aio parses before any handler or
    interceptor runs, and answers a parse error UNKNOWN "Unexpected DecodeError".) Each handler's
    request deserializer becomes the identity and the parse moves into the handler, where it can
    abort with a status; the handler's kind and response serializer stay. The wrapper of each
    (method, handler object) is built once (module docstring: interceptor order)."""

    def __init__(self) -> None:
        # method -> (the handler, its wrapper)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:   # identity: the wrapper closes over this handler
            return cached[1]
        wrapped = _parsing(handler, method)
        if cached is not None or len(self._wrapped) < MAX_CACHED_HANDLERS:
            self._wrapped[method] = (handler, wrapped)
        return wrapped


def _parsing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with its request parse inside the handler (see MalformedRequestInterceptor)."""
    deserialize = handler.request_deserializer
    what = getattr(getattr(deserialize, "__self__", None), "__name__", "its request message")

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{method}: {len(raw)} request bytes are not a valid {what}: {e}")

    async def parsed_stream(raws: Any, context: grpc.aio.ServicerContext) -> Any:
        async for raw in raws:
            yield await parse(raw, context)

    streaming_out = bool(handler.response_streaming)
    if handler.request_streaming:
        behavior = handler.stream_stream if streaming_out else handler.stream_unary
        make = grpc.stream_stream_rpc_method_handler if streaming_out else grpc.stream_unary_rpc_method_handler

        def requests_of(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            return parsed_stream(raw, context)
    else:
        behavior = handler.unary_stream if streaming_out else handler.unary_unary
        make = grpc.unary_stream_rpc_method_handler if streaming_out else grpc.unary_unary_rpc_method_handler
        requests_of = None  # type: ignore[assignment]

    async def request_of(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        return requests_of(raw, context) if requests_of is not None else await parse(raw, context)

    if inspect.isasyncgenfunction(behavior):
        async def stream(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            async for out in behavior(await request_of(raw, context), context):
                yield out
        wrapped: Any = stream
    elif inspect.iscoroutinefunction(behavior):
        async def call(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await request_of(raw, context), context)
        wrapped = call
    elif not streaming_out and not handler.request_streaming:
        async def call_sync(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            # grpc.aio runs a plain function in its executor; so does this (e.g. the generated
            # servicer's UNIMPLEMENTED stubs)
            request = await parse(raw, context)
            return await asyncio.get_running_loop().run_in_executor(None, behavior, request, context)
        wrapped = call_sync
    else:
        return handler   # a plain (sync) streaming behavior: grpc.aio iterates it; none of ours is one
    return make(wrapped, request_deserializer=None, response_serializer=handler.response_serializer)


def server_options(options: Options = ()) -> list[tuple[str, Any]]:
    """`options` with the servers' keepalive and backlog settings added (an option given in `options` wins)."""
    given = {k for k, _ in options}
    return [*options, *((k, v) for k, v in (*SERVER_KEEPALIVE, *SERVER_BACKLOG) if k not in given)]


def aio_server(security: ChannelSecurity, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               options: Options = ()) -> grpc.aio.Server:
    """A grpc.aio server with keepalive, the token check first when `security` has a token, then
    `interceptors`, then malformed requests answered INVALID_ARGUMENT (MalformedRequestInterceptor,
    innermost: module docstring)."""
    chain = [TokenAuthInterceptor(security.token)] if security.token else []
    return grpc.aio.server(interceptors=[*chain, *interceptors, MalformedRequestInterceptor()],
                           options=server_options(options))


def server_credentials(security: ChannelSecurity) -> grpc.ServerCredentials:
    if security._cert is None or security._key is None:
        raise ValueError("a TLS server needs a certificate and its key (--tls-cert, --tls-key)")
    if security.require_client_auth and security._ca is None:
        raise ValueError("an mTLS server needs the CA that signs client certificates (--tls-ca)")
    return grpc.ssl_server_credentials([(security._key, security._cert)], root_certificates=security._ca,
                                       require_client_auth=security.require_client_auth)


def add_server_port(server: grpc.aio.Server | grpc.Server, address: str, security: ChannelSecurity) -> int:
    """Bind `address` (HOST:PORT; port 0: any) with TLS (mTLS) when `security` has a certificate, else
    plaintext; returns the bound port. Raises RuntimeError (gRPC's) or OSError when it cannot bind."""
    if security.cert_file is not None:
        port = server.add_secure_port(address, server_credentials(security))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC port {address}")
    return port


# --- channels ---------------------------------------------------------------------------------------

def channel_options(options: Options = (), security: ChannelSecurity = PLAINTEXT) -> list[tuple[str, Any]]:
    """`options` with the channels' keepalive settings (and the TLS name override) added."""
    extra: list[tuple[str, Any]] = list(CHANNEL_KEEPALIVE)
    if security.tls and security.server_name:
        extra.append(("grpc.ssl_target_name_override", security.server_name))
    given = {k for k, _ in options}
    return [*options, *((k, v) for k, v in extra if k not in given)]


def channel_credentials(security: ChannelSecurity) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=security._ca, private_key=security._key,
                                        certificate_chain=security._cert)


def _with_token(metadata: Any, token: str) -> list[tuple[str, str | bytes]]:
    kept = [(k, v) for k, v in (metadata or ()) if k != TOKEN_HEADER]
    return [*kept, (TOKEN_HEADER, f"Bearer {token}")]


class _AioToken:
    """Adds the token to every call of a grpc.aio channel (one subclass per call kind: grpc.aio files
    an interceptor under the first kind it implements only)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(d.method, d.timeout, grpc.aio.Metadata(*_with_token(d.metadata, self._token)),
                                          d.credentials, d.wait_for_ready)


class _AioTokenUU(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _AioTokenUS(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _AioTokenSU(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


class _AioTokenSS(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


def open_channel(address: str, security: ChannelSecurity = PLAINTEXT, options: Options = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` (HOST:PORT): TLS when `security` says so, the token on every
    call, keepalive."""
    opts = channel_options(options, security)
    interceptors = ([kind(security.token) for kind in (_AioTokenUU, _AioTokenUS, _AioTokenSU, _AioTokenSS)]
                    if security.token else None)
    if security.tls:
        return grpc.aio.secure_channel(address, channel_credentials(security), options=opts,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)


@dataclass(frozen=True)
class _SyncDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _SyncDetails(d.method, d.timeout, _with_token(d.metadata, self._token), d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._details(client_call_details), request_iterator)


def open_sync_channel(address: str, security: ChannelSecurity = PLAINTEXT, options: Options = ()) -> grpc.Channel:
    """A blocking channel to `address`, secured as open_channel's (close it, or use it as a context manager)."""
    opts = channel_options(options, security)
    if security.tls:
        channel = grpc.secure_channel(address, channel_credentials(security), options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    return grpc.intercept_channel(channel, _SyncToken(security.token)) if security.token else channel


# --- who is calling ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class CallerIdentity:
    """A call's caller as the server knows it: `names`, the common name and DNS subject
    alternative names of its verified client certificate (empty without mTLS; IP SANs are not
    names: a certificate for a shared host address must not pass for a node), and `host`, the
    address it called from (None when the transport has none, e.g. a unix socket)."""

    names: frozenset[str]
    host: str | None

    @property
    def authenticated(self) -> bool:
        return bool(self.names)


def _peer_host(peer: str) -> str | None:
    """'ipv4:127.0.0.1:5000' -> '127.0.0.1'; 'ipv6:[::1]:5000' -> '::1'; others -> None."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host.strip("[]") or None
    return None


def caller_identity(context: grpc.aio.ServicerContext | grpc.ServicerContext) -> CallerIdentity:
    """Who called (see CallerIdentity)."""
    auth = context.auth_context() or {}
    names: set[str] = set()
    if context.peer_identities():
        for key in ("x509_common_name", "peer_dns"):   # peer_dns: the DNS SANs
            names.update(v.decode("utf-8", "replace") for v in auth.get(key, ()))
    return CallerIdentity(frozenset(names), _peer_host(context.peer() or ""))


def is_local_address(host: str) -> bool:
    """Whether `host` (an IP address) is an address of this machine (loopback, or one a socket binds)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    import socket

    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


# --- flags ------------------------------------------------------------------------------------------

def add_security_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--tls-cert, --tls-key, --tls-ca, --auth-token-file (every server, the client and the launcher)."""
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="this process's TLS certificate: its gRPC servers serve TLS and ask clients for a "
                        "certificate signed by --tls-ca (mTLS); its channels present it (default: plaintext)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA bundle that signs the peers' certificates (needed with --tls-cert; a client "
                        "without a certificate of its own gives only this to verify the server)")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="name to expect in the servers' certificates instead of the dialled host")
    p.add_argument("--auth-token-file", default=None, metavar="PATH",
                   help=f"shared token (one line) that every gRPC call carries and every server checks; "
                        f"default: ${TOKEN_ENV} when set, else no token")


def security_from_args(args: argparse.Namespace) -> ChannelSecurity:
    """The ChannelSecurity of add_security_args' flags (ValueError naming a bad file)."""
    return ChannelSecurity.load(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca,
                                token_file=args.auth_token_file, server_name=args.tls_server_name)


def security_argv(security: ChannelSecurity, token_file: str | None = None) -> list[str]:
    """The flags that give a child process `security` (its token through `token_file`, never argv)."""
    argv: list[str] = []
    for flag, value in (("--tls-cert", security.cert_file), ("--tls-key", security.key_file),
                        ("--tls-ca", security.ca_file), ("--tls-server-name", security.server_name),
                        ("--auth-token-file", token_file)):
        if value is not None:
            argv += [flag, value]
    return argv


def write_token_file(token: str, directory: str) -> str:
    """Write `token` to a new file only its owner can read inside `directory`; returns its path."""
    fd, path = tempfile.mkstemp(prefix="pdserve-token-", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return path
