"""The decode side's quarantines: an abandoned attempt whose writes may still land keeps its pages
and tag until the prefill side has provably stopped (S5). Each `Quarantine` has an explicit
`HoldState` driven by events (an AbortPrefill answer, the peer gone, our connection closed, its key
rotated, the node closing); `QuarantineHolds` runs one hold task per quarantine on the serving
loop: AbortPrefill with backoff and a delivery fence, the optional close of our connection, the
peer's death, a drain of what already arrived. A hold still unanswered is visible as
pdserve:kv_quarantine_oldest_seconds{peer} and a warning every QUARANTINE_LOG_S. Why each release
is sound, and the state diagram: docs/transfer-safety.md ("The quarantine").

Threads: `quarantine_attempt` and `release_quarantine` are work for the engine thread (posted to
DecodeTransfers' inbox, kv_messenger.completions: they update the receiver and yield the engine's
KvQuarantined / KvReleased events); everything else on the serving loop.

Blocking waits (all on the loop, no thread parked), with their bounds: one AbortPrefill
(ABORT_RPC_TIMEOUT_S, cut short when the peer is gone or its key rotated, looked at every
HOLD_POLL_S) and its fence (FENCE_WAIT_S); a close of our connection to a prefill engine (its lock:
the closes before it, each one fi_av_remove in a worker thread plus a drain); the hold itself:
unbounded by design (S5: pages no write may land in are never reused), in rounds HOLD_BACKOFF_S
doubling to HOLD_BACKOFF_MAX_S, the endpoint's death looked at every HOLD_POLL_S, then its arrivals
drained (DRAIN_GRACE_S + at most DRAIN_WAIT_S).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_messenger.decode.client import PrefillTarget, RpcError, TransferTelemetry
from kv_messenger.receiver import KvReceiver
from kv_messenger.ticket import remote_to_bytes
from kv_messenger.transport import TransferEngine
from pdserve.engine.kv_connector import KvEvent, KvFailure, KvQuarantined, KvReleased
from pdserve_api.v1 import prefill_pb2

if TYPE_CHECKING:
    from kv_messenger.completions import Work
    from kv_messenger.decode.rotation import KeyRotation
    from pdserve.engine.engine_thread import EngineThread

logger = logging.getLogger(__name__)

ABORT_RPC_TIMEOUT_S = 12.0   # deadline of one AbortPrefill call (the prefill side waits up to 10 s for its writes)
FENCE_WAIT_S = 5.0           # a confirmed abort's fence lands within this, or the abort is re-sent
HOLD_BACKOFF_S = 0.25        # a quarantine's first pause before AbortPrefill is re-sent ...
HOLD_BACKOFF_MAX_S = 5.0     # ... doubling up to this
HOLD_POLL_S = 0.1            # while held: whether the prefill endpoint is gone, this often
DRAIN_GRACE_S = 0.05         # a gone peer's bytes in our socket buffers become readable
DRAIN_WAIT_S = 1.0           # then at most this for two progress rounds to handle them
QUARANTINE_LOG_S = 30.0      # a hold still unanswered is logged (a warning) this often

# One AbortPrefill's outcome (QuarantineHolds.abort_answer).
ABORT_CONFIRMED, ABORT_ENDED_UNFENCED, ABORT_NOT_YET = "confirmed", "ended-unfenced", "not-yet"
# The prefill node says nothing more will ever be posted for the key and every posted write of it
# completed there (in error or not); with confirmed=False, no fence proves they landed.
TERMINAL_STATES = frozenset({prefill_pb2.TRANSFER_STATE_FINISHED, prefill_pb2.TRANSFER_STATE_CONNECTION_FAILED})


class HoldState(enum.Enum):
    """Where a quarantine is (docs/transfer-safety.md's diagram)."""

    HELD = "held"                        # AbortPrefill re-sent with backoff; nothing proves the writer stopped
    ENDED_UNFENCED = "ended-unfenced"    # its process said the key ended, no fence proved delivery (still held)
    RELEASED = "released"                # proven stopped (`released_by`); its pages are handed back
    LEFT_HELD = "left-held"              # the node is closing: the hold stopped, the pages stay quarantined


class Release(enum.Enum):
    """Why a hold was released: each value is the proof, as the release's log line says it."""

    ABORT_CONFIRMED = "abort confirmed"
    CONNECTION_CLOSED = "its key ended on the prefill node, unfenced; our connection to it closed"
    PEER_GONE = "prefill endpoint gone"
    KEY_ROTATED = "its memory key was rotated (closed, every connection open then ended)"


class HoldTransitionError(RuntimeError):
    """An event a quarantine in its state cannot take (a bug: the hold loop drives them in order)."""


@dataclass
class Quarantine:
    """An abandoned attempt whose writes may still land: its pages and tag, held until the
    prefill side provably stopped (loop-owned; `tag` and `blocks` set on the engine thread)."""

    request_id: str
    attempt: int
    quarantine_id: str                        # the KvQuarantined / KvReleased hold id
    node: PrefillTarget
    decode_engine_id: str
    prefill_engine_id: str
    peer: Any                                 # the prefill node's fabric PeerDescriptor (None: unknown)
    since: float
    tag: int | None = None
    blocks: int = 0                           # pages quarantined; -1: none (the request had ended)
    rounds: int = 0
    closes_at_answer: int = 0                 # closes of our connection to its engine begun by its last answer
    key_gen: int = 0                          # the memory-key generation its attempt's ticket named
    logged: float = 0.0                       # time.monotonic() of its last "still quarantined" warning
    state: HoldState = HoldState.HELD
    released_by: Release | None = None

    @property
    def ended_unfenced(self) -> bool:
        """Its prefill process answered the key ended, unfenced (sticky until released)."""
        return self.state is HoldState.ENDED_UNFENCED

    def _require(self, event: str, *states: HoldState) -> None:
        if self.state not in states:
            raise HoldTransitionError(f"quarantine {self.quarantine_id}: {event} in state {self.state.value} "
                                      f"(allowed in {[s.value for s in states]})")

    def answered(self, answer: str) -> None:
        """An AbortPrefill round's outcome: confirmed (and fenced) releases; ended-unfenced is sticky."""
        self._require(f"AbortPrefill answer {answer!r}", HoldState.HELD, HoldState.ENDED_UNFENCED)
        if answer == ABORT_CONFIRMED:
            self._release(Release.ABORT_CONFIRMED)
        elif answer == ABORT_ENDED_UNFENCED:
            self.state = HoldState.ENDED_UNFENCED
        elif answer != ABORT_NOT_YET:
            raise ValueError(f"unknown AbortPrefill outcome {answer!r}")

    def connection_closed(self) -> None:
        """Our connection to its prefill engine was closed after its unfenced answer."""
        self._require("connection closed", HoldState.ENDED_UNFENCED)
        self._release(Release.CONNECTION_CLOSED)

    def peer_gone(self) -> None:
        """Its prefill endpoint is gone and what it sent before was drained."""
        self._require("peer gone", HoldState.HELD, HoldState.ENDED_UNFENCED)
        self._release(Release.PEER_GONE)

    def key_rotated(self) -> None:
        """A key rotation closed the keys its attempt was sent and ended every connection open then."""
        self._require("key rotated", HoldState.HELD, HoldState.ENDED_UNFENCED)
        self._release(Release.KEY_ROTATED)

    def left_held(self) -> None:
        """The hold was cancelled (the node is closing): nothing proved the writer stopped."""
        self._require("hold cancelled", HoldState.HELD, HoldState.ENDED_UNFENCED)
        self.state = HoldState.LEFT_HELD

    def _release(self, why: Release) -> None:
        self.state, self.released_by = HoldState.RELEASED, why


async def drain_arrivals(transport: TransferEngine) -> None:
    """After a peer is judged gone (or connections ended): let the progress thread handle what it
    had already read (a short grace for bytes in our socket buffers, then two full progress rounds,
    at most DRAIN_WAIT_S), polled on the loop."""
    await asyncio.sleep(DRAIN_GRACE_S)
    mark = transport.progress_mark()
    end = time.monotonic() + DRAIN_WAIT_S
    while not transport.progressed(mark) and time.monotonic() < end:
        await asyncio.sleep(0.002)


class QuarantineHolds:
    """Every quarantine of a decode node and its hold task (loop-owned)."""

    def __init__(self, transport: TransferEngine, receiver: KvReceiver, rotation: KeyRotation,
                 telemetry: TransferTelemetry, release_unfenced_by_close: bool) -> None:
        self.transport = transport
        self.receiver = receiver
        self.rotation = rotation
        self.telemetry = telemetry
        self.release_unfenced_by_close = release_unfenced_by_close
        self.engine: EngineThread | None = None      # set once the engine is built (DecodeTransfers.attach)
        self.post: Callable[[Work], None] | None = None   # engine-thread work: DecodeTransfers.inbox.post
        self.loop: asyncio.AbstractEventLoop | None = None
        self._holds: dict[str, asyncio.Task] = {}   # quarantine id -> its hold
        self._held: dict[str, Quarantine] = {}       # quarantine id -> what it holds (ages: the gauge)
        self._aged: set[str] = set()                 # prefill addresses the age gauge has a value for
        self._conn_closes: dict[str, int] = {}       # prefill engine id -> closes of our connection to it begun
        self._close_locks: dict[str, asyncio.Lock] = {}

    def held(self) -> list[Quarantine]:
        return list(self._held.values())

    def cancel_all(self) -> None:
        for task in list(self._holds.values()):
            task.cancel()

    # --- engine thread (the next slice's connector events) ---------------------------------------

    def quarantine_attempt(self, q: Quarantine, retry: bool, error: str) -> Iterator[KvEvent]:
        """Engine thread (posted work): an attempt whose writes may still land. Its tag and pages
        go to quarantine (S5); the request is admitted again into fresh pages for a new attempt
        (retry) or ends with `error`; the hold runs on the loop."""
        assert self.loop is not None
        q.tag = self.receiver.quarantine(q.request_id)
        yield KvQuarantined(q.request_id, q.quarantine_id, KvFailure.RETRY if retry else KvFailure.END, error)
        # what the engine moved: nothing if the request ended and its pages were freed (its KV had
        # landed); a retry's fresh pages come with a new KvWait -> ticket_ready -> a new attempt
        blocks = self.engine.engine.quarantined_blocks(q.quarantine_id) if self.engine is not None else None
        q.blocks = -1 if blocks is None else blocks
        if q.tag is None and q.blocks < 0:
            return
        self.loop.call_soon_threadsafe(self._start_hold, q)

    def release_quarantine(self, q: Quarantine) -> Iterator[KvEvent]:
        """Engine thread (posted work): the prefill side has provably stopped writing into q's pages."""
        if q.blocks >= 0:
            yield KvReleased(hold_id=q.quarantine_id)
        if q.tag is not None:
            self.receiver.release_quarantined(q.tag)

    # --- the loop -----------------------------------------------------------------------------

    def _start_hold(self, q: Quarantine) -> None:
        task = asyncio.create_task(self._hold(q), name=f"hold-{q.quarantine_id}")
        self._holds[q.quarantine_id] = task
        self._held[q.quarantine_id] = q
        task.add_done_callback(lambda _t, q=q: self._end_hold(q))

    def _end_hold(self, q: Quarantine) -> None:
        self._holds.pop(q.quarantine_id, None)
        self._held.pop(q.quarantine_id, None)
        self.show_age(q.node.address)

    def show_age(self, address: str) -> None:
        """pdserve:kv_quarantine_oldest_seconds{peer=address}: the oldest hold's age (as of a
        hold's latest round), the label removed when that prefill node has none."""
        now = time.monotonic()
        ages = [now - q.since for q in self._held.values() if q.node.address == address]
        gauge = self.telemetry.kv_quarantine_oldest
        if ages:
            gauge.labels(peer=address).set(max(ages))
            self._aged.add(address)
        elif address in self._aged:
            gauge.remove(address)
            self._aged.discard(address)

    def _peer_gone_now(self, q: Quarantine) -> bool:
        return q.peer is not None and self.transport.peer_gone(q.peer)

    async def _hold(self, q: Quarantine) -> None:
        """Keep q's pages in quarantine until the prefill side has provably stopped: its process
        confirmed the abort and the fence landed, or its endpoint is gone. AbortPrefill is re-sent
        with backoff (HOLD_BACKOFF_S doubling to HOLD_BACKOFF_MAX_S); no thread is parked."""
        self.telemetry.bind_request_id(q.request_id)
        q.node.holds += 1   # keeps the node's channel open should discovery retire it meanwhile
        try:
            await self._hold_rounds(q)
        except asyncio.CancelledError:
            q.left_held()
            logger.info("request %s attempt %d: hold cancelled (node closing); %d pages stay quarantined",
                        q.request_id, q.attempt, max(q.blocks, 0))
            raise
        finally:
            q.node.holds -= 1
        assert q.released_by is not None and self.engine is not None
        logger.info("request %s attempt %d: %s after %.2f s; %d quarantined pages released", q.request_id,
                    q.attempt, q.released_by.value, time.monotonic() - q.since, max(q.blocks, 0))
        assert self.post is not None
        self.post(lambda: self.release_quarantine(q))

    async def _hold_rounds(self, q: Quarantine) -> None:
        """The hold's rounds, until q is RELEASED (each event drives q's state)."""
        delay = HOLD_BACKOFF_S
        while True:
            if self.rotation.key_dead(q.key_gen):
                q.key_rotated()
                return
            try:
                answer = await self.abort_answer(q)
            except Exception as e:   # never let the hold die: its pages would stay quarantined unseen
                logger.error("request %s attempt %d: AbortPrefill round on %s failed (%s: %s); retrying in "
                             "%.2f s", q.request_id, q.attempt, q.node.address, type(e).__name__, e, delay)
                answer = ABORT_NOT_YET
            q.answered(answer)   # confirmed: released; ended-unfenced: sticky (a rotation may release it)
            if q.state is HoldState.RELEASED:
                return
            if answer == ABORT_ENDED_UNFENCED and self._can_close(q):
                await self._close_prefill_connection(q, q.closes_at_answer)
                q.connection_closed()
                return
            if self._peer_gone_now(q):
                await drain_arrivals(self.transport)
                q.peer_gone()
                return
            q.rounds += 1
            self.show_age(q.node.address)
            if q.rounds == 1 or time.monotonic() - q.logged >= QUARANTINE_LOG_S:
                q.logged = time.monotonic()
                logger.warning("request %s attempt %d: %d pages quarantined for %.1f s; prefill node %s has not "
                               "confirmed its abort (round %d)", q.request_id, q.attempt, max(q.blocks, 0),
                               time.monotonic() - q.since, q.node.address, q.rounds)
            if await self._peer_gone_within(q, delay):
                if self.rotation.key_dead(q.key_gen):
                    continue   # said at the top of the loop
                await drain_arrivals(self.transport)
                q.peer_gone()
                return
            delay = min(2 * delay, HOLD_BACKOFF_MAX_S)

    async def _peer_gone_within(self, q: Quarantine, seconds: float) -> bool:
        """Sleep `seconds`, looking every HOLD_POLL_S whether the prefill endpoint is gone (or q's
        memory key was rotated)."""
        end = time.monotonic() + seconds
        while True:
            if self._peer_gone_now(q) or self.rotation.key_dead(q.key_gen):
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(HOLD_POLL_S, left))

    def _can_close(self, q: Quarantine) -> bool:
        """Closing our connection to q's prefill node refuses what it still sends (ofi_rxm)."""
        return self.release_unfenced_by_close and q.peer is not None and self.transport.closes_connections

    async def _close_prefill_connection(self, q: Quarantine, closes_before: int) -> None:
        """Make sure a close of our connections to q's prefill endpoint began after its terminal
        answer (`closes_before`: the closes begun when that answer arrived), then drain what the
        progress thread had already read. Holds whose answers came before one close
        share it (one lock per prefill engine, a count of closes begun)."""
        assert q.peer is not None
        eid = q.prefill_engine_id
        lock = self._close_locks.setdefault(eid, asyncio.Lock())
        async with lock:
            begun = self._conn_closes.get(eid, 0)
            if begun > closes_before:
                return   # one began after our answer and has ended (we hold its lock)
            self._conn_closes[eid] = begun + 1
            logger.warning("closing our fabric connection to prefill engine %s (%s): request %s attempt %d ended "
                           "there unfenced; its other transfers in flight fail over (close %d)", eid[:8],
                           q.node.address, q.request_id, q.attempt, begun + 1)
            await asyncio.to_thread(self.transport.close_connection, q.peer)
            await drain_arrivals(self.transport)

    async def abort_answer(self, q: Quarantine) -> str:
        """One AbortPrefill, bound to the prefill engine the attempt was sent to, with a delivery
        fence: ABORT_CONFIRMED once that process confirmed and (when it posted one) the fence
        landed here; ABORT_ENDED_UNFENCED when it says the key is terminal but no fence proved
        delivery (CONNECTION_FAILED, FINISHED unconfirmed, a fence that did not land in
        FENCE_WAIT_S, or a fence where this endpoint's writes are not ordered); else ABORT_NOT_YET."""
        assert self.loop is not None
        loop = self.loop
        fenced = asyncio.Event()
        tag, region = self.receiver.expect_fence(lambda: loop.call_soon_threadsafe(fenced.set),
                                                 writer=q.prefill_engine_id or None)
        try:
            req = prefill_pb2.AbortPrefillRequest(
                request_id=q.request_id, decode_engine_id=q.decode_engine_id, attempt=q.attempt,
                prefill_engine_id=q.prefill_engine_id, fence_tag=tag, fence_region=remote_to_bytes(region))
            call = asyncio.ensure_future(q.node.abort(req, ABORT_RPC_TIMEOUT_S))
            while not call.done():   # a dead endpoint ends the wait at once
                await asyncio.wait({call}, timeout=HOLD_POLL_S)
                if not call.done() and (self._peer_gone_now(q) or self.rotation.key_dead(q.key_gen)):
                    call.cancel()
                    return ABORT_NOT_YET
            try:
                resp = call.result()
                # no await since the answer came: a close counted later began after it
                q.closes_at_answer = self._conn_closes.get(q.prefill_engine_id, 0)
            except RpcError as e:
                logger.info("AbortPrefill of %s attempt %d on %s failed: %s", q.request_id, q.attempt,
                            q.node.address, e.code)
                return ABORT_NOT_YET
            return await self._judge_answer(q, resp, fenced)
        finally:
            self.receiver.retire_fence(tag)

    async def _judge_answer(self, q: Quarantine, resp: prefill_pb2.AbortPrefillResponse,
                            fenced: asyncio.Event) -> str:
        """What an AbortPrefill answer proves (abort_answer), waiting for its fence if it posted one."""
        state = prefill_pb2.TransferState.Name(resp.state)
        if resp.prefill_engine_id != q.prefill_engine_id:
            # Another process serves that address now (restarted in place, maybe on another host or
            # in another pid namespace, where peer_gone cannot tell): the engine we sent to can
            # never confirm or fence this attempt. Like an unfenced end: released by a key rotation
            # (or, opted in, a close of our connection to it), never freed on this answer alone.
            logger.info("AbortPrefill of %s attempt %d on %s: answered by engine %s, not %s (state %s): the "
                        "process it was sent to is gone from that address; released by the next rotation",
                        q.request_id, q.attempt, q.node.address, resp.prefill_engine_id[:8],
                        q.prefill_engine_id[:8], state)
            return ABORT_ENDED_UNFENCED
        if not resp.confirmed:
            logger.info("AbortPrefill of %s attempt %d on %s: not confirmed (state %s)", q.request_id,
                        q.attempt, q.node.address, state)
            return ABORT_ENDED_UNFENCED if resp.state in TERMINAL_STATES else ABORT_NOT_YET
        if not resp.fence_posted:
            return ABORT_CONFIRMED
        if not self.transport.writes_ordered:
            return ABORT_ENDED_UNFENCED   # a fence proves nothing here: writes are not ordered
        try:
            await asyncio.wait_for(fenced.wait(), FENCE_WAIT_S)
            return ABORT_CONFIRMED
        except TimeoutError:
            logger.warning("AbortPrefill of %s attempt %d: confirmed, but its fence did not land within %.0f s",
                           q.request_id, q.attempt, FENCE_WAIT_S)
            return ABORT_ENDED_UNFENCED
