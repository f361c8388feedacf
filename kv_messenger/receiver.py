"""Decode side of the KV messenger: expected counts, readiness, abandonment (D3, D4, D10, S3, S5).

Primitives:
- `prepare(request_id, num_prompt_tokens, block_ids)`: pick a tag and a context slot, tell the
  ImmCounter how many writes to expect, and return the `PrefillTicket` the decode node puts in its
  Prefill call. When the count completes, `on_ready(request_id)` is called (on the fabric
  progress thread: it must only hand the news to the engine thread).
- `abandon(request_id)`: forget the tag; the caller has made sure no write can land any more
  (the prefill node confirmed its abort, or its endpoint is gone), so the pages may be reused.
- `context(request_id)`: the hidden state / top-k the prefill wrote into the context slot.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from fabric import MemoryRegion, RemoteDescriptor
from fabric.imm import IMM_TAG_MAX
from kv_messenger.context import Context, ContextCodec
from kv_messenger.plan import KvLayout, ShardingScheme, expected_writes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillTicket:
    """Everything a prefill node needs to push one request's KV here."""

    request_id: str
    kv: RemoteDescriptor
    layout: KvLayout
    dst_pages: tuple[int, ...]
    context: RemoteDescriptor
    context_offset: int
    imm_tag: int
    expected_writes: int
    num_prefill_tokens: int
    sharding: ShardingScheme


class KvReceiver:
    def __init__(
        self,
        fabric_engine,                    # fabric.TransferEngine
        kv_region: MemoryRegion,          # the local KV buffer, registered
        layout: KvLayout,
        codec: ContextCodec,
        on_ready: Callable[[str], None],
        sharding: ShardingScheme = ShardingScheme(),
        context_slots: int = 1024,
    ) -> None:
        self.fabric = fabric_engine
        self.kv_region = kv_region
        self.layout = layout
        self.codec = codec
        self.sharding = sharding
        self._on_ready = on_ready
        self._landing = codec.alloc_staging(fabric_engine, slots=context_slots)
        self._free_slots = list(range(context_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._tags = itertools.count(random.SystemRandom().randrange(1, IMM_TAG_MAX))
        self._by_request: dict[str, tuple[int, int]] = {}   # request id -> (tag, slot)
        self._tags_in_use: set[int] = set()

    def prepare(self, request_id: str, num_prompt_tokens: int, block_ids: list[int]) -> PrefillTicket:
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
        self.fabric.imm_counter.expect(tag, count, lambda _tag, rid=request_id: self._on_ready(rid))
        return PrefillTicket(
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
        return self.fabric.imm_counter.landed(entry[0]) if entry else 0

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
            self.fabric.imm_counter.cancel(entry[0])
        self.finish(request_id)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._by_request)
