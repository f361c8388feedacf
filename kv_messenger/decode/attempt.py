"""One attempt at a request's prompt KV, and the Prefill call that fills it.

`Attempt` is one attempt's state (ticket, chosen prefill node, deadline, timings, what it found):
D20, every attempt at a request has its own number, tag and context slot. `RequestState` is what a
decode node tracks of one request across its attempts (which nodes failed it, why), `RequestTable`
every request's while its handler runs. `PrefillWatch`
makes one attempt's Prefill call and watches it: its deadline (`prefill_timeout_s`), a stall (no
write landed and the node answered no GetNodeInfo for `stall_s`), a key rotation under it, then
the write count (KV_LANDED_WAIT_S), S7's verification and D19's context-record rejection. Why a
failed attempt must be quarantined, not freed: docs/transfer-safety.md ("The attempt").

Threads: the serving loop (one transfer task per request); the verification runs in a worker thread.

Blocking waits, with their bounds: a Prefill call (`prefill_timeout_s`, cut short by a stall after
`stall_s`, polled every STALL_POLL_S); the write count after a successful Prefill (KV_LANDED_WAIT_S);
with --kv-checksum, the count after the response (KV_LANDED_WAIT_S) and one verification (a hash of
the request's pages, in a worker thread); a finished request's wait for its Prefill response
(PREFILL_RESPONSE_WAIT_S, RequestTable.prefill_outcome).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_messenger.decode.client import UNAVAILABLE, PrefillClient, PrefillTarget, RpcError, TransferTelemetry
from kv_messenger.decode.rotation import KeyRotation
from kv_messenger.receiver import KvReceiver
from kv_messenger.ticket import TransferTicket, remote_to_bytes
from kv_messenger.transport import TransferEngine
from pdserve.engine.faults import BAD_SHARD_KEY_ENV, NO_FAULTS, FaultPlan
from pdserve_api.v1 import prefill_pb2

logger = logging.getLogger(__name__)

KV_LANDED_WAIT_S = 10.0      # after a successful Prefill: the write count completes within this
STALL_POLL_S = 0.25          # a Prefill call's progress is looked at this often


@dataclass(frozen=True)
class PrefillOutcome:
    """A successful remote prefill, as the final message reports it."""

    call_start: float      # time.monotonic() of the Prefill call
    prefill_s: float       # prefill-side time from receipt to the last layer done
    tail_s: float          # the rest until the write count completed here
    cached_tokens: int     # prompt tokens the prefill node took from its prefix cache (not computed)


@dataclass(frozen=True)
class AttemptResult:
    """How one attempt's Prefill call ended: ok, or why not."""

    ok: bool
    error: str = ""


LANDED = AttemptResult(True)


@dataclass
class Attempt:
    """One attempt at a request's prompt KV on its way here (loop-owned)."""

    token_ids: tuple[int, ...]                # prompt minus its last token
    attempt: int = 0
    ticket: TransferTicket | None = None      # as sent (addressed to its prefill node's TP split)
    task: asyncio.Task | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    node: PrefillTarget | None = None         # the prefill node it was sent to (None: not sent yet)
    prefill_engine_id: str = ""               # the fabric engine of the process it was sent to
    call_start: float = 0.0                   # time.monotonic() of its Prefill call
    deadline: float = 0.0                     # time.monotonic() its Prefill call's deadline passes
    ready_time: float = 0.0
    tag: int = 0                              # the attempt's imm tag (its landing names it)
    landed: asyncio.Event = field(default_factory=asyncio.Event)   # S7: the count completed, not verified yet
    corrupt: bool = False                     # S7: its checksums did not match (or could not be checked),
                                              # or (D19) its context record was rejected
    rejected: str = ""                        # D19: why its context record was rejected ('' if it was not);
                                              # `ready` is then set too, to wake the loop at once
    started: bool = False                     # its task began running (a task cancelled before that never does)
    key_gen: int = 0                          # the memory-key generation its ticket names (key rotation)
    rotated: bool = False                     # failed over because a key rotation closed its key
    outcome: PrefillOutcome | None = None     # its successful remote prefill


@dataclass
class RequestState:
    """What the node tracks for one request while its Generate handler runs."""

    request_id: str
    admitted: float = 0.0                     # pages allocated (written once, by the engine thread)
    transfer: Attempt | None = None           # its current attempt
    prefilled_on: str = ""                    # address of the prefill node last asked
    outcome: PrefillOutcome | None = None     # its successful remote prefill
    handler_done: bool = False                # kept only until its transfer task ends
    tried: set[str] = field(default_factory=set)     # prefill nodes its attempts failed on (or run on now)
    errors: list[str] = field(default_factory=list)  # why each failed
    checksum_failures: int = 0                # S7 / D19: attempts whose landed bytes or context record were wrong


@dataclass(frozen=True)
class WatchSettings:
    """The Prefill call's bounds and identity (from DecodeNodeConfig)."""

    node_id: str
    prefill_timeout_s: float
    stall_s: float
    faults: FaultPlan = NO_FAULTS


class PrefillWatch:
    """Makes and watches one attempt's Prefill call (loop-owned)."""

    def __init__(self, settings: WatchSettings, transport: TransferEngine, receiver: KvReceiver,
                 rotation: KeyRotation, telemetry: TransferTelemetry, verified: Callable[[str, int], None]) -> None:
        self.settings = settings
        self.transport = transport
        self.receiver = receiver
        self.rotation = rotation
        self.telemetry = telemetry
        self._verified = verified   # S7: the attempt (request id, tag) matched: make it schedulable
        self.model_name = ""        # the transfer metrics' label, set once the engine is built

    async def prefill_on(self, pool: PrefillClient, node: PrefillTarget, state: RequestState,
                         ticket: TransferTicket) -> AttemptResult:
        """One Prefill call, watched for progress: ok once the KV landed; else the reason when it
        failed, its deadline passed, or it stalled (no write landed and the node answered no
        GetNodeInfo for `stall_s`)."""
        assert state.transfer is not None
        t = state.transfer
        timeout = self.settings.prefill_timeout_s
        req = ticket.to_pb(list(t.token_ids), self.transport.peer_descriptor, "", timeout)
        req.decode_node_id = self.settings.node_id   # under mTLS, checked against our certificate (S9)
        self._test_bad_shard_key(req, ticket)
        if t.key_gen < self.rotation.generation:   # prepared before a rotation: its keys are closed, never sent
            t.rotated = True
            return AttemptResult(False, "its memory key was rotated before it was sent")
        node.sent_tokens += len(t.token_ids)
        t.call_start = call_start = time.monotonic()
        t.deadline = call_start + timeout
        call = asyncio.ensure_future(node.prefill(req, timeout))
        try:
            stopped = await self._watch(pool, node, t, call, state.request_id)
            if stopped is not None:
                return stopped
            return await self._landed(state, ticket, call.result(), node)
        except RpcError as e:
            if t.ready.is_set():
                return AttemptResult(False, t.rejected) if t.rejected else LANDED
            if e.code == UNAVAILABLE:
                pool.mark_down(node, e.details or "unavailable")
            return AttemptResult(False, f"{e.code}: {e.details}")
        except asyncio.TimeoutError:
            return AttemptResult(False, "Prefill returned but the write count did not complete within "
                                        f"{KV_LANDED_WAIT_S:.0f} s")
        finally:
            if not call.done():
                call.cancel()
            node.sent_tokens -= len(t.token_ids)

    async def _watch(self, pool: PrefillClient, node: PrefillTarget, t: Attempt, call: asyncio.Future,
                     rid: str) -> AttemptResult | None:
        """Until the call returns (None): every STALL_POLL_S, whether a rotation closed its key or it
        stalled; then the call is cancelled and the failure returned."""
        stall_s = self.settings.stall_s
        landed, progress = 0, t.call_start
        while True:
            done, _ = await asyncio.wait({call}, timeout=STALL_POLL_S)
            if done:
                return None
            now = time.monotonic()
            n = self.receiver.landed(rid)
            if n != landed or t.ready.is_set() or t.landed.is_set():
                landed, progress = n, now
            if t.key_gen < self.rotation.generation and not t.ready.is_set():
                call.cancel()   # its writes are refused from now on: fail over at once
                t.rotated = True
                return AttemptResult(False, "this node's memory key was rotated (a prefill host stopped answering)")
            if now - max(progress, node.last_answer) > stall_s:
                call.cancel()
                pool.mark_down(node, f"stalled: no write landed and no GetNodeInfo answer for {stall_s:g} s")
                return AttemptResult(False, f"stalled for {stall_s:g} s (no write landed, no health answer)")

    async def _landed(self, state: RequestState, ticket: TransferTicket, resp: prefill_pb2.PrefillResponse,
                      node: PrefillTarget) -> AttemptResult:
        """The Prefill call returned: S7's verification, the write count, D19's verdict, the outcome."""
        assert state.transfer is not None
        t = state.transfer
        if ticket.kv_checksum:   # S7: schedulable only once what landed matches what was sent
            await asyncio.wait_for(t.landed.wait(), timeout=KV_LANDED_WAIT_S)
            bad = await self._verify(state, ticket, resp, node)
            if bad:
                t.corrupt = True
                return AttemptResult(False, bad)
            self._verified(state.request_id, ticket.imm_tag)
        await asyncio.wait_for(t.ready.wait(), timeout=KV_LANDED_WAIT_S)  # writes delivered: the count follows
        if t.rejected:   # D19: landed, but its context record is not this attempt's
            return AttemptResult(False, t.rejected)
        # Prefill-side time from receipt to the last layer done; the rest until the count
        # completed here is the transfer tail (loopback RPC latency included).
        prefill_s = resp.timings.queue_time_s + resp.timings.compute_time_s
        t.outcome = state.outcome = PrefillOutcome(t.call_start, prefill_s, t.ready_time - t.call_start - prefill_s,
                                                   resp.prefill_cached_tokens)
        model = self.model_name
        self.telemetry.kv_transfer_bytes.labels(model_name=model, side="decode").inc(resp.bytes_written)
        self.telemetry.kv_transfer_seconds.labels(model_name=model, side="decode").observe(
            t.ready_time - t.call_start)
        return LANDED

    async def _verify(self, state: RequestState, ticket: TransferTicket, resp: prefill_pb2.PrefillResponse,
                      node: PrefillTarget) -> str:
        """S7: '' when what landed matches the sender's checksums, else why not (logged, counted)."""
        rid = state.request_id
        try:
            res = await asyncio.to_thread(self.receiver.verify, rid, ticket.imm_tag, resp.kv_checksums,
                                          resp.num_kv_checksums)
        except (KeyError, ValueError) as e:
            self.telemetry.kv_checksum_failures.inc()
            logger.error("request %s attempt %d: KV checksums from %s unusable: %s", rid, ticket.attempt,
                         node.address, e)
            return f"KV checksums unusable: {e}"
        self.telemetry.kv_checksums_verified.inc()
        if res.ok:
            logger.debug("request %s attempt %d: %d KV checksums match", rid, ticket.attempt, res.runs)
            return ""
        self.telemetry.kv_checksum_failures.inc()
        assert res.mismatch is not None
        logger.error("request %s attempt %d: KV checksum mismatch on the transfer from %s: %s", rid,
                     ticket.attempt, node.address, res.mismatch.describe())
        return f"KV checksum mismatch: {res.mismatch.describe()}"

    def _test_bad_shard_key(self, req: prefill_pb2.PrefillRequest, ticket: TransferTicket) -> None:
        """TEST ONLY (FaultPlan.bad_shard_key): name one decode rank's pool under a key nothing
        registered, so that (tcp;ofi_rxm: the target checks keys) that rank's writes are refused
        while the other ranks' land: one shard of the transfer fails mid-way. No effect without a plan."""
        for rank in self.settings.faults.bad_key_ranks(ticket.request_id, ticket.attempt):
            if rank >= len(req.kv_memory):
                raise ValueError(f"{BAD_SHARD_KEY_ENV}: rank {rank}, but this node has "
                                 f"{len(req.kv_memory)} KV ranks")
            good = ticket.rank_kv(rank)
            req.kv_memory[rank].descriptor = remote_to_bytes(dataclasses.replace(good, key=good.key ^ 0x5A5A5A))
            logger.warning("TEST ONLY (%s): request %s attempt %d: decode rank %d's pool sent under a wrong key",
                           BAD_SHARD_KEY_ENV, ticket.request_id, ticket.attempt, rank)


# A request whose KV has landed may finish before its Prefill response is processed (a one-token
# answer): its final message waits this long at most for the response's timings and cached count.
PREFILL_RESPONSE_WAIT_S = 10.0


class RequestTable:
    """One RequestState per request while its Generate handler runs, and until its transfer task
    ends (loop-owned; the engine thread only reads it, in DecodeTransfers.ticket_ready)."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def get(self, rid: str) -> RequestState | None:
        return self._states.get(rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def states(self) -> list[RequestState]:
        return list(self._states.values())

    def begin(self, rid: str) -> RequestState:
        """A Generate handler starts serving `rid`; ValueError if the id is in use here."""
        if rid in self._states:
            raise ValueError(f"request id {rid!r} is already in use")
        state = self._states[rid] = RequestState(rid)
        return state

    def orphan(self, rid: str) -> RequestState:
        """The state of a transfer whose handler is gone already: the transfer still runs, to end safely."""
        state = self._states[rid] = RequestState(rid, handler_done=True)
        return state

    def end(self, state: RequestState) -> None:
        """The handler of `state` is done: stop a transfer whose KV never landed; the state goes
        now, or when its transfer task ends."""
        state.handler_done = True
        t = state.transfer
        if t is not None and t.task is not None and not t.task.done():
            if not t.ready.is_set():
                t.task.cancel()
            return
        self.forget(state)

    def forget(self, state: RequestState) -> None:
        if self._states.get(state.request_id) is state:
            del self._states[state.request_id]

    async def prefill_outcome(self, state: RequestState) -> PrefillOutcome | None:
        """The successful remote prefill of a request that is finishing, if it had one.

        Its KV landed (so it could decode) but the Prefill response may not be processed yet: wait
        for the transfer task, at most PREFILL_RESPONSE_WAIT_S. A transfer whose KV never landed
        (aborted, failed, prefilled locally) is not waited for."""
        t = state.transfer
        if t is not None and t.task is not None and t.ready.is_set() and not t.task.done():
            done, _ = await asyncio.wait({t.task}, timeout=PREFILL_RESPONSE_WAIT_S)
            if not done:
                logger.warning("request %s: no Prefill response %.0f s after its KV landed; timings and "
                               "cached prompt tokens reported as 0", state.request_id, PREFILL_RESPONSE_WAIT_S)
        outcome, state.outcome = state.outcome, None
        return outcome
