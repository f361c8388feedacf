"""Decode side of the KV messenger: expected counts, readiness, abandonment (D3, D4, D10, S3, S5).

Primitives:
- `register_kv_cache(spec)` (pdserve.engine.kv_connector.DecodeConnector): the engine hands over
  its pool once; the receiver registers it with the transport and refuses models it cannot move.
- `on_kv_wait(wait)` (engine thread): a request got its pages; the receiver prepares its ticket
  and passes it to `ReceiverEvents.ticket_ready` (or `ticket_refused`).
- `prepare(request_id, num_prompt_tokens, block_ids)`: pick a tag and a context slot, tell the
  ImmCounter how many writes to expect, and return the `TransferTicket` the decode node puts in
  its Prefill call. When the count completes, `ReceiverEvents.kv_landed(request_id)` is called (on
  the fabric progress thread: it must only hand the news to the engine thread).
- `abandon(request_id)`: forget the tag; the caller has made sure no write can land any more
  (the prefill node confirmed its abort, or its endpoint is gone), so the pages may be reused.
- `context(request_id)`: the hidden state / top-k the prefill wrote into the context slot.
"""

from __future__ import annotations

import abc
import itertools
import logging
import random
import threading

from fabric import IMM_TAG_MAX, MemoryRegion, TransferEngine
from kv_messenger.context import Context, ContextCodec
from kv_messenger.plan import KvLayout, ShardingScheme, expected_writes
from kv_messenger.pool import register_pool
from kv_messenger.ticket import TransferTicket
from pdserve.engine.kv_connector import DecodeConnector, KvCacheSpec, KvWait

logger = logging.getLogger(__name__)

CONTEXT_SLOTS = 1024    # requests that may wait for their KV at once


class ReceiverEvents(abc.ABC):
    """What the receiver reports to the decode node that owns it."""

    @abc.abstractmethod
    def ticket_ready(self, ticket: TransferTicket, token_ids: tuple[int, ...]) -> None:
        """Engine thread: a request waits for its KV; send `ticket` with `token_ids` (the prompt
        minus its last token) to a prefill node. Must not block."""

    @abc.abstractmethod
    def ticket_refused(self, request_id: str, error: str) -> None:
        """Engine thread: no ticket could be made for the request (no context slot, ...)."""

    @abc.abstractmethod
    def kv_landed(self, request_id: str) -> None:
        """Fabric progress thread: every write of the request has landed. Must not block."""


class KvReceiver(DecodeConnector):
    """The decode side's connector: give it to the engine (`LLMEngine(config, kv_connector=receiver)`)."""

    def __init__(self, transport: TransferEngine, events: ReceiverEvents,
                 sharding: ShardingScheme = ShardingScheme(), context_slots: int = CONTEXT_SLOTS) -> None:
        self.transport = transport
        self.events = events
        self.sharding = sharding
        self._context_slots = context_slots
        self.kv_region: MemoryRegion | None = None   # set by register_kv_cache
        self.layout: KvLayout | None = None
        self.codec: ContextCodec | None = None
        self._landing = None
        self._free_slots = list(range(context_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._tags = itertools.count(random.SystemRandom().randrange(1, IMM_TAG_MAX))
        self._by_request: dict[str, tuple[int, int]] = {}   # request id -> (tag, slot)
        self._tags_in_use: set[int] = set()

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        pool = register_pool(self.transport, spec, self._context_slots)   # ValueError: cannot be moved
        self.layout, self.kv_region, self.codec, self._landing = pool.layout, pool.region, pool.codec, pool.context

    def on_kv_wait(self, wait: KvWait) -> None:
        try:
            ticket = self.prepare(wait.request_id, len(wait.prompt_token_ids), list(wait.block_ids))
        except (ValueError, RuntimeError) as e:
            self.events.ticket_refused(wait.request_id, f"cannot receive KV: {e}")
            return
        self.events.ticket_ready(ticket, wait.prompt_token_ids[:-1])

    def prepare(self, request_id: str, num_prompt_tokens: int, block_ids: list[int]) -> TransferTicket:
        n_prefill = num_prompt_tokens - 1
        n_pages = -(-n_prefill // self.layout.page_size)
        if n_prefill < 1 or len(block_ids) < n_pages:
            raise ValueError(f"request {request_id}: {len(block_ids)} pages for {n_prefill} prefill tokens")
        count = expected_writes(n_prefill, self.layout, self.sharding, self.sharding)
        with self._lock:
            if request_id in self._by_request:
                raise ValueError(f"request {request_id!r} is already waiting for KV")
            if not self._free_slots:
                raise RuntimeError("no free context slot: too many requests waiting for KV")
            tag = next(self._tags) % (IMM_TAG_MAX + 1)
            while tag in self._tags_in_use or tag == 0:
                tag = next(self._tags) % (IMM_TAG_MAX + 1)
            slot = self._free_slots.pop()
            self._by_request[request_id] = (tag, slot)
            self._tags_in_use.add(tag)
        self.transport.imm_counter.expect(tag, count, lambda _tag, rid=request_id: self.events.kv_landed(rid))
        return TransferTicket(
            request_id=request_id,
            kv=self.kv_region.descriptor,
            layout=self.layout,
            dst_pages=tuple(block_ids[:n_pages]),
            context=self._landing.region.descriptor,
            context_offset=self.codec.slot_offset(slot),
            imm_tag=tag,
            expected_writes=count,
            num_prefill_tokens=n_prefill,
            sharding=self.sharding,
        )

    def context(self, request_id: str) -> Context:
        with self._lock:
            tag, slot = self._by_request[request_id]
        return self.codec.decode(self._landing, slot)

    def landed(self, request_id: str) -> int:
        """Writes counted so far for a request (diagnostics)."""
        with self._lock:
            entry = self._by_request.get(request_id)
        return self.transport.imm_counter.landed(entry[0]) if entry else 0

    def finish(self, request_id: str) -> None:
        """The request's KV is in use by the engine (or it ended): release its tag and slot."""
        with self._lock:
            entry = self._by_request.pop(request_id, None)
            if entry is None:
                return
            tag, slot = entry
            self._tags_in_use.discard(tag)
            self._free_slots.append(slot)

    def abandon(self, request_id: str) -> None:
        """Cancel the expected count; call only once no write for the request can land any more."""
        with self._lock:
            entry = self._by_request.get(request_id)
        if entry is not None:
            self.transport.imm_counter.cancel(entry[0])
        self.finish(request_id)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._by_request)
