"""Who a Generate call's client is, for the router's per-client cap (RouterConfig.max_inflight_per_client),
and the write deadline of a streamed answer (RouterConfig.write_timeout_s).

    client = http_client(request.headers.get("Authorization"), request.remote)   # 'key:1f0c...' / 'peer:10.0.0.7'
    client = grpc_client(context.invocation_metadata(), context.peer())
    async with write_deadline(timeout_s, "grpc", rid):   # WriteTimeoutError when the write takes longer
        await context.write(response)

A client is its API key when it sends one (`Authorization: Bearer KEY`: HTTP header or gRPC
metadata), named by a short SHA-256 of the key so that no secret reaches a log line or an error
message; else its peer address without the port (every connection of one host is one client). The router's own
gRPC token (--auth-token-file), which every gRPC client of a token-secured router sends, is no
client's key: such calls are keyed by peer.
Clients behind one proxy, or sharing one key, share one cap.

A write deadline bounds one wait: the write of one streamed message, which blocks only once the
client's socket buffers (and the transport's) are full, i.e. the client has read nothing for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from pdserve.serving.metrics import router_metrics
from pdserve_api.servers import StatusError

logger = logging.getLogger(__name__)

AUTH_KEY = "authorization"   # the header and the gRPC metadata key (vLLM's and OpenAI's convention)
KEY_HASH_CHARS = 16


class WriteTimeoutError(StatusError):
    """A streamed message waited longer than the write deadline for a client that reads nothing."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


def _bearer(value: str | bytes | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, key = value.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def _key_name(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:KEY_HASH_CHARS]


def http_client(authorization: str | None, remote: str | None) -> str:
    """The client of an HTTP request: its bearer key's hash, else 'peer:<remote address>'."""
    key = _bearer(authorization)
    return _key_name(key) if key is not None else f"peer:{remote or 'unknown'}"


def peer_host(peer: str | None) -> str:
    """grpc's peer string ('ipv4:10.0.0.7:5123', 'ipv6:[::1]:5123', 'unix:/path') without the port."""
    if not peer:
        return "unknown"
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, sep, port = address.rpartition(":")
        return host.strip("[]") if sep and port.isdigit() else address
    return peer


def grpc_client(metadata: Sequence[tuple[str, str | bytes]] | None, peer: str | None,
                shared_token: str | None = None) -> str:
    """The client of a gRPC call: its bearer key's hash (`authorization` metadata), else 'peer:<host>'.
    shared_token: the router's own --auth-token (every gRPC client of that router sends it, so it
    names no one client): a call bearing it is keyed by its peer."""
    for name, value in metadata or ():
        if name.lower() == AUTH_KEY:
            key = _bearer(value)
            if key is not None and key != shared_token:
                return _key_name(key)
    return f"peer:{peer_host(peer)}"


@contextlib.asynccontextmanager
async def write_deadline(timeout_s: float, api: str, request_id: str) -> AsyncIterator[None]:
    """Bound the write inside to `timeout_s`; past it, count it and raise WriteTimeoutError."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError as e:
        router_metrics().write_timeouts.labels(api=api).inc()
        logger.warning("request_id=%s: the %s client took no message for %g s; cutting its stream "
                       "(router --stream-write-timeout-s)", request_id, api, timeout_s)
        raise WriteTimeoutError(f"request {request_id}: the client read nothing for {timeout_s:g} s "
                                "(router --stream-write-timeout-s); the stream was cut") from e

