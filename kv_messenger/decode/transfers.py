"""The decode side of the transfer as one state machine: `DecodeTransfers` turns the receiver's
events (a request has its pages, its writes landed) into attempts (kv_messenger.decode.attempt),
runs one transfer task per attempt (choose a prefill node it has not tried, prefill there, on
failure quarantine the attempt and let the request be admitted again), and hands the quarantines
to their holds (kv_messenger.decode.quarantine) and the key rotation (kv_messenger.decode.rotation).
The decode node builds it (which builds the KvReceiver the engine gets as its connector), attaches
the engine, and starts it on the serving loop with the prefill pool.
The correctness argument and the state diagrams: docs/transfer-safety.md.

Threads: the receiver's events arrive on the engine thread (`ticket_ready`, `ticket_refused`) and
the fabric progress thread (`kv_landed_tag`, `kv_stale_write`); the engine-thread work
(`_kv_ready`, `_checksum_failed`, `_fail_waiting`, `_abandoned`, and the quarantine's) is posted to
`inbox` (kv_messenger.completions) and run when the engine takes the receiver's `kv_events`: it
updates the receiver and yields the engine's events (KvLanded, KvFailed, KvQuarantined,
KvReleased); the engine is never called. Everything else runs on the serving loop.

Blocking waits: none of its own beyond those of the attempt (attempt.py), the holds
(quarantine.py) and the rotation (rotation.py); an attempt whose only untried prefill nodes are
marked down waits for their retry (the pool's retry_in: decode_node.prefill_pool.RETRY_DOWN_AFTER_S).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kv_messenger.completions import EngineInbox, Work
from kv_messenger.context import ContextRecordError
from kv_messenger.decode.attempt import Attempt, PrefillWatch, RequestState, RequestTable, WatchSettings
from kv_messenger.decode.client import PrefillClient, PrefillTarget, TransferTelemetry
from kv_messenger.decode.quarantine import Quarantine, QuarantineHolds
from kv_messenger.decode.rotation import KeyRotation, rotation_supported
from kv_messenger.receiver import CONTEXT_SLOTS, KvReceiver, ReceiverEvents
from kv_messenger.ticket import TransferTicket
from kv_messenger.transport import TransferEngine
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.faults import NO_FAULTS, FaultPlan
from pdserve.engine.kv_connector import KvEvent, KvFailed, KvFailure, KvLanded
from pdserve.engine.request import RequestStatus

logger = logging.getLogger(__name__)

CHECKSUM_RETRIES_SAME_NODE = 1   # S7: checksum failures of a request that may retry on the same prefill node


@dataclass(frozen=True)
class TransferSettings:
    """The decode side's transfer options (from DecodeNodeConfig; validated there)."""

    node_id: str
    prefill_timeout_s: float = 60.0
    stall_s: float = 3.0
    local_prefill_fallback: bool = False
    max_waiting_requests: int = 2048
    release_unfenced_by_close: bool = False
    kv_checksum: bool = False
    rotate_key_after_s: float | None = None
    faults: FaultPlan = NO_FAULTS

    def __post_init__(self) -> None:
        if not self.prefill_timeout_s > 0 or not self.stall_s > 0:
            raise ValueError(f"prefill_timeout_s and stall_s must be > 0, got {self.prefill_timeout_s!r}, "
                             f"{self.stall_s!r}")
        if self.rotate_key_after_s is not None and not self.rotate_key_after_s > 0:
            raise ValueError(f"rotate_key_after_s must be > 0 (or None: off), got {self.rotate_key_after_s!r}")


class DecodeTransfers(ReceiverEvents):
    """Every transfer of one decode node: its attempts, quarantines and key generations."""

    def __init__(self, transport: TransferEngine, settings: TransferSettings, telemetry: TransferTelemetry,
                 requests: RequestTable) -> None:
        self.transport = transport
        self.settings = settings
        self.telemetry = telemetry
        self.requests = requests
        # A context slot per request that may wait for its KV (at most max_waiting_requests:
        # they have no first token yet), plus CONTEXT_SLOTS for quarantined attempts.
        self.receiver = KvReceiver(transport, events=self, kv_checksum=settings.kv_checksum,
                                   context_slots=settings.max_waiting_requests + CONTEXT_SLOTS,
                                   faults=settings.faults)
        self.rotation = KeyRotation(transport, self.receiver, telemetry, settings.rotate_key_after_s,
                                    settings.stall_s)
        self.holds = QuarantineHolds(transport, self.receiver, self.rotation, telemetry,
                                     settings.release_unfenced_by_close)
        watch = WatchSettings(settings.node_id, settings.prefill_timeout_s, settings.stall_s, settings.faults)
        self.watch = PrefillWatch(watch, transport, self.receiver, self.rotation, telemetry, self._verified)
        self.inbox = EngineInbox()   # the engine-thread work behind the receiver's kv_events
        self.holds.post = self.inbox.post
        self.engine: EngineThread | None = None
        self.pool: PrefillClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    def attach(self, engine: EngineThread) -> None:
        """The engine built with `self.receiver` as its connector (before any request)."""
        self.engine = self.holds.engine = engine
        self.inbox.bind(engine)
        self.watch.model_name = engine.engine.info().model_name   # the transfer metrics' label

    def start(self, pool: PrefillClient) -> None:
        """On the serving loop, once the pool is built (before its first refresh): requests may begin."""
        self.loop = self.holds.loop = asyncio.get_running_loop()
        self.pool = pool

    def start_rotation(self) -> None:
        """On the serving loop, after `start`: the rotation task (--rotate-key-after, where it is
        measured to work; else a warning)."""
        assert self.engine is not None and self.pool is not None
        pool = self.pool
        if self.settings.rotate_key_after_s is None:
            return
        if rotation_supported(self.transport):
            self._tasks.append(asyncio.create_task(self.rotation.run(self.engine, pool, self.holds.held)))
        else:   # shm checks no key; verbs/efa: not measured here (docs/transfer-safety.md)
            logger.warning("key rotation (--rotate-key-after) does not apply on provider %s: only on tcp;ofi_rxm "
                           "is it measured that a closed key and our ended connections stop every old write (shm "
                           "checks no key at all); a quarantine whose prefill process neither confirms its abort "
                           "nor dies stays held", self.transport.provider)

    def cancel(self) -> None:
        """The node is closing: cancel every transfer task, hold and the rotation (pages stay held)."""
        for state in self.requests.states():
            if state.transfer is not None and state.transfer.task is not None:
                state.transfer.task.cancel()
        self.holds.cancel_all()
        for task in self._tasks:
            task.cancel()

    # --- receiver events (engine thread / fabric progress thread) -----------------------------------

    def ticket_ready(self, ticket: TransferTicket, token_ids: tuple[int, ...]) -> None:
        """Engine thread: pages allocated (D3); hand the transfer (one attempt) to the loop."""
        rid = ticket.request_id
        state = self.requests.get(rid)
        if state is not None and not state.admitted:
            state.admitted = time.monotonic()
        assert self.loop is not None
        # the generation of the keys `prepare` just put in the ticket (both on this thread)
        self.loop.call_soon_threadsafe(self._start_transfer, rid, token_ids, ticket, self.rotation.generation)

    def ticket_refused(self, request_id: str, error: str) -> None:
        self._submit(lambda: self._fail_waiting(request_id, error))

    def kv_landed(self, request_id: str) -> None:
        """(The receiver calls kv_landed_tag; this names the request's current attempt.)"""
        tag = self.receiver.tag_of(request_id)
        if tag is not None:
            self.kv_landed_tag(request_id, tag)

    def kv_landed_tag(self, request_id: str, tag: int) -> None:
        """Fabric progress thread: every write of the attempt with `tag` has landed."""
        if self.settings.kv_checksum:   # S7: schedulable only after the verification (PrefillWatch)
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._mark_landed, request_id, tag)
            return
        self._submit(lambda: self._kv_ready(request_id, tag))

    def kv_stale_write(self, tag: int, count: int) -> None:
        """Fabric progress thread: writes landed for a tag nothing holds (S5; must stay 0)."""
        self.telemetry.kv_stale_writes.inc(count)

    def _submit(self, work: Work) -> None:
        """Any thread: run `work` (a generator of engine events) on the engine thread."""
        self.inbox.post(work)

    def completions(self) -> Iterator[KvEvent]:
        """Engine thread (the receiver's kv_events): the posted work, run in order."""
        return self.inbox.drain()

    def _verified(self, rid: str, tag: int) -> None:
        """Loop (S7): the attempt's landed runs match: now it may become schedulable."""
        self._submit(lambda: self._kv_ready(rid, tag))

    # --- engine thread: the work behind the connector's events (landed, failed, released) ------------

    def _waiting(self, rid: str) -> bool:
        assert self.engine is not None
        r = self.engine.engine.get_request(rid)
        return r is not None and r.status is RequestStatus.WAITING_FOR_KV

    def _kv_ready(self, rid: str, tag: int) -> Iterator[KvEvent]:
        assert self.loop is not None
        if self.receiver.tag_of(rid) != tag:
            return   # an attempt quarantined meanwhile: its pages are released by its hold
        waiting = self._waiting(rid)
        try:   # D19: every transfer's record is checked, read before the slot goes
            ctx = self.receiver.context(rid)
        except ContextRecordError as e:
            self.telemetry.kv_context_rejected.inc()
            logger.error("request %s (tag %d): context record rejected (%s): %s%s", rid, tag, e.field, e,
                         "; its pages are freed unused" if waiting else "")
            if waiting:   # the loop fails the attempt (_checksum_failed_attempt): re-prefill or fail
                self.loop.call_soon_threadsafe(self._context_rejected, rid, tag, f"context record rejected: {e}")
                return
            ctx = None    # aborted meanwhile: nothing decodes from it, its pages are released below
        self.receiver.finish(rid)
        # a draft head starts from the prefill node's hidden state and history rows (D17, E20); the
        # engine ignores them without one. Ended meanwhile: its held pages are freed (nothing can land).
        yield KvLanded(rid, ctx.hidden if ctx is not None else None, ctx.history if ctx is not None else None)
        self.loop.call_soon_threadsafe(self._mark_ready, rid)

    def _checksum_failed(self, rid: str, tag: int, retry: bool, error: str) -> Iterator[KvEvent]:
        """The attempt with `tag` landed completely but its bytes do not match (S7), or its context
        record was rejected (D19). Nothing more can land, so its pages are freed now, unused (never
        landed: they never join the prefix cache). Admitted again into fresh pages (retry) or failed."""
        if self.receiver.tag_of(rid) != tag:
            return   # quarantined meanwhile (the client went away): its hold releases the pages
        if retry and self._waiting(rid):
            self.receiver.finish(rid)          # tag tombstoned, slot freed
            yield KvFailed(rid, KvFailure.RETRY, error)
            return
        yield from self._fail_waiting(rid, error)

    def _fail_waiting(self, rid: str, error: str) -> Iterator[KvEvent]:
        """End a waiting request with an error and free its pages (no write of it can land: it was
        never sent, or its sender provably stopped)."""
        self.receiver.abandon(rid)
        yield KvFailed(rid, KvFailure.END, error)

    def _abandoned(self, rid: str, error: str, locally: bool) -> Iterator[KvEvent]:
        """No prefill node is left for this attempt, which was sent nowhere (its pages are safe):
        prefill here, or fail."""
        if locally and self._waiting(rid):
            self.receiver.abandon(rid)
            yield KvFailed(rid, KvFailure.PREFILL_LOCALLY, error)
            return
        yield from self._fail_waiting(rid, error)

    # --- the loop: transfers ---------------------------------------------------------------------

    def _start_transfer(self, rid: str, tokens: tuple[int, ...], ticket: TransferTicket, key_gen: int) -> None:
        t = Attempt(tokens, attempt=ticket.attempt, tag=ticket.imm_tag, key_gen=key_gen)
        state = self.requests.get(rid)
        if state is None:   # its handler is gone already: the transfer still runs, to end safely
            state = self.requests.orphan(rid)
        state.transfer = t
        t.task = asyncio.create_task(self._run_transfer(state, ticket))
        t.task.add_done_callback(lambda _task: self._transfer_task_done(state, t))

    def _transfer_task_done(self, state: RequestState, t: Attempt) -> None:
        """Loop: a transfer task cancelled before its first step ran none of _run_transfer, clean-up
        included: the attempt was sent nowhere (nothing can land), so its tag, slot and pages go now."""
        if t.started:
            return
        rid = state.request_id
        self._submit(lambda: self._fail_waiting(rid, f"request {rid} cancelled"))
        if state.handler_done and state.transfer is t:
            self.requests.forget(state)

    def _mark_landed(self, rid: str, tag: int) -> None:
        state = self.requests.get(rid)
        t = state.transfer if state is not None else None
        if t is not None and t.tag == tag:
            t.landed.set()

    def _context_rejected(self, rid: str, tag: int, why: str) -> None:
        """Loop: the attempt with `tag` landed but its context record was rejected (D19): mark it
        corrupt and wake its PrefillWatch at once (its pages are freed by _checksum_failed_attempt)."""
        state = self.requests.get(rid)
        t = state.transfer if state is not None else None
        if t is not None and t.tag == tag:
            t.corrupt, t.rejected = True, why
            t.ready_time = time.monotonic()
            t.ready.set()

    def _mark_ready(self, rid: str) -> None:
        state = self.requests.get(rid)
        t = state.transfer if state is not None else None
        if t is not None:
            t.ready_time = time.monotonic()
            t.ready.set()

    def _checksum_failed_attempt(self, state: RequestState, ticket: TransferTicket, node: PrefillTarget,
                                 err: str) -> None:
        """Loop: an attempt failed its verification (S7); its count completed, so no hold."""
        rid, tag = state.request_id, ticket.imm_tag
        state.errors.append(f"{node.address}: {err}")
        state.checksum_failures += 1
        if state.checksum_failures <= CHECKSUM_RETRIES_SAME_NODE:
            state.tried.discard(node.address)   # corruption may be the path's, not the node's: once more
        retry = not state.handler_done
        msg = f"prefill on {node.address} failed ({err})"
        logger.warning("request %s attempt %d: %s; its pages are freed unused%s", rid, ticket.attempt, msg,
                       ", retrying in fresh pages" if retry else "")
        self._submit(lambda: self._checksum_failed(rid, tag, retry, msg))

    async def _choose(self, state: RequestState, t: Attempt) -> PrefillTarget | None:
        """A prefill node the request has not tried; if only nodes marked down are left, after
        waiting for their retry."""
        assert self.pool is not None
        node = self.pool.choose(exclude=state.tried, token_ids=list(t.token_ids))
        wait = self.pool.retry_in(exclude=state.tried) if node is None else None
        if wait is not None:   # only a node marked down is left: wait for its retry (RETRY_DOWN_AFTER_S)
            await asyncio.sleep(wait + 0.01)
            node = self.pool.choose(exclude=state.tried, token_ids=list(t.token_ids))
        return node

    def _abandon(self, rid: str, msg: str) -> None:
        logger.warning(msg)
        locally = self.settings.local_prefill_fallback
        self._submit(lambda: self._abandoned(rid, msg, locally))

    async def _run_transfer(self, state: RequestState, ticket: TransferTicket) -> None:
        """One attempt: choose a prefill node the request has not tried, prefill there; on failure
        quarantine the attempt and let the request be admitted again (a new attempt)."""
        self.telemetry.bind_request_id(state.request_id)  # this task serves one request's transfer
        assert self.pool is not None and state.transfer is not None
        t, rid = state.transfer, state.request_id
        t.started = True
        try:
            node = await self._choose(state, t)
            if node is None:
                why = "; ".join(state.errors) or self.pool.describe_down() or "no prefill node configured"
                self._abandon(rid, f"no prefill node could prefill request {rid}: {why}")
                return
            assert node.peer is not None   # choose() offers only nodes whose fabric engine we know
            try:   # the write count follows from that node's TP split into ours (D14)
                ticket = self.receiver.address(ticket, node.tp_size, prefill_engine=node.peer.engine_id)
            except ValueError as e:
                self._abandon(rid, f"request {rid} cannot be prefilled on {node.address} (tp_size {node.tp_size}): {e}")
                return
            state.tried.add(node.address)
            t.ticket, t.node, t.prefill_engine_id = ticket, node, node.peer.engine_id
            state.prefilled_on = node.address
            result = await self.watch.prefill_on(self.pool, node, state, ticket)
            self._after_call(state, t, ticket, node, result.ok, result.error)
        except asyncio.CancelledError:
            # The client went away: the attempt's pages stay quarantined until nothing can land.
            if t.node is not None and not t.ready.is_set():
                self._quarantine(state, t, ticket, t.node, retry=False, error=f"request {rid} cancelled")
            elif t.rejected:   # landed with a rejected record: nothing more can land, its pages go now
                why, tag = t.rejected, ticket.imm_tag
                self._submit(lambda: self._checksum_failed(rid, tag, False, why))
            elif t.node is None:   # cancelled before it was sent anywhere: nothing can land
                self._submit(lambda: self._fail_waiting(rid, f"request {rid} cancelled"))
            raise
        finally:
            if state.handler_done and state.transfer is t:
                self.requests.forget(state)

    def _after_call(self, state: RequestState, t: Attempt, ticket: TransferTicket, node: PrefillTarget,
                    ok: bool, err: str) -> None:
        """The attempt's Prefill call ended: done, a corrupt landing (no hold), or quarantined."""
        if ok:   # a later attempt (a preempted request prefilled again) may use this node again
            state.tried.discard(node.address)
            return
        if t.corrupt:   # S7: landed but wrong; nothing more can land, so no quarantine
            self._checksum_failed_attempt(state, ticket, node, err)
            return
        if t.rotated:   # not the node's fault: it may take the next attempt
            state.tried.discard(node.address)
        state.errors.append(f"{node.address}: {err}")
        msg = f"prefill on {node.address} failed ({err})"
        logger.warning("request %s attempt %d: %s; its pages are quarantined%s", state.request_id, ticket.attempt,
                       msg, "" if state.handler_done else ", retrying in fresh pages")
        self._quarantine(state, t, ticket, node, retry=not state.handler_done, error=msg)

    def _quarantine(self, state: RequestState, t: Attempt, ticket: TransferTicket, node: PrefillTarget,
                    retry: bool, error: str) -> None:
        q = Quarantine(request_id=state.request_id, attempt=ticket.attempt,
                       quarantine_id=f"{state.request_id}#{ticket.attempt}", node=node,
                       decode_engine_id=self.transport.engine_id, prefill_engine_id=t.prefill_engine_id,
                       peer=node.peer, since=time.monotonic(), key_gen=t.key_gen)
        self._submit(lambda: self.holds.quarantine_attempt(q, retry, error))
