"""RouterConfig: the router's settings, validated when built (one frozen dataclass, STYLE habit 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.serving.channels import PLAINTEXT, ChannelSecurity
from router.policy import RoutingConfig


def parse_address(address: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port); raises ValueError naming the address."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT with a port in 1..65535, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens and which decode nodes it forwards to.

    decode_nodes: 'HOST:PORT' of every decode (or colocated) node; at least one.
    health_interval_s: seconds between two polls of a node's health and load.
    health_timeout_s: deadline of one health Check.
    health_misses: health Checks in a row that may miss their deadline before a node is out (a
        busy node answers late now and then; a stopped one misses every time). A refused
        connection, an error or NOT_SERVING takes it out at once.
    load_timeout_s: deadline of one GetNodeInfo call (answered by the node's engine thread, so slower
        under load); a node that misses it keeps its last load, one that answers an error is out.
    default_max_tokens: the max_tokens the router assumes, when weighing a request's work, for a
        request that leaves it unset (SamplingParams' default).
    shutdown_grace_s: how long in-flight calls may run on after SIGTERM.
    request_timeout_s: the end-to-end deadline of a Generate call (HTTP or gRPC) from its arrival,
        migrations included; a gRPC client's own deadline wins when it is shorter (S8).
    max_inflight_requests: Generate calls (HTTP and gRPC together) the router serves at once; one
        more is refused with RESOURCE_EXHAUSTED / HTTP 429 and Retry-After (S8).
    retry_after_s: the retry hint of such a refusal (HTTP Retry-After, whole seconds).
    max_inflight_per_client: Generate calls one client may have in flight at once (HTTP and gRPC
        together); one more is refused like a full router. A client is its API key when it sends
        one (`Authorization: Bearer KEY`, on HTTP or as gRPC metadata), else its peer address
        (the host, without the port; the router's own gRPC token names no client): clients sharing
        one key, or one proxy, share one cap.
    write_timeout_s: how long one streamed message (an SSE event, a gRPC stream message) may wait
        for the client to take it (its socket buffers full: it reads nothing); past it the stream
        is cut, its admission slots freed and its downstream call cancelled (the decode node
        aborts the request), counted in pdserve:router_stream_write_timeouts_total.
    max_migrations: how many times one request may move to another decode node after the one
        serving it failed mid-stream (S10); 0 ends such a request with an error.
    routing: the decode-node selection policy and its knobs (least-loaded or prefix-aware).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    decode_nodes: tuple[str, ...] = ()
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    health_misses: int = 2
    load_timeout_s: float = 5.0
    default_max_tokens: int = 16
    shutdown_grace_s: float = 5.0
    request_timeout_s: float = 300.0
    max_inflight_requests: int = 4096
    retry_after_s: float = 1.0
    max_inflight_per_client: int = 1024
    write_timeout_s: float = 30.0
    max_migrations: int = 2
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    security: ChannelSecurity = PLAINTEXT  # its gRPC port and its channels to the nodes (mTLS, token; S9)

    def __post_init__(self) -> None:
        if isinstance(self.decode_nodes, str):
            object.__setattr__(self, "decode_nodes", tuple(a for a in self.decode_nodes.split(",") if a.strip()))
        object.__setattr__(self, "decode_nodes", tuple(a.strip() for a in self.decode_nodes))
        if not self.decode_nodes:
            raise ValueError("the router needs at least one decode node (--decode HOST:PORT[,HOST:PORT...])")
        for address in self.decode_nodes:
            parse_address(address)
        if len(set(self.decode_nodes)) != len(self.decode_nodes):
            raise ValueError(f"decode node addresses must be distinct, got {list(self.decode_nodes)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("health_interval_s", "health_timeout_s", "load_timeout_s", "shutdown_grace_s",
                     "request_timeout_s", "retry_after_s", "write_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if isinstance(self.health_misses, bool) or not isinstance(self.health_misses, int) or self.health_misses < 1:
            raise ValueError(f"health_misses must be an integer >= 1, got {self.health_misses!r}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if isinstance(self.max_inflight_requests, bool) or not isinstance(self.max_inflight_requests, int) \
                or self.max_inflight_requests < 1:
            raise ValueError(f"max_inflight_requests must be an integer >= 1, got {self.max_inflight_requests!r}")
        if isinstance(self.max_inflight_per_client, bool) or not isinstance(self.max_inflight_per_client, int) \
                or self.max_inflight_per_client < 1:
            raise ValueError(f"max_inflight_per_client must be an integer >= 1, got {self.max_inflight_per_client!r}")
        if isinstance(self.max_migrations, bool) or not isinstance(self.max_migrations, int) or self.max_migrations < 0:
            raise ValueError(f"max_migrations must be an integer >= 0, got {self.max_migrations!r}")

    @property
    def listen_address(self) -> str:
        return f"{self.host}:{self.port}"
