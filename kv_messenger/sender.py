"""Prefill side of the KV messenger: pushes each finished layer's pages to the decode node.

Primitives (D6-D8, D11-D13):
- `register_kv_cache(spec)` (pdserve.engine.kv_connector.PrefillConnector): the engine hands over
  its pool once; the sender registers it with the transport and refuses models it cannot move.
- `add(ticket, key)`: a prefill request will send its KV as the TransferTicket says (pages, tag,
  context slot); returns a future. Transfers are keyed by `key`, the prefill engine's request id
  for the transfer (ticket.TransferKey.engine_request_id: unique per decode node, request and
  attempt, D20), never by the decode node's request id alone.
- `fence(dst, tag)`: one small write carrying `tag` into `dst`, posted after the writes of a
  transfer completed locally, on the same connection: the decode side counts it to know that
  every earlier write of that connection has landed (FI_ORDER_WAW; see AbortPrefill). Refused
  (FabricError) for a decode engine whose tickets name more than one endpoint (its ranks on
  several rails, D16): the transfer's writes then travelled on several connections, and a fence
  on one proves nothing of the others (with several rails here, TransferEngine.writes_ordered is
  False and no fence is asked for at all).
- tensor parallelism (D14, D15): the engine hands over every rank's pool (KvCacheSpec.shards, mapped
  in this process); each is registered with the one transport, and every transfer follows its shard
  plan (`shard_plan.plan_transfer` of this node's split and the ticket's decode split, the source
  replica of each run drawn at random per request): per layer, one `TransferEngine.write` call per (prefill
  rank, decode rank) pair of the plan, from that rank's registration into that decode rank's
  descriptor. TP 1 on both sides is the one-run plan: every page of a layer and side one entry.
- rails (D16, kv_messenger.pool): each rank's pool is registered on the rail of the NIC nearest
  its memory, so a (prefill rank, decode rank) pair's writes post from the prefill rank's rail to
  the endpoint the decode rank's descriptor names (its own rail there); the context and fences
  use rail 0. One NIC or none: one rail, as before.
- hybrid models (E8, Gemma 3): every attention group travels; a layer's pages are its group's
  (the tables `on_schedule` hands over), and a sliding layer sends only the request pages from
  the ticket's `first_page` on (its window at the decode side's first step); the engine keeps
  every page of a prefill-only request until its transfer ends.
- engine events: `on_schedule(pass, block_ids)` records which chunks the coming forward pass
  runs, before it runs (a request's first chunk may start at s > 0 after a prefix-cache hit:
  pages [0, s // P) already hold its KV and ride along with that chunk, at every layer);
  `on_layer_done(layer)` bumps the per-layer counter after each layer's attention output
  projection; `on_prefill_done(done)` hands over the context (D12), encoded as the versioned
  record of kv_messenger.context (D19) naming the ticket's transfer (request id, the decode
  engine, attempt, imm tag) and the position it is of (num_prefill_tokens - 1). It goes once per
  transfer, to `ticket.context` (the decode leader's landing area under TP), whatever the TP sizes.
- TEST-ONLY: a sender built with a fault plan (pdserve.engine.faults, its `bad_context`) damages
  the context records of the attempts it names, after encoding and before they are hashed (S7) and
  posted (kv_messenger.context_staging, which owns the staging slots and the records' encoding).
  Without a plan (always, outside those tests): no effect.
- a dedicated messenger thread waits on the counter (a condition variable: no busy spin that
  would steal the forward pass's core) and, as soon as layer L is done, posts the writes of the
  pages each chunk completed in layer L: one entry per page and side (K, V), all tagged with the
  request's tag; the fabric merges entries contiguous at both ends into one write whose immediate
  data says how many pages it holds, so the decode side counts pages (D10, plan.py).
- when every write of a request has completed locally, its future resolves with a
  `TransferResult` (the owner then frees the source pages, D11); on a write error the future
  fails, after all outstanding writes have reported (so nothing still reads freed pages).
- `abort(request_id)`: stop posting; resolves once no write of the request is outstanding.
- S7 (`TransferTicket.kv_checksum`): once a layer's writes of a chunk are posted, the messenger
  thread hashes (CRC32C, kv_messenger.checksum) exactly the runs it posted, in the registered KV
  region of their rank (the source pages are final then: the layer is computed, and the request
  holds them until its future resolves), and the context record before it is posted; the values,
  in the plan's canonical order (`ShardPlan.entries`: layer, run, K/V, page; then the context),
  come back in TransferResult.kv_checksums.

Threads: engine events run on the engine thread and only record and notify; fabric callbacks run
on the fabric progress thread; everything that posts runs on the messenger thread. A transfer's
future resolves on the messenger or progress thread (or the caller's, for `abort` and a transfer
failed by an engine event), under the sender's lock: its done callbacks must only hand the
release of the source pages to the engine thread, never wait.

Blocking waits and their bounds:
- the messenger thread, idle: the lock's condition, no timeout by design (it waits for work: woken
  by every engine event, register_kv_cache and `close`). A pass's next layer: the engine's forward
  pass; a pass whose forward failed (the step raised) is ended at the next `on_schedule`
  (`_end_failed_pass`): its transfers fail with PassFailedError, and later passes never wait
  behind it.
- the messenger thread, posting: TransferEngine.write never waits for a completion; the first write to a
  remote endpoint not yet handshaken (a decode rank on another endpoint) waits for the handshake,
  at most 5 s (fabric.peers), then that transfer fails with FabricError. The hashes (S7) are CPU
  work, no wait. A post that raises anything else (a bug) fails its own transfer with PostError;
  the thread goes on with the others.
- write completions: never awaited here (callbacks on the progress thread); a transfer's future,
  and an `abort`ed one's, resolves once each posted write completed or failed, which the owner's
  FabricConfig.peer_timeout_s bounds (a peer with writes out and no completion fails).
- `fence`: posted on the caller's thread and not awaited; the same handshake bound.
- the lock, from the engine thread, the loop and the progress thread: held for bookkeeping only,
  never across a post, a hash, a registration or a wait (the condition's wait releases it).
- `close`: joins the messenger thread for at most CLOSE_JOIN_S (logged if it still runs: a daemon
  thread, left to the process's exit).

Every write (KV runs, context records, fences) goes through one call of the transport's write path,
`KvSender._write`. The per-transfer and per-pass bookkeeping is kv_messenger.sender_state; the
prefill node's transfer registry over this sender is kv_messenger.prefill_transfers
(docs/transfer-prefill-side.md).
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from fabric import FabricError, MemoryRegion, PageWrites, RemoteDescriptor, TransferEngine
from kv_messenger import checksum
from kv_messenger.completions import EngineInbox
from kv_messenger.context import (
    ContextCodec,
    ContextEncodeError,
    SlotPool,
    StagingFullError,
)
from kv_messenger.context_staging import ContextStaging, checked_damages
from kv_messenger.placement import ShardPlacement, pin_thread_to
from kv_messenger.plan import KvLayout, completed_pages
from kv_messenger.pool import Place, register_pool
from kv_messenger.sender_state import (  # PassFailedError, PostError, TransferResult: importable from here too
    ForwardPass,
    OutgoingTransfer,
    PassFailedError,
    PassItem,
    PostError,
    TransferResult,
)
from kv_messenger.shard_plan import KvShards, ShardPlan, plan_transfer
from kv_messenger.ticket import TransferTicket
from pdserve.engine.faults import (
    BAD_CONTEXT_ENV,
    NO_FAULTS,
    BadContext,
    FaultPlan,
    parse_bad_contexts as _parse_bad_contexts,
)
from pdserve.engine.kv_connector import KvCacheSpec, KvEvent, KvReleased, PrefillConnector, PrefillDone
from pdserve.engine.scheduler.output import SchedulerOutput

__all__ = ["CLOSE_JOIN_S", "FENCE_BYTES", "STAGING_SLOTS", "TEST_BAD_CONTEXT_ENV", "KvSender", "PassFailedError",
           "PostError", "TransferResult", "parse_bad_contexts"]

logger = logging.getLogger(__name__)

STAGING_SLOTS = 256     # context records that may wait for their write at once
FENCE_BYTES = 8         # one fence write (AbortPrefill's delivery fence)
CLOSE_JOIN_S = 5.0      # close(): how long to wait for the messenger thread to stop
MULTI_ENDPOINT_ENGINES = 4096   # decode engines remembered as taking KV on several endpoints (fence refused)
TEST_BAD_CONTEXT_ENV = BAD_CONTEXT_ENV   # deprecated alias: pdserve.engine.faults.BAD_CONTEXT_ENV


def parse_bad_contexts(raw: str) -> tuple[BadContext, ...]:
    """Deprecated: FaultPlan.from_env parses the variable; this checks KIND against DAMAGES too."""
    return checked_damages(_parse_bad_contexts(raw))


class KvSender(PrefillConnector):
    """The prefill side's connector: give it to the engine (`LLMEngine(config, kv_connector=sender)`),
    then `add` a ticket per request before the engine sees the request."""

    def __init__(self, transport: TransferEngine, staging_slots: int = STAGING_SLOTS, *,
                 place: Place | None = None, faults: FaultPlan = NO_FAULTS) -> None:
        """`place(spec, provider)`: where each rank's pool is (kv_messenger.pool; default: this
        host's /sys); `faults`: the test-only fault plan (its bad_context), none by default."""
        self.transport = transport
        self._staging_slots = staging_slots
        self._place = place
        # decode engines whose tickets named several endpoints (the last MULTI_ENDPOINT_ENGINES)
        self._multi_endpoint: OrderedDict[str, None] = OrderedDict()
        self.kv_region: MemoryRegion | None = None   # set by register_kv_cache: rank 0's pool
        self.kv_regions: tuple[MemoryRegion, ...] = ()   # every TP rank's pool, rank order
        self.layout: KvLayout | None = None              # kv_heads: the model's total
        self.groups: tuple = ()                          # the engine's attention groups (AttentionGroupSpec)
        self._layer_group: list[int] = []                # layer -> index in groups
        self.shards: KvShards | None = None              # this node's split of it
        self._rng = random.Random(random.SystemRandom().getrandbits(64))   # source replica per request
        self.placements: tuple[ShardPlacement, ...] = ()   # D16, set by register_kv_cache
        self._pin: ShardPlacement | None = None            # taken once by the messenger thread
        self.codec: ContextCodec | None = None          # set by register_kv_cache
        # the releases of the engine's held source pages (KvReleased), taken by the engine's kv_events;
        # the node binds it to its engine thread
        self.inbox = EngineInbox()
        self.staging_slots = SlotPool(staging_slots)   # full: that prefill fails alone (S8)
        self.context_staging = ContextStaging(self.staging_slots, faults)   # ValueError: a bad fault plan
        self._lock = threading.Condition()
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._passes: deque[ForwardPass] = deque()
        self._current: ForwardPass | None = None  # the pass the engine is running now, if it sends anything
        self._contexts: deque[tuple[OutgoingTransfer, int]] = deque()
        self._stop = False
        self._fence_buf = bytearray(FENCE_BYTES)      # registered with the pool: a fence's source
        self._fence_region: MemoryRegion | None = None
        self._host_pool = True
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        # ValueError: cannot be moved
        pool = register_pool(self.transport, spec, self._staging_slots, place=self._place)
        self.layout, self.kv_region, self.codec = pool.layout, pool.region, pool.codec
        self.context_staging.attach(pool.codec, pool.context)
        self.kv_regions, self.shards = pool.regions, pool.shards
        self.placements = pool.placements
        with self._lock:   # D16: the messenger thread moves to the CPUs nearest rank 0's pool
            self._pin = pool.placements[0] if pool.placements else None
            self._lock.notify()
        self._fence_region = self.transport.register(self._fence_buf)
        self._host_pool = spec.buffer.device.type == "cpu"   # checksums read the pool's memory directly
        self.groups = spec.groups
        self._layer_group = [0] * spec.shape.num_layers       # layer -> index in spec.groups
        for i, g in enumerate(spec.groups):
            for layer in g.layers:
                self._layer_group[layer] = i

    # --- requests ------------------------------------------------------------------------------

    def plan(self, target: TransferTicket) -> ShardPlan:
        """The shard plan of a transfer from this node into `target`'s decode split, with a fresh
        replica draw; ValueError naming both sides when the layouts cannot be planned."""
        if self.shards is None:
            raise RuntimeError("KvSender.plan before the engine registered its KV cache")
        with self._lock:   # the rng is shared by the loop's validate and add
            return plan_transfer(self.shards, target.decode_shards, self._rng)

    def expected_writes(self, target: TransferTicket) -> int:
        """Entries this node will post for `target` (what the decode side must count); ValueError
        when its attention groups are not ours."""
        self._check_groups(target)
        plan = self.plan(target)
        return plan.expected_writes(len(target.dst_pages), layer_pages=[len(d) for _, d in target.layer_pages()]).total

    def add(self, target: TransferTicket, key: str | None = None) -> concurrent.futures.Future:
        """Send a request's KV as `target` says, under `key` (the engine's request id for it;
        default target.request_id); the future resolves with a TransferResult once no write of it
        is in flight (or fails: FabricError, CancelledError after `abort`)."""
        if self.layout is None:
            raise RuntimeError("KvSender.add before the engine registered its KV cache")
        target.check_fits(self.layout)
        key = target.request_id if key is None else key
        self._check_groups(target)
        plan = self.plan(target)
        targets = target.layer_pages()
        want = plan.expected_writes(len(target.dst_pages), layer_pages=[len(d) for _, d in targets]).total
        if target.expected_writes != want:
            raise ValueError(f"request {target.request_id}: the decode side expects {target.expected_writes} "
                             f"writes but the shard plan from {self.shards.describe()} into {plan.dst.describe()} "
                             f"posts {want}")
        sums = None
        if target.kv_checksum:
            if not self._host_pool:
                raise ValueError(f"request {target.request_id}: kv_checksum asked for, but this node's KV pool "
                                 "is not in host memory (the hash reads it on the CPU)")
            sums = [np.zeros((len(plan.runs), 2, len(d)), dtype=np.uint32) for _, d in targets]
        fut: concurrent.futures.Future = concurrent.futures.Future()
        endpoints = {target.rank_kv(r).peer.address for r in range(target.sharding.tp_size)}
        with self._lock:
            if key in self._transfers:
                raise ValueError(f"transfer {key!r} already exists")
            if len(endpoints | {target.context.peer.address}) > 1:   # D16: its ranks on several rails
                self._multi_endpoint[target.context.peer.engine_id] = None
                self._multi_endpoint.move_to_end(target.context.peer.engine_id)
                while len(self._multi_endpoint) > MULTI_ENDPOINT_ENGINES:
                    self._multi_endpoint.popitem(last=False)
            self._transfers[key] = OutgoingTransfer(target, fut, plan, key=key, checksums=sums, layer_targets=targets)
        return fut

    def _check_groups(self, target: TransferTicket) -> None:
        """ValueError naming both sides unless the ticket lists exactly our non-full attention
        groups (names, layers, windows): the layers' KV then lands in the right pages."""
        ours = [(g.name, tuple(g.layers), g.sliding_window) for g in self.groups if g.name != "full"]
        theirs = [(g.name, g.layers, g.sliding_window) for g in target.groups]
        if ours != theirs:
            raise ValueError(f"request {target.request_id}: the decode side's attention groups beside 'full' are "
                             f"{theirs}, this node's {ours} (name, layers, window)")

    def fence(self, dst: RemoteDescriptor, tag: int) -> concurrent.futures.Future:
        """Post one FENCE_BYTES write carrying `tag` into `dst` (the decode node's fence buffer);
        the future resolves with None once it completed locally, or fails with FabricError."""
        if self._fence_region is None:
            raise RuntimeError("KvSender.fence before the engine registered its KV cache")
        with self._lock:
            several = dst.peer.engine_id in self._multi_endpoint
        if several:
            raise FabricError(errno.EOPNOTSUPP, f"fence into engine {dst.peer.engine_id[:8]}: its KV ranks sit on "
                                                "several endpoints (rails), so a transfer's writes used several "
                                                "connections and a fence on one proves nothing of the others")
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def failed(err: FabricError) -> None:
            fut.set_exception(err)

        one = np.zeros(1, dtype=np.uint64)
        try:
            self._write(self._fence_region, one, dst, one, np.full(1, FENCE_BYTES, dtype=np.uint64), tag,
                        lambda: fut.set_result(None), failed)
        except ValueError as e:
            raise FabricError(22, f"fence write: {e}") from e
        return fut

    def abort(self, request_id: str) -> bool:
        """Stop posting for a request; True if it was known. Its future resolves when nothing is in flight."""
        with self._lock:
            t = self._transfers.get(request_id)
            if t is None:
                return False
            t.aborted = True
            self._maybe_finish(t)
            return True

    def outstanding_requests(self) -> int:
        with self._lock:
            return len(self._transfers)

    # --- engine events (engine thread) --------------------------------------------------------

    def on_schedule(self, sched: SchedulerOutput, block_ids: Mapping[str, tuple[int, ...]]) -> None:
        items = []
        with self._lock:
            self._end_failed_pass()
            for c in sched.chunks:
                t = self._transfers.get(c.request_id)
                if t is None or t.aborted:
                    continue
                final = t.target.num_prefill_tokens
                done = completed_pages(c.start, c.end, final, self.layout.page_size).stop
                pages = range(t.pages_claimed, max(t.pages_claimed, done))
                t.pages_claimed = pages.stop
                if not t.src_tables or len(t.src_tables[0]) < pages.stop:
                    t.src_tables = [list(table) for table in block_ids[c.request_id]]
                items.append(PassItem(t, pages, c.end == final))
            self._current = ForwardPass(items) if items else None
            if self._current is not None:
                self._passes.append(self._current)

    def _end_failed_pass(self) -> None:
        """Under the lock, before a new pass: the engine runs one pass at a time, so the previous one
        is over; short of its last layer, its forward failed (the step raised) and its later layers
        will never be reported. Without this its posts would wait for them for ever, and every later
        pass behind it (the messenger posts in pass order) with them, while the messenger thread spun
        on work it could not take. Nothing more of it is posted: its transfers fail (after their posted
        writes settle)."""
        p = self._current
        if p is None or p.layers_done >= self.layout.num_layers:
            return
        p.cut_short = True
        self._current = None
        logger.warning("a forward pass failed after %d of %d layers: failing its %d transfers",
                       p.layers_done, self.layout.num_layers, len(p.items))
        for it in p.items:
            t = it.transfer
            if not t.aborted and t.error is None:
                t.error = PassFailedError(f"transfer {t.key}: the forward pass of its chunk (request pages "
                                          f"{it.pages.start}..{it.pages.stop}) failed after {p.layers_done} "
                                          f"of {self.layout.num_layers} layers")
                self._maybe_finish(t)
        self._lock.notify()   # the messenger drops the pass

    def on_layer_done(self, layer: int) -> None:
        with self._lock:
            p = self._current
            if p is not None:
                p.layers_done = layer + 1
                if p.layers_done == self.layout.num_layers:
                    now = time.monotonic()
                    for it in p.items:
                        if it.last_chunk:
                            it.transfer.last_layer = now
                self._lock.notify()

    def kv_events(self) -> Iterator[KvEvent]:
        """Engine thread: the releases posted since the last call (`release_pages`)."""
        return self.inbox.drain()

    def post_release(self, request_id: str) -> None:
        """Any thread: the engine frees the request's pages when it next takes its events (its
        next step or idle tick); EngineDeadError if its thread no longer serves."""
        self.inbox.post(lambda: (KvReleased(request_id=request_id),))

    async def release_pages(self, request_id: str) -> None:
        """On a loop: nothing of the request's transfer reads its pages any more: the engine frees
        them (held since it ended; one still running is not held when it ends). Returns once the
        engine applied it; EngineDeadError if its thread stops first (kv_messenger.completions)."""
        await self.inbox.applied(lambda: (KvReleased(request_id=request_id),))

    def on_prefill_done(self, done: PrefillDone) -> None:
        with self._lock:
            t = self._transfers.get(done.request_id)
            if t is None or t.aborted:
                return
            try:
                slot = self.context_staging.take(t.key)
            except StagingFullError as e:   # this transfer fails once its posted writes settled
                logger.warning("%s", e)
                t.error = e
                self._maybe_finish(t)
                return
        try:
            self.context_staging.encode(slot, t.target, done)
        except ValueError as e:   # a hidden state or logits of the wrong shape: this transfer fails alone
            logger.error("transfer %s: context record not encoded: %s", t.key, e)
            with self._lock:
                self.context_staging.give(slot)
                t.error = ContextEncodeError(f"transfer {t.key}: context record not encoded: {e}")
                self._maybe_finish(t)
            return
        self.context_staging.test_damage(slot, t.target)
        with self._lock:
            self._contexts.append((t, slot))
            self._lock.notify()

    # --- messenger thread ----------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(CLOSE_JOIN_S)
        if self._thread.is_alive():   # a post still in progress (a handshake); a daemon, it ends with the process
            logger.warning("kv sender: messenger thread still running %.0f s after close (CLOSE_JOIN_S)", CLOSE_JOIN_S)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._has_work() and self._pin is None:
                    self._lock.wait()
                if self._stop:
                    return
                pin, self._pin = self._pin, None
                work = self._take_work()
            if pin is not None:
                pin_thread_to(pin)
            for t, fn in work:
                try:
                    fn()
                except Exception as exc:   # a bug in one post fails its transfer, never the messenger thread
                    logger.exception("transfer %s: posting raised; failing it", t.key)
                    with self._lock:
                        if t.error is None and not t.aborted:
                            t.error = PostError(f"transfer {t.key}: posting its writes raised {exc!r}")
                        self._maybe_finish(t)   # at once, or once its posted writes settle

    def _has_work(self) -> bool:
        return bool(self._contexts) or any(p.layers_done > p.layers_posted for p in self._passes)

    def _take_work(self) -> list[tuple[OutgoingTransfer, Callable[[], None]]]:
        """Under the lock: collect the posts that are ready, in pass and layer order, each with the
        transfer it posts for."""
        work: list[tuple[OutgoingTransfer, Callable[[], None]]] = []
        while self._passes:
            p = self._passes[0]
            for layer in range(p.layers_posted, p.layers_done):
                for it in p.items:
                    if it.pages and not it.transfer.aborted and it.transfer.error is None:
                        work.append((it.transfer, lambda it=it, layer=layer: self._post_layer(it, layer)))
            p.layers_posted = p.layers_done
            if p.layers_posted < self.layout.num_layers and not p.cut_short:
                break
            self._passes.popleft()
        while self._contexts:
            t, slot = self._contexts.popleft()
            work.append((t, lambda t=t, slot=slot: self._post_context(t, slot)))
        return work

    def _post_layer(self, it: PassItem, layer: int) -> None:
        """Post layer `layer` of the pages chunk `it` completed: one TransferEngine.write call per (our rank,
        decode rank) pair of the plan, its entries in the plan's canonical order."""
        t = it.transfer
        first, targets = t.layer_targets[layer]
        pages = range(max(it.pages.start, first), it.pages.stop)   # a sliding layer: its window's only
        if not pages:
            return
        table = t.src_tables[self._layer_group[layer]]
        src = np.asarray([table[i] for i in pages], dtype=np.int64)
        dst = np.asarray([targets[i - first] for i in pages], dtype=np.int64)
        e = t.plan.layer_entries(layer, src, dst)   # [runs * 2 * len(pages)] entries, canonical order
        now = time.monotonic()
        t.layer_posts.setdefault(layer, now)
        crc = np.zeros(e.lengths.size, dtype=np.uint32) if t.checksums is not None else None
        for s_rank, d_rank in dict.fromkeys((w.src_rank, w.dst_rank) for w in t.plan.runs):
            sel = np.flatnonzero((e.src_ranks == s_rank) & (e.dst_ranks == d_rank))
            region = self.kv_regions[s_rank]
            src_off, lengths = e.src_offsets[sel], e.lengths[sel]
            self._post(t, src_off, t.target.rank_kv(d_rank), e.dst_offsets[sel], lengths, region)
            if crc is not None:   # exactly the entries just posted, from their rank's pool
                crc[sel] = checksum.crc32c_runs_at(region.address, region.length, src_off, lengths)
        if crc is not None:
            at = slice(pages.start - first, pages.stop - first)
            t.checksums[layer][:, :, at] = crc.reshape(len(t.plan.runs), 2, len(src))

    def _post_context(self, t: OutgoingTransfer, slot: int) -> None:
        off, lengths = self.context_staging.extent(slot)              # [1], [1]
        dst = np.asarray([t.target.context_offset], dtype=np.uint64)  # [1]

        def free_slot() -> None:
            with self._lock:
                self.context_staging.give(slot)

        if t.checksums is not None:   # before the post: the slot is freed once its write completed
            try:
                t.context_crc = self.context_staging.crc(slot)
            except BaseException:
                free_slot()   # never posted: nothing else gives it back
                raise

        self._post(t, off, t.target.context, dst, lengths, self.context_staging.region, after=free_slot)
        with self._lock:
            t.all_posted = True
            self._maybe_finish(t)

    def _post(self, t: OutgoingTransfer, src, dst_desc, dst, lengths, region,
              after: Callable[[], None] | None = None) -> None:
        with self._lock:
            if t.aborted or t.error is not None:
                if after:
                    after()
                return
            t.outstanding += 1
            if not t.first_post:
                t.first_post = time.monotonic()

        def done() -> None:
            if after:
                after()
            with self._lock:
                t.outstanding -= 1
                self._maybe_finish(t)

        def failed(err: FabricError | PostError) -> None:
            if after:
                after()
            with self._lock:
                t.outstanding -= 1
                if t.error is None:
                    t.error = err
                    logger.warning("transfer %s: KV write failed: %s", t.key, err)
                self._maybe_finish(t)

        try:
            self._write(region, src, dst_desc, dst, lengths, t.target.imm_tag, done, failed)
        except (FabricError, ValueError) as err:
            failed(err if isinstance(err, FabricError) else FabricError(22, str(err)))
            return
        except Exception as err:   # a bug below; nothing was posted (the write checks before it posts)
            logger.exception("transfer %s: write_pages raised; failing it", t.key)
            failed(PostError(f"transfer {t.key}: posting its writes raised {err!r}"))
            return
        with self._lock:
            t.posted_writes += len(lengths)
            t.posted_bytes += int(lengths.sum())

    def _write(self, region: MemoryRegion, src: np.ndarray, dst_desc: RemoteDescriptor, dst: np.ndarray,
               lengths: np.ndarray, tag: int, on_done: Callable[[], None],
               on_error: Callable[[FabricError], None]) -> None:
        """The sender's one call into the transport's write path (every KV run, context record and
        fence goes through here): src / dst / lengths [n] byte offsets and lengths, every entry
        tagged `tag` (imm_mode "every"); raises what TransferEngine.write raises, before anything is posted."""
        self.transport.write(PageWrites(region, src, dst_desc, dst, lengths, tag, imm_mode="every"), on_done, on_error)

    def _maybe_finish(self, t: OutgoingTransfer) -> None:
        """Under the lock: resolve the transfer once nothing of it is in flight."""
        if t.outstanding or t.future.done():
            return
        if not (t.all_posted or t.aborted or t.error is not None):
            return
        rid = t.key
        self._transfers.pop(rid, None)
        if t.error is not None:
            t.future.set_exception(t.error)
        elif t.aborted:
            t.future.set_exception(concurrent.futures.CancelledError(f"transfer of {rid} aborted"))
        else:
            if t.posted_writes != t.target.expected_writes:
                logger.error("request %s: posted %d writes but the decode side expects %d",
                             rid, t.posted_writes, t.target.expected_writes)
            t.future.set_result(t.result(self.layout.num_layers, time.monotonic()))
