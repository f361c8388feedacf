"""A bounded admission gate: back-pressure instead of unbounded queues (S8).

    gate = AdmissionGate("decode node n0", max_waiting=2048)     # or max_inflight=, or both
    with gate.enter() as ticket:    # ResourceExhaustedError (RESOURCE_EXHAUSTED / HTTP 429) when full
        ...                         # waiting: counts against max_waiting and max_inflight
        ticket.started()            # running: no longer waiting (its first token came); still in flight
    # left the gate

The router caps the requests it has in flight (RouterConfig.max_inflight_requests); a decode node
caps the requests it holds that have not produced their first token yet (queued in its engine, or
prefilling: DecodeNodeConfig.max_waiting_requests). A request over the cap is refused at once
with RESOURCE_EXHAUSTED naming the count and the cap, and a retry hint (`retry_after_s`, the HTTP
API's `Retry-After`), instead of waiting behind an unbounded queue. It never blocks: no wait here.

    clients = ClientGate("the router", max_per_client=64)
    with clients.enter("peer:10.0.0.7"):   # ResourceExhaustedError past 64 at once for that client
        ...

A ClientGate caps the requests one client has in flight (the router: RouterConfig.
max_inflight_per_client, keyed by API key or peer address), so that one client cannot take every
slot of the AdmissionGate behind it. It holds an entry only for clients with a request in flight.

Not thread-safe: each gate is used from one asyncio event loop (its server's).
"""

from __future__ import annotations

import math

import grpc

from pdserve_api.servers import StatusError


class ResourceExhaustedError(StatusError):
    """A bounded queue is full; the client may retry after `retry_after_s` seconds."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        """HTTP Retry-After: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


class Ticket:
    """One request's place in a gate: waiting until `started()`, released by `close()` (idempotent)."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate = gate
        self.waiting = True
        self.closed = False

    def started(self) -> None:
        """The request runs now (no longer waiting); a no-op after the first call."""
        if self.waiting and not self.closed:
            self.waiting = False
            self._gate.waiting -= 1

    def close(self) -> None:
        if self.closed:
            return
        self.started()
        self.closed = True
        self._gate.inflight -= 1

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AdmissionGate:
    """Counts the requests in flight and those waiting; refuses one over either cap (None: no cap)."""

    def __init__(self, name: str, max_inflight: int | None = None, max_waiting: int | None = None,
                 retry_after_s: float = 1.0) -> None:
        for label, cap in (("max_inflight", max_inflight), ("max_waiting", max_waiting)):
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
                raise ValueError(f"{name}: {label} must be an integer >= 1 (or None: no cap), got {cap!r}")
        if not retry_after_s > 0:
            raise ValueError(f"{name}: retry_after_s must be > 0, got {retry_after_s!r}")
        self.name = name
        self.max_inflight = max_inflight
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self.waiting = 0
        self.refused = 0

    def enter(self) -> Ticket:
        """A ticket for one more request (waiting), or ResourceExhaustedError naming the cap it hit."""
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            self.refused += 1
            raise ResourceExhaustedError(
                f"{self.name} has {self.inflight} requests in flight, its cap (max {self.max_inflight}); "
                f"retry in {self.retry_after_s:g} s", self.retry_after_s)
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            self.refused += 1
            raise ResourceExhaustedError(
                f"{self.name} has {self.waiting} requests waiting for their first token, its cap "
                f"(max {self.max_waiting}); retry in {self.retry_after_s:g} s", self.retry_after_s)
        self.inflight += 1
        self.waiting += 1
        return Ticket(self)


class ClientTicket:
    """One request's place in a ClientGate; released by `close()` (idempotent)."""

    def __init__(self, gate: ClientGate, client: str) -> None:
        self._gate = gate
        self.client = client
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._gate._leave(self.client)

    def __enter__(self) -> ClientTicket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClientGate:
    """Counts each client's requests in flight; refuses one over `max_per_client` for that client.

    A client is whatever string the caller keys it by (the router: 'key:<hash of its API key>' or
    'peer:<address>'); it is named in the refusal, so it must carry no secret."""

    def __init__(self, name: str, max_per_client: int, retry_after_s: float = 1.0) -> None:
        if isinstance(max_per_client, bool) or not isinstance(max_per_client, int) or max_per_client < 1:
            raise ValueError(f"{name}: max_per_client must be an integer >= 1, got {max_per_client!r}")
        if not retry_after_s > 0:
            raise ValueError(f"{name}: retry_after_s must be > 0, got {retry_after_s!r}")
        self.name = name
        self.max_per_client = max_per_client
        self.retry_after_s = retry_after_s
        self.inflight: dict[str, int] = {}   # client -> requests in flight (no entry: none)
        self.refused = 0

    def enter(self, client: str) -> ClientTicket:
        """A ticket for one more request of `client`, or ResourceExhaustedError when it is at its cap."""
        held = self.inflight.get(client, 0)
        if held >= self.max_per_client:
            self.refused += 1
            raise ResourceExhaustedError(
                f"{self.name}: client {client} has {held} requests in flight, the per-client cap "
                f"(max {self.max_per_client}); retry in {self.retry_after_s:g} s", self.retry_after_s)
        self.inflight[client] = held + 1
        return ClientTicket(self, client)

    def _leave(self, client: str) -> None:
        left = self.inflight[client] - 1
        if left:
            self.inflight[client] = left
        else:
            del self.inflight[client]
