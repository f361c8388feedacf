"""A decode node's side of a KvReceiver, for tests: tickets kept by request id, landings queued."""

from __future__ import annotations

import queue

from kv_messenger import ReceiverEvents, TransferTicket


class QueueEvents(ReceiverEvents):
    """ticket_ready keeps each ticket in `tickets`; kv_landed puts ("ready", request_id) on `jobs`
    (give a queue to share it with other events of the test); a refused ticket fails the test."""

    def __init__(self, jobs: queue.SimpleQueue | None = None) -> None:
        self.tickets: dict[str, TransferTicket] = {}
        self.jobs: queue.SimpleQueue = jobs if jobs is not None else queue.SimpleQueue()

    def ticket_ready(self, ticket: TransferTicket, token_ids: tuple[int, ...]) -> None:
        self.tickets[ticket.request_id] = ticket

    def ticket_refused(self, request_id: str, error: str) -> None:
        raise AssertionError(f"{request_id}: no ticket: {error}")

    def kv_landed(self, request_id: str) -> None:
        self.jobs.put(("ready", request_id))
