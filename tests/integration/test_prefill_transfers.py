"""PrefillTransfers' AbortPrefill answers and its registry, in one process over real shm fabric.

The prefill side's KvSender (tests/support/sender_pair.py, hand-made scheduler passes, no model)
behind a real `PrefillTransfers`; the engine side (`HeldPages`) is the test's, recording what the
release asks of it. Each row of docs/transfer-prefill-side.md's AbortPrefill table that one
process can reach for real is driven and its answer asserted; afterwards nothing is active and the
tombstones are bounded. Every wait is bounded (WAIT_S; the abort's own `timeout`).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from support.sender_pair import SenderPair

from kv_messenger import TransferTicket, prefill_transfers as pt
from kv_messenger.prefill_transfers import AbortedError, AbortOutcome, AbortSpec, PrefillTransfers
from kv_messenger.ticket import TransferKey
from pdserve import SamplingParams
from pdserve.engine.cache.hostmem import alloc_buffer
from pdserve.engine.request import Request, TransferRole
from pdserve.engine.scheduler.output import ScheduledChunk

WAIT_S = 10.0
N_PREFILL = 8                        # tokens: two pages of SMALL (page_size 4)
SRC_PAGES, DST_PAGES = [0, 1], (4, 5)


class _Pages:
    """The engine side of the transfers (HeldPages): records each call; `gate` (when set) holds
    `stop` the way a long engine step would."""

    def __init__(self) -> None:
        self.stopped: list[str] = []
        self.freed: list[str] = []
        self.gate: asyncio.Event | None = None

    async def stop(self, engine_request_id: str) -> bool:
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), WAIT_S)
        self.stopped.append(engine_request_id)
        return False

    async def free(self, engine_request_id: str) -> int:
        self.freed.append(engine_request_id)
        return 0


class _Rig:
    def __init__(self) -> None:
        self.pair = SenderPair(SRC_PAGES)
        self.transfers = PrefillTransfers(self.pair.fab_p, self.pair.sender)
        self.pages = _Pages()
        self.decode_id = self.pair.fab_d.engine_id
        self.fence_buf = alloc_buffer(64, huge_pages=False)
        self.fence_region = self.pair.fab_d.register(self.fence_buf.view)
        self._tags = iter(range(0x100, 0x10000))

    def key(self, rid: str, attempt: int = 0) -> TransferKey:
        return TransferKey(self.decode_id, rid, attempt)

    def ticket(self, key: TransferKey) -> TransferTicket:
        return self.pair.target(key.engine_request_id, DST_PAGES, N_PREFILL, tag=next(self._tags))

    async def begin(self, key: TransferKey, ticket: TransferTicket | None = None) -> pt.PrefillTransfer:
        t = await self.transfers.begin(key, ticket or self.ticket(key), self.pair.fab_d.peer_descriptor, 0.0)
        t.queued.set()   # the node queues its engine request in this loop turn
        return t

    def prefill(self, t: pt.PrefillTransfer) -> None:
        """The engine's one pass over the transfer's prompt, then its prefill's end."""
        req = Request(t.request_id, list(range(1, N_PREFILL + 1)), SamplingParams(max_tokens=1),
                      max_total_tokens=4096, role=TransferRole.PREFILL)
        self.pair.run_pass([ScheduledChunk(req, start=0, num_tokens=N_PREFILL, samples=False)])
        self.pair.prefill_done(req, torch.zeros(16), torch.zeros(50))   # hidden [16], logits [50]

    def spec(self, key: TransferKey, fence_tag: int = 0, engine_id: str | None = None) -> AbortSpec:
        return AbortSpec(key, engine_id or self.pair.fab_p.engine_id, fence_tag,
                         self.fence_region.descriptor if fence_tag else None)

    def close(self) -> None:
        self.pair.close()


async def _released(t: pt.PrefillTransfer) -> None:
    await asyncio.wait_for(t.released.wait(), WAIT_S)


async def _run(rig: _Rig) -> None:
    transfers, pages = rig.transfers, rig.pages
    transfers.start(asyncio.get_running_loop(), pages)

    # WRONG_ENGINE: the call names another prefill engine (a restart at this address)
    other = rig.key("other")
    assert await transfers.abort(rig.spec(other, engine_id="not-this-engine")) == AbortOutcome(False, pt.WRONG_ENGINE)

    # unknown: remembered as refused, UNKNOWN unconfirmed; asked again REFUSED confirmed; its
    # Prefill arriving later is refused with ABORTED and nothing is added to the sender
    unknown = rig.key("unknown")
    assert await transfers.abort(rig.spec(unknown)) == AbortOutcome(False, pt.UNKNOWN)
    assert await transfers.abort(rig.spec(unknown)) == AbortOutcome(True, pt.REFUSED)
    with pytest.raises(AbortedError, match="attempt 0 was aborted before its Prefill arrived"):
        await rig.begin(unknown)
    assert len(transfers) == 0 and rig.pair.sender.outstanding_requests() == 0

    # FINISHED: every write completed locally, one release, tombstoned; confirmed without a fence,
    # and with one that lands where writes are ordered (shm grants FI_ORDER_WAW)
    done_key = rig.key("done")
    ticket = rig.ticket(done_key)
    t = await rig.begin(done_key, ticket)
    rig.prefill(t)
    assert await asyncio.to_thread(rig.pair.fired.get, timeout=WAIT_S) == ticket.imm_tag   # every write landed
    await _released(t)
    assert transfers.result(t).num_writes == ticket.expected_writes
    assert pages.freed == [t.request_id] and len(transfers) == 0
    assert await transfers.abort(rig.spec(done_key)) == AbortOutcome(True, pt.FINISHED)
    assert rig.pair.fab_p.writes_ordered
    landed = asyncio.Event()
    loop = asyncio.get_running_loop()
    fence_tag = 0x7E57
    rig.pair.fab_d.imm_counter.expect(fence_tag, 1, lambda _tag: loop.call_soon_threadsafe(landed.set))
    assert await transfers.abort(rig.spec(done_key, fence_tag)) == AbortOutcome(True, pt.FINISHED, fence_posted=True)
    await asyncio.wait_for(landed.wait(), WAIT_S)

    # the same key twice is refused (a retry takes a new attempt); the new attempt is a new transfer
    with pytest.raises(ValueError, match="was sent here before"):
        await rig.begin(done_key)
    retry = await rig.begin(rig.key("done", attempt=1))
    assert len(transfers) == 1

    # active: AbortPrefill aborts it and waits for its release, then answers from its tombstone
    assert await transfers.abort(rig.spec(retry.key)) == AbortOutcome(True, pt.FINISHED)
    assert retry.released.is_set() and retry.request_id in pages.stopped and retry.request_id in pages.freed
    assert transfers.result(retry) is None   # aborted: no TransferResult

    # active past the abort's timeout (its engine step outlasts it): ACTIVE, unconfirmed; once the
    # release comes, the same key answers from its tombstone
    slow_key = rig.key("slow")
    slow = await rig.begin(slow_key)
    pages.gate = asyncio.Event()
    assert await transfers.abort(rig.spec(slow_key), timeout=0.2) == AbortOutcome(False, pt.ACTIVE)
    assert not slow.released.is_set() and len(transfers) == 1
    pages.gate.set()
    await _released(slow)
    pages.gate = None
    assert await transfers.abort(rig.spec(slow_key)) == AbortOutcome(True, pt.FINISHED)

    # CONNECTION_FAILED: a transfer whose writes fail at the fabric (a ticket naming the decode
    # pool under a wrong memory key): its peer is retired (the connection generation moves on),
    # its tombstone and every earlier one of that peer answer unconfirmed
    failed_key = rig.key("failed")
    ticket = rig.ticket(failed_key)
    bad = dataclasses.replace(ticket, kv=dataclasses.replace(ticket.kv, key=ticket.kv.key ^ 0x5A5A5A))
    epoch = transfers.peers.epochs.get(rig.decode_id)
    failed = await rig.begin(failed_key, bad)
    rig.prefill(failed)
    await _released(failed)
    assert transfers.peers.epochs.get(rig.decode_id) != epoch
    assert await transfers.abort(rig.spec(failed_key)) == AbortOutcome(False, pt.CONNECTION_FAILED)
    assert await transfers.abort(rig.spec(done_key, fence_tag + 1)) == AbortOutcome(False, pt.CONNECTION_FAILED)

    # the registry: nothing active, every key that began tombstoned once, bounded
    assert len(transfers) == 0 and rig.pair.sender.outstanding_requests() == 0
    assert len(transfers._finished) == 4 <= pt.REMEMBERED_FINISHED   # done, done#1, slow, failed
    assert len(transfers._aborted) == 1 <= pt.REMEMBERED_ABORTS


def test_abort_prefill_answers_and_the_registry():
    rig = _Rig()
    try:
        asyncio.run(asyncio.wait_for(_run(rig), 60))
    finally:
        rig.close()


def test_tombstones_and_refused_keys_are_bounded(monkeypatch):
    """The oldest tombstone / refused key is forgotten past its bound; a forgotten key answers as
    unknown (never confirmed the first time)."""
    monkeypatch.setattr(pt, "REMEMBERED_FINISHED", 2)
    monkeypatch.setattr(pt, "REMEMBERED_ABORTS", 2)
    rig = _Rig()

    async def run() -> None:
        transfers = rig.transfers
        transfers.start(asyncio.get_running_loop(), rig.pages)
        keys = [rig.key(f"r{i}") for i in range(3)]
        for k in keys:
            t = await rig.begin(k)
            assert await transfers.abort(rig.spec(k)) == AbortOutcome(True, pt.FINISHED)
            assert t.released.is_set()
        assert list(transfers._finished) == keys[1:]
        assert await transfers.abort(rig.spec(keys[0])) == AbortOutcome(False, pt.UNKNOWN)   # forgotten
        refused = [rig.key(f"u{i}") for i in range(3)]
        for k in refused:
            assert await transfers.abort(rig.spec(k)) == AbortOutcome(False, pt.UNKNOWN)
        assert list(transfers._aborted) == refused[1:]
        assert await transfers.abort(rig.spec(refused[0])) == AbortOutcome(False, pt.UNKNOWN)   # forgotten too

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        rig.close()
