"""The prefill side of the transfer protocol (S2, S4, S5, D11, D20): every transfer this process
takes on, from its Prefill to its tombstone, and the answer to AbortPrefill. The guarantees
(tombstones, connection epochs, fences, what "confirmed" means) are argued in
docs/transfer-prefill-side.md; the decode side's half in docs/transfer-safety.md.

Owns `PrefillTransfers`, built by `PrefillTransfers.open` with the transport (TransferEngine) and
the KvSender it feeds (the node hands the sender to its engine as the PrefillConnector):
- the registry, keyed by TransferKey (the decode node's fabric engine id, its request id, the
  attempt): the active transfers (`PrefillTransfer`, by the key's `engine_request_id`), the keys
  aborted before their Prefill (REMEMBERED_ABORTS) and the tombstones of the ones that ended here
  (`Tombstone`: FINISHED or CONNECTION_FAILED with the connection generation used,
  REMEMBERED_FINISHED). The same key twice is refused; a retry is a new attempt, a new key.
- `begin`: connect the decode peer (once, kv_messenger.prefill_peers), refuse an aborted or
  repeated key, `KvSender.add`, register. The node queues the engine request in the same loop turn.
- `run_to_release`: a Prefill's wait for its transfer, with its deadline (past it: abort, then
  TimeoutError) and its caller's cancellation (abort).
- the release: when nothing of a transfer is in flight (its sender future is done, any thread), the
  loop retires a peer that failed at the fabric (before the source pages are freed), ends the
  engine request if it still runs and frees its held blocks (`HeldPages`, the node's engine side),
  then writes the tombstone and wakes the Prefill. Every begun transfer ends in exactly one release.
- `abort` (AbortPrefill): WRONG_ENGINE, ACTIVE, UNKNOWN / REFUSED, CONNECTION_FAILED or FINISHED
  (confirmed with a delivery fence where writes are ordered), see the doc.

Threads: the serving loop owns everything here. The sender's messenger thread and the fabric
progress thread resolve the sender's futures, whose callbacks only hand the release to the loop.

Blocking waits and their bounds:
- `begin`: the handshake with a new decode fabric peer, 5 s (fabric.peers), then UNAVAILABLE.
- `run_to_release` (a Prefill): its `deadline_s` (then `released_within`, ABORT_WAIT_S, and
  TimeoutError), else the caller's own gRPC deadline or its cancellation.
- `released_within` (past a deadline, an abort): the caller's `timeout`; the release
  itself comes once the engine ended the request and every posted write completed or failed (a
  peer with writes out and no completion fails after FabricConfig.peer_timeout_s, default 5 s).
- `settled` (after the release): the sender's future's bridge (settled before the release, so at
  once), ABORT_WAIT_S, then TimeoutError naming it.
- `abort`: an active transfer's release after its abort, its `timeout` (ABORT_WAIT_S), then ACTIVE,
  unconfirmed. The fence is posted on the loop and never awaited: its write does not wait
  (the endpoint shook hands at the transfer's connect; else at most that handshake, 5 s).
- `HeldPages.stop` / `free` (in the release and in background tasks nobody awaits without a bound):
  one engine step, or EngineDeadError (at once for `stop`; `free`, the sender's KvReleased, within
  kv_messenger.completions.ENGINE_POLL_S); each first waits for the transfer's engine add to be
  queued (`PrefillTransfer.queued`, one loop turn). Only a hung step holds them.
- peer retirement (kv_messenger.prefill_peers.DecodePeers.retire): no wait on the peer. The
  sender's lock (add, abort, fence): bookkeeping only (kv_messenger.sender).
- `drain`: the in-flight transfers' releases after their abort, the caller's timeout (logged).
- `close_sender` / `close_transport` (a worker thread): kv_messenger.sender.CLOSE_JOIN_S; the fabric
  endpoint's FABRIC_CLOSE_WAIT_S for outstanding writes, then fabric.engine's own bounds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from fabric import FabricError, PeerDescriptor, RemoteDescriptor, TransferEngine
from kv_messenger.prefill_peers import DecodePeers
from kv_messenger.sender import KvSender, PostError, TransferResult
from kv_messenger.ticket import TransferKey, TransferTicket
from kv_messenger.transport import open_transfer_engine
from pdserve.engine.engine_thread import EngineDeadError
from pdserve.engine.faults import NO_FAULTS, FaultPlan
from pdserve_api.servers import StatusError, UnavailableError

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 10.0        # AbortPrefill / deadline: how long to wait for in-flight writes to settle
FABRIC_CLOSE_WAIT_S = 2.0  # close: how long the fabric endpoint drains outstanding writes (close_timeout_s)
REMEMBERED_ABORTS = 65536  # keys aborted before (or after) their Prefill, refused with ABORTED
REMEMBERED_FINISHED = 65536   # keys that ended here (tombstones for AbortPrefill)

# What this process knows of a transfer (the wire's TransferState, by name).
UNKNOWN, ACTIVE, FINISHED, REFUSED, CONNECTION_FAILED, WRONG_ENGINE = (
    "unknown", "active", "finished", "refused", "connection_failed", "wrong_engine")


class AbortedError(StatusError):
    """The Prefill was stopped by AbortPrefill (or arrived after it)."""

    code = grpc.StatusCode.ABORTED


@dataclass(frozen=True)
class AbortSpec:
    """One AbortPrefill call, decoded from the wire."""

    key: TransferKey
    prefill_engine_id: str              # the process the decode node dispatched to
    fence_tag: int = 0                  # 0: no fence asked
    fence_region: RemoteDescriptor | None = None


@dataclass(frozen=True)
class AbortOutcome:
    confirmed: bool
    state: str                          # UNKNOWN, ACTIVE, FINISHED, ...
    fence_posted: bool = False


@dataclass(frozen=True)
class Tombstone:
    """How a transfer ended here: its state and the connection generation it used."""

    state: str
    epoch: int


class HeldPages(Protocol):
    """The engine side of a transfer's source pages, as the prefill node provides it (over its
    engine thread). Awaited on the loop: one engine step each, or EngineDeadError at once."""

    async def stop(self, engine_request_id: str) -> bool:
        """End the engine request if it still runs (its blocks stay held); True if it ran."""

    async def free(self, engine_request_id: str) -> None:
        """Free the pages the request held (none if the engine never admitted it)."""


@dataclass
class PrefillTransfer:
    """One transfer this process took on (one TransferKey), from `begin` to its release."""

    request_id: str                          # the engine's: key.engine_request_id
    key: TransferKey
    epoch: int                               # the peer's connection generation when it started
    peer: PeerDescriptor                     # the decode fabric peer it writes to (disconnected on failure)
    future: concurrent.futures.Future        # the sender's, resolves with a TransferResult
    received: float                          # time.monotonic() of the RPC's receipt
    transfer_done: asyncio.Future            # resolves (with None) once `future` is done
    queued: asyncio.Event = field(default_factory=asyncio.Event)     # engine add submitted
    released: asyncio.Event = field(default_factory=asyncio.Event)   # held blocks freed


def _retrieve(task: asyncio.Future) -> None:
    """Done callback: mark a background task's exception as seen (it is reported elsewhere)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("background call failed: %s", task.exception())


class PrefillTransfers:
    """Build with `PrefillTransfers.open(...)`, give `sender` to the engine, then `start(loop,
    pages)` on the serving loop and use the rest there."""

    def __init__(self, transport: TransferEngine, sender: KvSender) -> None:
        self.transport = transport
        self.sender = sender
        self.peer: PeerDescriptor = transport.peer_descriptor   # this process's endpoint, as decode nodes see it
        self.provider: str = transport.provider
        self.peers = DecodePeers(transport)
        self._loop: asyncio.AbstractEventLoop | None = None   # the serving loop, from start()
        self._pages: HeldPages | None = None
        self._active: dict[str, PrefillTransfer] = {}        # by engine request id
        self._aborted: OrderedDict[TransferKey, None] = OrderedDict()
        self._finished: OrderedDict[TransferKey, Tombstone] = OrderedDict()
        self._background: set[asyncio.Future] = set()

    @classmethod
    def open(cls, provider: str | None, fabric_node: str | None, faults: FaultPlan = NO_FAULTS) -> PrefillTransfers:
        """The fabric endpoint (provider None: $FI_PROVIDER or the default; fabric_node: the local
        address it binds) and its sender, not started; the endpoint is closed if the sender fails."""
        transport = open_transfer_engine(provider, fabric_node, close_timeout_s=FABRIC_CLOSE_WAIT_S)
        try:
            return cls(transport, KvSender(transport, faults=faults))
        except BaseException:
            transport.close()
            raise

    def start(self, loop: asyncio.AbstractEventLoop, pages: HeldPages) -> None:
        self._loop, self._pages = loop, pages

    @property
    def started(self) -> bool:
        return self._loop is not None

    def __len__(self) -> int:
        """Transfers begun and not released yet."""
        return len(self._active)

    # --- a transfer's life (loop) ---------------------------------------------------------------

    async def begin(self, key: TransferKey, target: TransferTicket, peer: PeerDescriptor,
                    received: float) -> PrefillTransfer:
        """Take on the transfer `key` into `target`: AbortedError if it was aborted first, ValueError
        if it was begun before, UnavailableError if its peer cannot be reached. The caller queues
        its engine request before it next awaits (the sender then sees the first chunk)."""
        rid = key.engine_request_id
        await self.peers.connect(peer)   # before the checks: nothing awaits between them and the add
        if key in self._aborted:
            raise AbortedError(f"request {key.request_id} attempt {key.attempt} was aborted before its Prefill "
                               "arrived")
        if rid in self._active or key in self._finished:
            raise ValueError(f"request {key.request_id!r} attempt {key.attempt} from decode peer "
                             f"{key.decode_engine_id[:8]} was sent here before (a retry takes a new attempt)")
        future = self.sender.add(target, rid)     # before the engine sees the request
        # Once nothing of the transfer is in flight, free the request's held blocks (D11).
        future.add_done_callback(lambda _f, rid=rid: self._on_release(rid))
        t = PrefillTransfer(rid, key, self.peers.epochs.get(key.decode_engine_id), peer, future, received,
                            self._bridge(future))
        self._active[rid] = t
        return t

    def end_posting(self, t: PrefillTransfer) -> None:
        """Post nothing more for `t` (the engine ended its request); its release follows."""
        self.sender.abort(t.request_id)

    def abort_transfer(self, t: PrefillTransfer) -> None:
        """Stop posting for a transfer and stop computing it; its blocks stay held until the release."""
        self.sender.abort(t.request_id)
        task = asyncio.ensure_future(self._stop_engine(t))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_retrieve)

    async def _stop_engine(self, t: PrefillTransfer) -> None:
        await t.queued.wait()   # never abort before the add: the add would then run unchecked
        await self._pages.stop(t.request_id)   # a PREFILL request's pages stay held until the release

    async def released_within(self, t: PrefillTransfer, timeout: float) -> bool:
        try:
            await asyncio.wait_for(t.released.wait(), timeout)
            return True
        except TimeoutError:
            logger.error("request %s: transfer still in flight %.0f s after its abort", t.request_id, timeout)
            return False

    async def run_to_release(self, t: PrefillTransfer, deadline_s: float | None) -> None:
        """Wait for `t`'s release, at most `deadline_s` (None: the caller's own gRPC deadline or its
        going away). Past the deadline the transfer is aborted, its release awaited ABORT_WAIT_S,
        then TimeoutError naming the deadline; a cancelled caller aborts it (S4, S5)."""
        try:
            async with asyncio.timeout(deadline_s):
                await t.released.wait()
        except TimeoutError:
            self.abort_transfer(t)
            await self.released_within(t, ABORT_WAIT_S)
            raise TimeoutError(f"request {t.request_id}: prefill exceeded its deadline of {deadline_s} s") from None
        except asyncio.CancelledError:
            # The caller went away (decode node cancelled or died): nothing more is posted; the
            # release follows once no write is in flight (S4, S5).
            logger.info("request %s: Prefill call cancelled by the caller; aborting its transfer", t.request_id)
            self.abort_transfer(t)
            raise

    async def settled(self, t: PrefillTransfer) -> None:
        """After the release: the sender's future is done (at once), else TimeoutError naming ABORT_WAIT_S."""
        try:
            await asyncio.wait_for(asyncio.shield(t.transfer_done), ABORT_WAIT_S)
        except TimeoutError:
            raise TimeoutError(f"request {t.request_id}: transfer not settled {ABORT_WAIT_S:.0f} s after its "
                               "release (ABORT_WAIT_S)") from None

    def result(self, t: PrefillTransfer) -> TransferResult | None:
        """A settled transfer's TransferResult; None if it was aborted or its pass failed (the node
        says why); raises for the transport's failures: UnavailableError (the fabric), the sender's
        StatusError (e.g. StagingFullError), RuntimeError (a bug while posting, PostError)."""
        exc = t.future.exception()
        if exc is None:
            return t.future.result()
        if isinstance(exc, FabricError):
            raise UnavailableError(f"request {t.request_id}: KV transfer to decode node peer "
                                   f"{t.peer.engine_id[:8]} failed: {exc}")
        if isinstance(exc, StatusError):   # e.g. StagingFullError (RESOURCE_EXHAUSTED): this request only
            raise exc
        if isinstance(exc, PostError):      # a bug while posting: this request only, named (INTERNAL)
            raise RuntimeError(f"request {t.request_id}: {exc}")
        return None

    def _bridge(self, future: concurrent.futures.Future) -> asyncio.Future:
        """An asyncio future that resolves (with None) when the sender's future is done."""
        done = self._loop.create_future()

        def settle(_: asyncio.Future) -> None:
            if not done.done():
                done.set_result(None)

        future.add_done_callback(lambda _f: self._loop.call_soon_threadsafe(settle, done))
        return done

    # --- release (messenger / progress thread -> loop -> engine thread) --------------------------

    def _on_release(self, request_id: str) -> None:
        """The sender has nothing of `request_id` in flight any more (any non-engine thread)."""
        try:
            asyncio.run_coroutine_threadsafe(self._release(request_id), self._loop)
        except RuntimeError as e:   # the loop is closed: the process is exiting
            logger.warning("request %s: release not scheduled: %s", request_id, e)

    async def _release(self, request_id: str) -> None:
        t = self._active.get(request_id)
        try:
            if t is not None:
                await t.queued.wait()    # its engine add is queued before our abort/release
                if isinstance(t.future.exception(), FabricError):
                    self.peers.retire(t.peer)   # before its source pages are freed
            if await self._pages.stop(request_id):
                logger.info("request %s: stopped its prefill (transfer ended before the prefill did)", request_id)
            await self._pages.free(request_id)
            logger.debug("request %s: released its pages", request_id)
        except EngineDeadError as e:
            logger.warning("request %s: engine gone, blocks not released: %s", request_id, e)
        finally:
            if t is not None and self._active.get(request_id) is t:
                failed = isinstance(t.future.exception(), FabricError)
                self._tombstone(t.key, Tombstone(CONNECTION_FAILED if failed else FINISHED, t.epoch))
                del self._active[request_id]
                t.released.set()

    def _tombstone(self, key: TransferKey, tomb: Tombstone) -> None:
        self._finished[key] = tomb
        self._finished.move_to_end(key)
        while len(self._finished) > REMEMBERED_FINISHED:
            self._finished.popitem(last=False)

    # --- AbortPrefill (loop) -------------------------------------------------------------------

    def _remember_abort(self, key: TransferKey) -> None:
        self._aborted[key] = None
        self._aborted.move_to_end(key)
        while len(self._aborted) > REMEMBERED_ABORTS:
            self._aborted.popitem(last=False)

    async def abort(self, spec: AbortSpec, timeout: float = ABORT_WAIT_S) -> AbortOutcome:
        """Stop a transfer; confirmed once this process can vouch that no write of it can land in
        the decode node's memory (S5; docs/transfer-prefill-side.md)."""
        key = spec.key
        if spec.prefill_engine_id != self.transport.engine_id:
            logger.info("abort of %s attempt %d names prefill engine %s, this is %s: not confirmed", key.request_id,
                        key.attempt, spec.prefill_engine_id[:8], self.transport.engine_id[:8])
            return AbortOutcome(False, WRONG_ENGINE)
        t = self._active.get(key.engine_request_id)
        if t is not None:
            self.abort_transfer(t)
            if not await self.released_within(t, timeout):
                return AbortOutcome(False, ACTIVE)
        tomb = self._finished.get(key)
        if tomb is None:
            if key in self._aborted:
                return AbortOutcome(True, REFUSED)
            self._remember_abort(key)
            logger.info("abort of %s attempt %d: never seen here; remembered as refused", key.request_id, key.attempt)
            return AbortOutcome(False, UNKNOWN)
        if tomb.state != FINISHED or tomb.epoch != self.peers.epochs.get(key.decode_engine_id):
            return AbortOutcome(False, CONNECTION_FAILED)
        if not spec.fence_tag or spec.fence_region is None:
            return AbortOutcome(True, FINISHED)
        return self._fence(spec)

    def _fence(self, spec: AbortSpec) -> AbortOutcome:
        """A FINISHED key of this connection generation, a fence asked: post it where it proves something."""
        key = spec.key
        if not self.transport.writes_ordered:
            if self.transport.delivery_complete:   # each write completed only once delivered
                return AbortOutcome(True, FINISHED)
            # a fence would prove nothing: finished (terminal), but unfenced (the decode node
            # closes its connection instead, decode_node.service)
            return AbortOutcome(False, FINISHED)
        if spec.fence_region.peer.engine_id != key.decode_engine_id:
            raise ValueError(f"abort of {key.request_id}: the fence region belongs to engine "
                             f"{spec.fence_region.peer.engine_id[:8]}, not the transfer's {key.decode_engine_id[:8]}")
        try:
            fence = self.sender.fence(spec.fence_region, spec.fence_tag)
        except FabricError as e:
            logger.warning("abort of %s attempt %d: fence not posted: %s", key.request_id, key.attempt, e)
            return AbortOutcome(False, FINISHED)
        # A fence that fails after it was posted never lands: the decode side waits FENCE_WAIT_S and
        # asks again; say why here (fabric progress thread).
        def fence_done(f: concurrent.futures.Future, k: TransferKey = key) -> None:
            if not f.cancelled() and f.exception() is not None:
                logger.warning("abort of %s attempt %d: its fence write failed: %s", k.request_id, k.attempt,
                               f.exception())

        fence.add_done_callback(fence_done)
        return AbortOutcome(True, FINISHED, fence_posted=True)

    # --- shutdown ------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Abort every transfer in flight and wait up to `timeout` for their releases (loop)."""
        transfers = list(self._active.values())
        if transfers:
            logger.info("aborting %d in-flight prefills for shutdown", len(transfers))
        for t in transfers:
            self.abort_transfer(t)
        if transfers:
            done, pending = await asyncio.wait([asyncio.ensure_future(t.released.wait()) for t in transfers],
                                               timeout=timeout)
            for p in pending:
                p.cancel()
            if pending:
                logger.warning("%d prefills still had writes in flight at shutdown", len(pending))

    def close_sender(self) -> None:
        """Stop the messenger thread (kv_messenger.sender.CLOSE_JOIN_S); blocking, any thread."""
        self.sender.close()

    def close_transport(self) -> None:
        """Close the fabric endpoint (FABRIC_CLOSE_WAIT_S, then fabric.engine's bounds); blocking."""
        self.transport.close()

    def close(self) -> None:
        self.close_sender()
        self.close_transport()
