"""Who wrote a KV write (issue 15 item 6, S9): the decode side counts a write toward a transfer only
if the prefill engine it dispatched the transfer to wrote it, where the provider names writers
(fabric.imm, ImmCounter.names_writers).

Evidence:
- real endpoints, every provider here: the writer address each immediate-data event reports
  (csrc PDF_EV_IMM's aux, from fi_cq_readfrom) is compared with the writers' real addresses in the
  receiver's AV, and the capability flag must say exactly what was seen. On shm and tcp;ofi_rxm
  (libfabric 1.17) two writers at distinct AV addresses are reported at one and the same address,
  so the flag is off there (fabric/imm.py cites the provider code);
- real endpoints where writers are named (efa, an RDMA NIC: skipped elsewhere): a third engine that
  knows the decode pool's key writes into it with a live transfer's tag: counted stale, the
  transfer's count not advanced; the dispatched engine's writes still complete it;
- the receiver's rule itself, with the arrivals a writer-naming provider reports (none on this
  machine, so the test reports them as the progress thread would, into the ImmCounter the receiver
  reads): writes kept before the ticket is addressed are split by writer when it is, another
  engine's and an unknown address's never count toward a transfer, a fence or a quarantine and
  are stale, the dispatched engine's complete it; without writer names every write counts, as
  before.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from support.kv_events import QueueEvents
from support.wait import wait_until

from fabric import FabricConfig, FabricError, PageWrites, TransferEngine
from fabric._libfabric import lib
from fabric.imm import WRITER_UNKNOWN, ImmCounter, provider_names_writers
from kv_messenger import KvReceiver
from pdserve.engine.cache.hostmem import alloc_buffer, alloc_tensor
from pdserve.engine.cache.kv_cache import KVCacheShape
from pdserve.engine.kv_connector import AttentionGroupSpec, KvCacheSpec

MiB = 1 << 20
PROVIDERS = ["shm", "tcp;ofi_rxm"]


def _engines(provider: str, n: int) -> list[TransferEngine]:
    config = FabricConfig(provider=provider, node=None if provider in ("shm", "efa") else "127.0.0.1")
    return [TransferEngine(config) for _ in range(n)]


def _record_sources(engine: TransferEngine) -> list[tuple[int, int]]:
    """(tag, reported writer address) of every immediate-data event of rail 0 from now on."""
    seen: list[tuple[int, int]] = []
    ep = engine._ep
    inner = ep._dispatch

    def dispatch(ev) -> None:
        if ev.kind == lib.PDF_EV_IMM:
            seen.append((int(ev.id), int(ev.aux)))
        inner(ev)

    ep._dispatch = dispatch
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_writer_flag_says_what_the_provider_reports(provider: str) -> None:
    d, a, b = _engines(provider, 3)
    try:
        seen = _record_sources(d)
        dst = d.register(alloc_buffer(MiB, huge_pages=False).view)
        for e in (a, b):
            d.connect(e.peer_descriptor)   # both in d's AV, at distinct addresses
        at = {e.engine_id: d._peers.resolve(e.peer_descriptor, hello=False) for e in (a, b)}
        assert len(set(at.values())) == 2, at
        for i, e in enumerate((a, b)):
            src = e.register(alloc_buffer(MiB, huge_pages=False).view)
            e.write_sync(PageWrites(src, [0], dst.descriptor, [4096 * i], [4096], 100 + i), timeout=10)
        wait_until(lambda: d.imm_counter.landed(100) == 1 and d.imm_counter.landed(101) == 1, 10,
                   "both writes to land")
        reported = {tag: addr for tag, addr in seen if tag in (100, 101)}
        named = reported == {100: at[a.engine_id], 101: at[b.engine_id]}
        assert d.imm_counter.names_writers == named == provider_names_writers(provider, d._ep.source_addr), (
            provider, reported, at)
        if provider in PROVIDERS:   # libfabric 1.17 here: one address for both writers (fabric/imm.py)
            assert not named and len(set(reported.values())) == 1, reported
    finally:
        for e in (a, b, d):
            e.close()


# --- the receiver ---------------------------------------------------------------------------------

PAGE_SIZE, HEAD_DIM, LAYERS, PAGES = 4, 8, 2, 8


def _receiver(fab: TransferEngine, events: QueueEvents) -> KvReceiver:
    rx = KvReceiver(fab, events)
    shape = KVCacheShape(LAYERS, PAGES, 1, PAGE_SIZE, HEAD_DIM)
    pool = alloc_tensor((LAYERS, 2, PAGES, 1, PAGE_SIZE, HEAD_DIM), torch.float32, huge_pages=False)
    rx.register_kv_cache(KvCacheSpec(buffer=pool, shape=shape, dtype=torch.float32,
                                     groups=(AttentionGroupSpec("full", tuple(range(LAYERS)), None),),
                                     hidden_size=16, model_name="test"))
    return rx


class _Stale(QueueEvents):
    def __init__(self) -> None:
        super().__init__()
        self.stale: list[tuple[int, int]] = []

    def kv_stale_write(self, tag: int, count: int) -> None:
        self.stale.append((tag, count))


@pytest.mark.timeout(60)
@pytest.mark.rdma
def test_a_third_engine_writing_a_live_tag_is_stale_where_writers_are_named() -> None:
    try:
        d, p, x = _engines("efa", 3)
    except FabricError as exc:
        pytest.skip(f"no efa NIC here: {exc}")
    try:
        if not d.imm_counter.names_writers:
            pytest.fail(f"efa should name writers (fabric/imm.py); source_addr={d._ep.source_addr}")
        events = _Stale()
        rx = _receiver(d, events)
        ticket = rx.address(rx.prepare("r", 2 * PAGE_SIZE + 1, [1, 2], prefill_tp=None), 1,
                            prefill_engine=p.engine_id)
        n = ticket.expected_writes
        for e in (p, x):
            e.connect(d.peer_descriptor)
        page = LAYERS * 2 * PAGES * PAGE_SIZE * HEAD_DIM * 4 // (LAYERS * 2 * PAGES)
        src_x = x.register(alloc_buffer(MiB, huge_pages=False).view)
        x.write_sync(PageWrites(src_x, [0], ticket.kv, [0], [page], ticket.imm_tag), timeout=10)
        wait_until(lambda: rx.stale_writes == 1, 10, "the third engine's write to be counted stale")
        assert rx.landed("r") == 0 and events.jobs.empty()
        src_p = p.register(alloc_buffer(MiB, huge_pages=False).view)
        offs = np.arange(n, dtype=np.uint64) * page
        p.write_sync(PageWrites(src_p, offs, ticket.kv, offs, np.full(n, page, dtype=np.uint64), ticket.imm_tag,
                                imm_mode="every"), timeout=10)
        assert events.jobs.get(timeout=10) == ("ready", "r")
        assert rx.stale_writes == 1 and events.stale == [(ticket.imm_tag, 1)]
        rx.finish("r")
    finally:
        for e in (x, p, d):
            e.close()


@pytest.mark.timeout(60)
def test_the_receiver_counts_only_the_dispatched_engines_writes() -> None:
    (fab,) = _engines("shm", 1)
    try:
        assert not fab.imm_counter.names_writers   # shm: writers not named (the test above)
        plain = _receiver(fab, _Stale())
        t = plain.address(plain.prepare("plain", 2 * PAGE_SIZE + 1, [1, 2], prefill_tp=None), 1,
                          prefill_engine="p" * 32)
        fab.imm_counter.on_landed(t.imm_tag, t.expected_writes, "x" * 32)   # not named: counted, as before
        assert plain.events.jobs.get(timeout=5) == ("ready", "plain") and plain.stale_writes == 0
        plain.finish("plain")

        # what a writer-naming provider's progress thread reports, into the counter the receiver reads
        counter = fab._imm = ImmCounter(names_writers=True)
        events = _Stale()
        rx = _receiver(fab, events)
        dispatched, third = "a" * 32, "b" * 32
        unaddressed = rx.prepare("r", 2 * PAGE_SIZE + 1, [1, 2], prefill_tp=None)
        tag = unaddressed.imm_tag
        counter.on_landed(tag, 1, dispatched)   # before the ticket is addressed: kept, by writer
        counter.on_landed(tag, 2, third)
        assert rx.stale_writes == 0 and counter.landed(tag) == 3
        ticket = rx.address(unaddressed, 1, prefill_engine=dispatched)
        n = ticket.expected_writes
        assert n >= 3
        assert rx.stale_writes == 2 and events.stale == [(tag, 2)] and rx.landed("r") == 1
        counter.on_landed(tag, n, third)          # enough to complete it, from the wrong engine
        counter.on_landed(tag, 1, WRITER_UNKNOWN)  # an address in no AV entry
        assert rx.landed("r") == 1 and events.jobs.empty()
        assert rx.stale_writes == 2 + n + 1 and counter.foreign == 2 + n + 1
        counter.on_landed(tag, n - 1, dispatched)
        assert events.jobs.get(timeout=5) == ("ready", "r")
        rx.finish("r")

        # a quarantine: the dispatched engine's late writes are harmless, another's are stale
        q = rx.address(rx.prepare("q", 2 * PAGE_SIZE + 1, [3, 4], prefill_tp=None), 1, prefill_engine=dispatched)
        rx.quarantine("q")
        counter.on_landed(q.imm_tag, 1, dispatched)
        assert rx.quarantined_writes == 1
        before = rx.stale_writes
        counter.on_landed(q.imm_tag, 1, third)
        assert rx.stale_writes == before + 1 and rx.quarantined_writes == 1
        rx.release_quarantined(q.imm_tag)

        # a fence bound to the engine being aborted: only its write lands it
        landed = threading.Event()
        ftag, _region = rx.expect_fence(landed.set, writer=dispatched)
        counter.on_landed(ftag, 1, third)
        assert not landed.is_set() and rx.stale_writes == before + 2
        counter.on_landed(ftag, 1, dispatched)
        assert landed.is_set()
        rx.retire_fence(ftag)
        counter.on_landed(ftag, 1, dispatched)   # a late fence of the right engine: harmless
        assert rx.stale_writes == before + 2
        counter.on_landed(ftag, 1, third)        # of another: stale
        assert rx.stale_writes == before + 3
        assert rx.num_tags_in_use == rx.num_slots_in_use == rx.num_quarantined == rx.num_waiting == 0
    finally:
        fab.close()
