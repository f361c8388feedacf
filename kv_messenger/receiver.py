"""Decode side of the KV messenger: expected counts, readiness, abandonment, quarantine and fences
(D3, D4, D10, D20, S3, S5).

Primitives:
- `register_kv_cache(spec)` (pdserve.engine.kv_connector.DecodeConnector): the engine hands over
  its pool once; the receiver registers it with the transport (and a small fence buffer) and
  refuses models it cannot move.
- `on_kv_wait(wait)` (engine thread): a request got its pages; the receiver prepares its ticket
  and passes it to `ReceiverEvents.ticket_ready` (or `ticket_refused`).
- `prepare(request_id, num_prompt_tokens, block_ids, prefill_tp)`: pick a tag and a context slot
  and return the `TransferTicket` the decode node puts in its Prefill call, with the request's
  next attempt number (0, then +1 on every prepare of the same request id: D20), addressed to a
  prefill node of tensor-parallel size `prefill_tp`: the ImmCounter is told how many writes to
  expect, which the shard plan of that node's split into ours fixes (D14). `prefill_tp=None`
  leaves the ticket unaddressed (what `on_kv_wait` hands over: the prefill node is not chosen
  yet); `address(ticket, prefill_tp, prefill_engine)` addresses it once it is, before the ticket is
  sent (writes that land before it anyway still count: the ImmCounter keeps them, and they are not
  stale).
  When the count completes, `ReceiverEvents.kv_landed(request_id)` is
  called (on the fabric progress thread: it must only hand the news to the engine thread).
- hybrid models (E8, Gemma 3): every attention group travels; the ticket names the sliding
  group's pages from the first one its first decode step reads (plan.window_first_page), and the
  count covers each layer's pages.
- tensor parallelism (D15): every rank's pool (KvCacheSpec.shards, mapped in this process) is
  registered with the one transport; the ticket carries one descriptor per rank, and the count
  covers the writes into all of them (the context write goes to the leader's landing area).
- `finish(request_id)`: the KV is in use (or the request ended with nothing in flight): the tag
  is tombstoned and the slot freed.
- `abandon(request_id)`: the caller has made sure no write can land any more (the call never
  reached a prefill node): the same, without waiting.
- `quarantine(request_id)` -> its tag: a write of the transfer may still land (S5). The request
  leaves the receiver (a new attempt may `prepare` at once), the tag's count is cancelled and its
  context slot stays reserved; writes landing for it are counted as quarantined, not stale.
  `release_quarantined(tag)` once the prefill side has provably stopped: slot freed, tag
  tombstoned.
- `expect_fence(on_landed)` -> (tag, fence region): one write expected into the fence buffer (an
  AbortPrefill's delivery fence); `retire_fence(tag)` when it is no longer waited for.
- `context(request_id)`: the hidden state / top-k the prefill wrote into the context slot, once
  its record (kv_messenger.context, D19) is checked against what this attempt expects: this
  node's layout (hidden size, top-k, dtype, hidden kind), the attempt's identity (request id, this
  node's fabric engine id, attempt, imm tag) and position (prompt tokens - 2); ContextRecordError
  naming the field and both values otherwise. Call once the write count completed (the decode
  node checks every transfer's record there, before the KV is used).
- `verify(request_id, tag, kv_checksums, count)` (S7, `kv_checksum=True`): once the request's
  write count completed, hash the runs that landed in its pages and context slot (the ticket's
  pages, the canonical order of kv_messenger.checksum) and compare them with the sender's
  values: a `ChecksumResult` naming the first bad run, if any. TEST-ONLY: a receiver built with a
  fault plan (pdserve.engine.faults; a decode node's entry point reads its `corrupt_kv` from
  $PDSERVE_TEST_ONLY_CORRUPT_KV="PREFIX:N[,PREFIX:N...]") makes the verification of attempts 0 ..
  N-1 of every request whose id starts with PREFIX first flip one bit of the request's first
  landed page (layer 0, page 0, K, the top byte of its first element), logged as a warning: it
  stands for corruption on the wire or in memory, for the tests that prove detection
  (tests/integration/test_kv_checksum.py). Without a plan (always, outside those tests): no effect.

Who wrote (S9, issue 15 item 6): `address(..., prefill_engine=ENGINE_ID)` and
`expect_fence(..., writer=ENGINE_ID)` bind the attempt's count (its fence's) to the fabric engine
it was dispatched to. Where the transport names the writer of each write
(`ImmCounter.names_writers`, fabric.imm: efa; not shm or tcp;ofi_rxm, whose remote-write
completions carry no usable source, so there every write with the tag counts as before), a write
from any other engine, or from an address in no AV entry, never counts toward the attempt (nor
toward a fence, a quarantine or a write kept before addressing): it is a stale write, counted
and logged naming both engines. The writes still land (the target cannot refuse them: the memory
key is the pool's); the attempt's count stays short, so the request is never scheduled on them.

Tombstones: a tag that finished, was abandoned or released is cancelled in the ImmCounter (which
remembers the last 65536 cancelled tags), so a later write never counts toward anything; every
write that lands for a tag no live transfer, quarantine or fence holds is a stale write, counted
in `stale_writes` and reported through `ReceiverEvents.kv_stale_write` (pdserve:kv_stale_writes_total
on the decode node): it must stay 0. Memory is bounded: tags and slots by CONTEXT_SLOTS, the
attempt numbers of the last REMEMBERED_ATTEMPTS request ids.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import itertools
import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from fabric import IMM_TAG_MAX, MemoryRegion, RemoteDescriptor, TransferEngine
from kv_messenger import checksum
from kv_messenger.context import Context, ContextCodec, ExpectedRecord, TransferIdentity
from kv_messenger.plan import DTYPE_SIZES, KvLayout, ShardingScheme, num_prompt_pages, window_first_page
from kv_messenger.pool import register_pool
from kv_messenger.shard_plan import KvShards, ShardPlan, plan_transfer
from kv_messenger.ticket import GroupTarget, TransferTicket
from pdserve.engine.faults import CORRUPT_KV_ENV, NO_FAULTS, FaultPlan
from pdserve.engine.kv_connector import DecodeConnector, KvCacheSpec, KvEvent, KvWait

logger = logging.getLogger(__name__)

CONTEXT_SLOTS = 1024    # default: requests that may wait for their KV (or be quarantined) at once
REMEMBERED_ATTEMPTS = 65536   # request ids whose last attempt number is kept
FENCE_BUFFER_BYTES = 64       # the fence buffer: written by fences, never read
TEST_CORRUPT_ENV = CORRUPT_KV_ENV   # deprecated alias: pdserve.engine.faults.CORRUPT_KV_ENV


@dataclass(frozen=True)
class _Wait:
    tag: int
    slot: int
    attempt: int
    pages: tuple[int, ...] = ()
    plan: ShardPlan | None = None   # set when addressed: the prefill node's split into ours
    writer: str | None = None       # set when addressed: the prefill engine only whose writes count
    layer_pages: tuple[tuple[int, ...], ...] = ()   # per layer, the destination pages written there
    position: int = 0               # the prompt position its context record's hidden state is of


@dataclass(frozen=True)
class ChecksumResult:
    """One transfer's S7 verification."""

    request_id: str
    runs: int                              # values compared (KV runs + the context record)
    mismatch: checksum.Mismatch | None     # None: every run agrees

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def checksum_elem_top(layout: KvLayout) -> int:
    """Byte offset of the most significant byte of an element (little-endian): a flip there
    changes the value a lot (an exponent bit), as real corruption might."""
    return DTYPE_SIZES[layout.dtype] - 1


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

    def kv_landed_tag(self, request_id: str, tag: int) -> None:
        """Fabric progress thread: every write of the request's attempt with `tag` has landed (the
        tag tells a landing of an attempt quarantined meanwhile from the current one). Must not
        block. Default: kv_landed(request_id)."""
        self.kv_landed(request_id)

    def kv_stale_write(self, tag: int, count: int) -> None:  # noqa: B027 (optional hook)
        """Fabric progress thread: `count` writes landed for a tag no transfer holds. Must not block."""

    def completions(self) -> Iterator[KvEvent]:
        """Engine thread: the engine's events (KvLanded, KvFailed, ...) the owner queued since the
        last call (the receiver's `kv_events`). None by default."""
        return iter(())


class KvReceiver(DecodeConnector):
    """The decode side's connector: give it to the engine (`LLMEngine(config, kv_connector=receiver)`)."""

    def __init__(self, transport: TransferEngine, events: ReceiverEvents, context_slots: int = CONTEXT_SLOTS,
                 kv_checksum: bool = False, faults: FaultPlan = NO_FAULTS) -> None:
        self.transport = transport
        self.kv_checksum = kv_checksum   # S7: tickets ask the sender for checksums; verify() checks them
        self._faults = faults            # TEST ONLY (corrupt_kv): see verify
        if faults.corrupt_kv:
            logger.warning("TEST ONLY: %r: verifications of those requests' attempts corrupt a landed byte first",
                           faults.corrupt_kv)
        self.events = events
        self.sharding = ShardingScheme()             # set by register_kv_cache: this node's TP size
        self._context_slots = context_slots
        self.kv_region: MemoryRegion | None = None   # set by register_kv_cache: rank 0's pool
        self.kv_regions: tuple[MemoryRegion, ...] = ()   # every TP rank's pool, rank order
        self.layout: KvLayout | None = None              # kv_heads: the model's total
        self.shards: KvShards | None = None              # this node's split of it
        self.groups: tuple = ()                          # the engine's attention groups (AttentionGroupSpec)
        self.placements: tuple = ()                      # D16: each rank's ShardPlacement
        self.codec: ContextCodec | None = None
        self._landing = None
        self._free_slots = list(range(context_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._tags = itertools.count(random.SystemRandom().randrange(1, IMM_TAG_MAX))
        self._by_request: dict[str, _Wait] = {}
        self._tags_in_use: set[int] = set()           # waiting requests, quarantines, fences
        self._quarantined: dict[int, int] = {}        # tag -> context slot kept
        self._writers: dict[int, str | None] = {}     # quarantine / fence tag -> the engine whose writes it expects
        self._fences: set[int] = set()
        self._retired_fences: OrderedDict[int, str | None] = OrderedDict()   # a late fence is not stale: -> its writer
        self._attempts: OrderedDict[str, int] = OrderedDict()          # request id -> last attempt
        self._fence_buf = bytearray(FENCE_BUFFER_BYTES)
        self.fence_region: MemoryRegion | None = None
        self.stale_writes = 0          # writes for tags nothing holds (must stay 0)
        self.quarantined_writes = 0    # writes that landed in quarantined pages (harmless)
        transport.imm_counter.on_orphan = self._orphan
        transport.imm_counter.on_foreign = self._foreign

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        if self.kv_checksum and spec.buffer.device.type != "cpu":
            raise ValueError(f"--kv-checksum needs the KV pool in host memory (the hash reads it on the CPU), "
                             f"this one is on {spec.buffer.device}")
        pool = register_pool(self.transport, spec, self._context_slots)   # ValueError: cannot be moved
        self.layout, self.kv_region, self.codec, self._landing = pool.layout, pool.region, pool.codec, pool.context
        self.kv_regions, self.shards = pool.regions, pool.shards
        self.sharding = ShardingScheme(tp_size=pool.shards.scheme.tp_size)
        self.groups = spec.groups
        self.placements = pool.placements   # D16 (the fabric's progress thread serves the landings)
        self.fence_region = self.transport.register(self._fence_buf)

    def rotate_keys(self) -> tuple[MemoryRegion, ...]:
        """Register the KV pool (every rank, on its rail), the context landing area and the fence
        buffer again, under new memory keys; tickets and fences from now on name the new
        registrations. Returns the old ones, still registered: the caller closes them
        (`TransferEngine.deregister`) once nothing may be sent them (kv_messenger.decode.rotation's key
        rotation). Call on the engine thread (where `prepare` runs), so a ticket names one
        generation's regions. FabricError if a registration fails (the old ones stay in use)."""
        assert self._landing is not None and self.fence_region is not None
        new: list[MemoryRegion] = []
        try:
            for r in (*self.kv_regions, self._landing.region):
                new.append(self.transport.register(address=r.address, length=r.length, rail=r.rail))
            new.append(self.transport.register(self._fence_buf))
        except BaseException:
            for r in new:
                self.transport.deregister(r)
            raise
        old = (*self.kv_regions, self._landing.region, self.fence_region)
        n = len(self.kv_regions)
        self.kv_regions, self.kv_region = tuple(new[:n]), new[0]
        self._landing = dataclasses.replace(self._landing, region=new[n])
        self.fence_region = new[n + 1]
        return old

    def current_key(self, ticket: TransferTicket) -> bool:
        """Whether `ticket` names the pool's current registration (not one `rotate_keys` replaced)."""
        return ticket.kv == self.kv_regions[0].descriptor

    def kv_events(self) -> Iterator[KvEvent]:
        """Engine thread: the owner's completions (ReceiverEvents.completions)."""
        return self.events.completions()

    def on_kv_wait(self, wait: KvWait) -> None:
        try:
            ticket = self.prepare(wait.request_id, len(wait.prompt_token_ids), list(wait.block_ids), prefill_tp=None,
                                  tables=wait.tables)
        except (ValueError, RuntimeError) as e:
            self.events.ticket_refused(wait.request_id, f"cannot receive KV: {e}")
            return
        self.events.ticket_ready(ticket, wait.prompt_token_ids[:-1])

    def _new_tag(self) -> int:
        """Under the lock: a tag no live transfer, quarantine or fence holds (never 0)."""
        tag = next(self._tags) % (IMM_TAG_MAX + 1)
        while tag in self._tags_in_use or tag == 0:
            tag = next(self._tags) % (IMM_TAG_MAX + 1)
        self._tags_in_use.add(tag)
        return tag

    def prepare(self, request_id: str, num_prompt_tokens: int, block_ids: list[int],
                prefill_tp: int | None = 1, tables: tuple[tuple[int, ...], ...] = ()) -> TransferTicket:
        """A ticket for the request's next attempt, addressed to a prefill node of TP size
        `prefill_tp` (None: unaddressed, see `address`). `tables`: every attention group's pages
        (KvWait.tables), needed for a hybrid model; `block_ids` are the "full" group's."""
        n_prefill = num_prompt_tokens - 1
        n_pages = num_prompt_pages(n_prefill, self.layout.page_size) if n_prefill > 0 else 0
        if n_prefill < 1 or len(block_ids) < n_pages:
            raise ValueError(f"request {request_id}: {len(block_ids)} pages for {n_prefill} prefill tokens")
        groups = self._group_targets(request_id, n_prefill, n_pages, tables)
        with self._lock:
            if request_id in self._by_request:
                raise ValueError(f"request {request_id!r} is already waiting for KV")
            if not self._free_slots:
                raise RuntimeError("no free context slot: too many requests waiting for KV")
            attempt = self._attempts.get(request_id, -1) + 1
            self._attempts[request_id] = attempt
            self._attempts.move_to_end(request_id)
            while len(self._attempts) > REMEMBERED_ATTEMPTS:
                self._attempts.popitem(last=False)
            tag = self._new_tag()
            slot = self._free_slots.pop()
            wait = _Wait(tag, slot, attempt, tuple(block_ids[:n_pages]), position=n_prefill - 1)
            self._by_request[request_id] = wait
        ticket = TransferTicket(
            request_id=request_id,
            kv=self.kv_regions[0].descriptor,
            layout=self.layout,
            dst_pages=tuple(block_ids[:n_pages]),
            context=self._landing.region.descriptor,
            context_offset=self.codec.slot_offset(slot),
            imm_tag=tag,
            expected_writes=0,
            num_prefill_tokens=n_prefill,
            sharding=self.sharding,
            attempt=attempt,
            kv_checksum=self.kv_checksum,
            kv_ranks=tuple(r.descriptor for r in self.kv_regions) if len(self.kv_regions) > 1 else (),
            groups=groups,
        )
        with self._lock:
            self._by_request[request_id] = dataclasses.replace(
                wait, layer_pages=tuple(d for _, d in ticket.layer_pages()))
        return ticket if prefill_tp is None else self.address(ticket, prefill_tp)

    def _group_targets(self, request_id: str, n_prefill: int, n_pages: int,
                       tables: tuple[tuple[int, ...], ...]) -> tuple[GroupTarget, ...]:
        """The non-full attention groups' destination pages (a sliding group's window only)."""
        out = []
        for i, g in enumerate(self.groups):
            if g.name == "full":
                continue
            if len(tables) != len(self.groups) or len(tables[i]) < n_pages:
                raise ValueError(f"request {request_id}: the {g.name!r} group's pages are missing "
                                 f"({len(tables)} tables for groups {[x.name for x in self.groups]})")
            first = window_first_page(n_prefill, g.sliding_window, self.layout.page_size)
            out.append(GroupTarget(g.name, tuple(g.layers), g.sliding_window, first, tuple(tables[i][first:n_pages])))
        return tuple(out)

    def address(self, ticket: TransferTicket, prefill_tp: int, prefill_engine: str | None = None) -> TransferTicket:
        """Address an unaddressed ticket to a prefill node of tensor-parallel size `prefill_tp`: its
        expected count is the shard plan's from that split into ours, and the ImmCounter waits for
        it from now on, counting only writes of fabric engine `prefill_engine` where writers are
        named (None: anyone's; see the module docstring). Call before the ticket leaves this node.
        ValueError when the split cannot be planned (naming both sides) or the attempt no longer
        waits here (it was abandoned)."""
        rid = ticket.request_id
        src = KvShards.of(self.layout, prefill_tp)   # the prefill node's split, by the engine's rule
        plan = plan_transfer(src, self.shards, random.Random(0))   # counts never depend on the draw
        count = plan.expected_writes(len(ticket.dst_pages), layer_pages=[len(d) for _, d in ticket.layer_pages()]).total
        with self._lock:
            entry = self._by_request.get(rid)
            if entry is None or entry.tag != ticket.imm_tag:
                raise ValueError(f"request {rid!r} attempt {ticket.attempt} no longer waits for KV here")
            if entry.plan is not None:
                raise ValueError(f"request {rid!r} attempt {ticket.attempt} is already addressed")
            self._by_request[rid] = dataclasses.replace(entry, plan=plan, writer=prefill_engine)
        self.transport.imm_counter.expect(ticket.imm_tag, count,
                                          lambda tag, rid=rid: self.events.kv_landed_tag(rid, tag),
                                          writer=prefill_engine)
        return dataclasses.replace(ticket, expected_writes=count)

    def context(self, request_id: str) -> Context:
        """The checked context record of the request's current attempt (module docstring):
        ContextRecordError (a ValueError) naming the field that differs, KeyError if the request
        waits for nothing here."""
        with self._lock:
            entry = self._by_request[request_id]
        ident = TransferIdentity(request_id, self.transport.engine_id, entry.attempt, entry.tag)
        return self.codec.decode(self._landing, entry.slot, ExpectedRecord(ident, entry.position))

    def verify(self, request_id: str, tag: int, kv_checksums: bytes, count: int) -> ChecksumResult:
        """S7: compare the sender's checksums (PrefillResponse.kv_checksums / num_kv_checksums) with
        the runs that landed for the attempt with `tag`; call once its write count completed (no
        write of it can land any more) and before its pages are used. KeyError if that attempt
        no longer waits here, ValueError for a malformed or mis-sized checksum field."""
        with self._lock:
            entry = self._by_request.get(request_id)
            if entry is None or entry.tag != tag:
                raise KeyError(f"request {request_id!r} has no attempt with tag {tag} waiting here")
        if entry.plan is None:
            raise KeyError(f"request {request_id!r} attempt {entry.attempt} was never addressed to a prefill node")
        plan = entry.plan
        corrupt = self._faults.corrupts_kv(request_id, entry.attempt)
        e = plan.entries_by_layer([(d, d) for d in entry.layer_pages])   # canonical order; never depends on the draw
        expected = checksum.unpack(kv_checksums, count)
        if expected.size != e.lengths.size + 1:
            raise ValueError(f"request {request_id}: {expected.size} checksums for {e.lengths.size} KV runs "
                             "and the context record")
        if corrupt:   # TEST ONLY (FaultPlan.corrupt_kv): the top byte of the first element of the first run
            region = self.kv_regions[int(e.dst_ranks[0])]
            at = region.address + int(e.dst_offsets[0]) + checksum_elem_top(self.layout)
            ctypes.c_uint8.from_address(at).value ^= 0x40
            logger.warning("TEST ONLY (%s): request %s: flipped bit 6 of byte %d of %s before the checksum "
                           "verification", TEST_CORRUPT_ENV, request_id, checksum_elem_top(self.layout),
                           plan.describe_entry(0, entry.pages, entry.layer_pages))
        kv = np.zeros(e.lengths.size, dtype=np.uint32)
        for rank, region in enumerate(self.kv_regions):
            sel = np.flatnonzero(e.dst_ranks == rank)
            if sel.size:
                kv[sel] = checksum.crc32c_runs_at(region.address, region.length, e.dst_offsets[sel], e.lengths[sel])
        ctx = self._landing.region
        off = np.asarray([self.codec.slot_offset(entry.slot)], dtype=np.uint64)
        ctx_crc = checksum.crc32c_runs_at(ctx.address, ctx.length, off,
                                          np.asarray([self.codec.slot_nbytes], dtype=np.uint64))
        actual = np.concatenate([kv, ctx_crc])
        mismatch = checksum.first_mismatch(expected, actual,
                                           lambda i: plan.describe_entry(i, entry.pages, entry.layer_pages))
        return ChecksumResult(request_id, int(actual.size), mismatch)

    def landed(self, request_id: str) -> int:
        """Writes counted so far for a request (progress, diagnostics)."""
        with self._lock:
            entry = self._by_request.get(request_id)
        return self.transport.imm_counter.landed(entry.tag) if entry else 0

    def tag_of(self, request_id: str) -> int | None:
        """The tag of the request's current attempt, None if it waits for nothing."""
        with self._lock:
            entry = self._by_request.get(request_id)
        return entry.tag if entry else None

    def finish(self, request_id: str) -> None:
        """The request's KV is in use by the engine (or it ended with nothing in flight): tombstone
        its tag and free its slot."""
        with self._lock:
            entry = self._by_request.pop(request_id, None)
            if entry is None:
                return
            self._free_slots.append(entry.slot)
        self._tombstone(entry.tag)

    def abandon(self, request_id: str) -> None:
        """Cancel the expected count; call only once no write for the request can land any more."""
        self.finish(request_id)

    def quarantine(self, request_id: str) -> int | None:
        """A write of the request's transfer may still land: its count is cancelled, its slot kept,
        and the request leaves (a new attempt may prepare). Returns the tag (for
        `release_quarantined`), None if the request waited for nothing."""
        with self._lock:
            entry = self._by_request.pop(request_id, None)
            if entry is None:
                return None
            self._quarantined[entry.tag] = entry.slot
            self._writers[entry.tag] = entry.writer
        self.transport.imm_counter.cancel(entry.tag)   # later writes: dropped, counted as quarantined
        return entry.tag

    def release_quarantined(self, tag: int) -> None:
        """The prefill side provably stopped writing for the quarantined `tag`: free its slot."""
        with self._lock:
            slot = self._quarantined.pop(tag, None)
            if slot is None:
                return
            self._writers.pop(tag, None)
            self._free_slots.append(slot)
        self._tombstone(tag)

    def expect_fence(self, on_landed: Callable[[], None], writer: str | None = None) -> tuple[int, RemoteDescriptor]:
        """A fresh tag for one fence write into the fence buffer; `on_landed()` runs (progress
        thread) when it lands, written by fabric engine `writer` where writers are named (None:
        anyone). Call `retire_fence(tag)` once it is no longer waited for."""
        with self._lock:
            tag = self._new_tag()
            self._fences.add(tag)
            self._writers[tag] = writer
        self.transport.imm_counter.expect(tag, 1, lambda _tag: on_landed(), writer=writer)
        return tag, self.fence_region.descriptor

    def retire_fence(self, tag: int) -> None:
        with self._lock:
            if tag not in self._fences:
                return
            self._fences.discard(tag)
            self._retired_fences[tag] = self._writers.pop(tag, None)
            while len(self._retired_fences) > REMEMBERED_ATTEMPTS:
                self._retired_fences.popitem(last=False)
        self._tombstone(tag)

    def _tombstone(self, tag: int) -> None:
        self.transport.imm_counter.cancel(tag)   # a later write is dropped and reported as an orphan
        with self._lock:
            self._tags_in_use.discard(tag)

    def _orphan(self, tag: int, count: int, writer: str | None = None) -> None:
        """Progress thread: `count` writes landed for `tag` with no expectation waiting; `writer`:
        the engine that wrote them where the transport names writers (fabric.imm), else None."""
        with self._lock:
            if tag in self._unaddressed_tags():
                return   # landed before `address` set its count: the ImmCounter keeps it until then
            held_by = None
            if tag in self._quarantined:
                held_by = "quarantine"
                expected = self._writers.get(tag)
            elif tag in self._fences or tag in self._retired_fences:
                held_by = "fence"
                expected = self._writers.get(tag) if tag in self._fences else self._retired_fences[tag]
            if held_by is not None and (writer is None or expected is None or writer == expected):
                if held_by == "quarantine":
                    self.quarantined_writes += count   # into pages nothing reads: harmless
                return   # a fence that landed after its wait ended: into the fence buffer, harmless
            self.stale_writes += count
        if held_by is not None:
            logger.error("%d KV writes landed for tag %d (a %s expecting prefill engine %s) from engine %s (stale)",
                         count, tag, held_by, expected, writer)
        else:
            logger.error("%d KV writes landed for tag %d, which no transfer holds (stale%s)", count, tag,
                         f"; written by engine {writer}" if writer is not None else "")
            self.transport.imm_counter.cancel(tag)   # tombstoned: an unknown tag is not kept forever
        self.events.kv_stale_write(tag, count)

    def _foreign(self, tag: int, count: int, writer: str, expected: str) -> None:
        """Progress thread (or address()'s caller, for writes kept before it): `count` writes of the
        attempt or fence with `tag` came from engine `writer`, not from `expected`, the prefill
        engine it was dispatched to. They never count toward it: stale."""
        with self._lock:
            self.stale_writes += count
        logger.error("%d KV writes for tag %d came from engine %s, not from prefill engine %s that the transfer "
                     "was dispatched to (stale: not counted)", count, tag, writer, expected)
        self.events.kv_stale_write(tag, count)

    def _unaddressed_tags(self) -> set[int]:
        """Under the lock: tags of waiting attempts whose count is not set yet."""
        return {w.tag for w in self._by_request.values() if w.plan is None}

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._by_request)

    @property
    def num_quarantined(self) -> int:
        with self._lock:
            return len(self._quarantined)

    @property
    def num_tags_in_use(self) -> int:
        with self._lock:
            return len(self._tags_in_use)

    @property
    def num_slots_in_use(self) -> int:
        with self._lock:
            return self._context_slots - len(self._free_slots)
