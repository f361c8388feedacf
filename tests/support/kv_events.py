"""A decode node's side of a KvReceiver, for tests: tickets kept by request id, landings queued;
and `EngineEvents`, the connector's way back (pdserve.engine.kv_connector's events) as a test
drives it: events queued, then applied by the engine on the test thread."""

from __future__ import annotations

import collections
import queue
from collections.abc import Iterator

from kv_messenger import ReceiverEvents, TransferTicket
from pdserve.engine.kv_connector import KvEvent
from pdserve.engine.outputs import RequestOutput


class EngineEvents:
    """Mix into a test's connector (or ReceiverEvents): `apply(engine, *events)` queues the events
    and has the engine take them (LLMEngine.apply_kv_events), as its next step would."""

    def __init__(self) -> None:
        self.queued: collections.deque[KvEvent] = collections.deque()

    def _take(self) -> Iterator[KvEvent]:
        while self.queued:
            yield self.queued.popleft()

    def kv_events(self) -> Iterator[KvEvent]:   # a connector's
        return self._take()

    def completions(self) -> Iterator[KvEvent]:   # a ReceiverEvents'
        return self._take()

    def apply(self, engine, *events: KvEvent) -> list[RequestOutput]:
        self.queued.extend(events)
        return engine.apply_kv_events()


class QueueEvents(EngineEvents, ReceiverEvents):
    """ticket_ready keeps each ticket in `tickets`; kv_landed puts ("ready", request_id) on `jobs`
    (give a queue to share it with other events of the test); a refused ticket fails the test."""

    def __init__(self, jobs: queue.SimpleQueue | None = None) -> None:
        super().__init__()
        self.tickets: dict[str, TransferTicket] = {}
        self.jobs: queue.SimpleQueue = jobs if jobs is not None else queue.SimpleQueue()

    def ticket_ready(self, ticket: TransferTicket, token_ids: tuple[int, ...]) -> None:
        self.tickets[ticket.request_id] = ticket

    def ticket_refused(self, request_id: str, error: str) -> None:
        raise AssertionError(f"{request_id}: no ticket: {error}")

    def kv_landed(self, request_id: str) -> None:
        self.jobs.put(("ready", request_id))
