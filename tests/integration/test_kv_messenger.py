"""The KV messenger between two real engines over real libfabric (shm) in one process.

A prefill-only engine with a KvSender pushes pages layer by layer into a remote-prefill engine's
pages through its KvReceiver; the decode engine becomes schedulable only when the immediate-data
count completes, and its greedy output equals a single engine's. Writes of layer 0 are posted
before the last layer of the same pass finishes (transfer overlaps compute, D8).
"""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import torch
from support.kv_events import QueueEvents
from support.sender_pair import SMALL, SenderPair
from support.side_jobs import pump

from fabric import FabricConfig, TransferEngine
from kv_messenger import KvLayout, KvReceiver, KvSender, ShardingScheme, TransferTicket
from kv_messenger.context import ContextEncodeError, ContextRecordError, ExpectedRecord, TransferIdentity
from kv_messenger.plan import completed_pages, expected_writes
from kv_messenger.sender import PassFailedError, PostError
from pdserve import LLM, SamplingParams
from pdserve.engine.cache.hostmem import alloc_tensor
from pdserve.engine.cache.kv_cache import KVCacheShape
from pdserve.engine.kv_connector import AttentionGroupSpec, KvCacheSpec
from pdserve.engine.request import Request, RequestStatus, TransferRole
from pdserve.engine.scheduler.output import ScheduledChunk


def test_completed_pages_and_expected_counts():
    # page_size 4, prefill of 10 tokens in chunks [0,3) [3,8) [8,10)
    assert list(completed_pages(0, 3, 10, 4)) == []
    assert list(completed_pages(3, 8, 10, 4)) == [0, 1]
    assert list(completed_pages(8, 10, 10, 4)) == [2]          # last chunk sends the partial page
    assert list(completed_pages(0, 10, 10, 4)) == [0, 1, 2]
    assert list(completed_pages(0, 8, 8, 4)) == [0, 1]
    layout = KvLayout(30, 100, 3, 16, 64, "float32")
    assert expected_writes(511, layout, ShardingScheme(), ShardingScheme()) == 32 * 30 * 2 + 1
    assert expected_writes(16, layout, ShardingScheme(), ShardingScheme()) == 1 * 60 + 1
    # TP 2 -> 1 with 3 KV heads: rank 0 sends heads 0-1 and rank 1 head 2, two runs per page (shard_plan)
    assert expected_writes(16, layout, ShardingScheme(tp_size=2), ShardingScheme()) == 1 * 60 * 2 + 1
    with pytest.raises(ValueError, match="cannot split 3 KV heads over tensor-parallel size 4"):
        expected_writes(16, layout, ShardingScheme(tp_size=4), ShardingScheme())
    with pytest.raises(ValueError, match="differ in page_size"):
        layout.compatible_with(KvLayout(30, 100, 3, 32, 64, "float32"))


PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived " * 6]


@pytest.mark.parametrize("provider,kv_dtype", [("shm", "auto"), ("tcp;ofi_rxm", "auto"), ("shm", "bfloat16")])
def test_prefill_engine_pushes_kv_into_decode_engine(provider, kv_dtype):
    # kv_dtype bfloat16: both sides keep K/V as bfloat16 (half the bytes on the wire); the decode
    # node continues exactly as a colocated engine with the same KV cache dtype does.
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = LLM(num_blocks=128, kv_cache_dtype=kv_dtype).generate(PROMPTS, params)

    cfg = FabricConfig(provider=provider, node="127.0.0.1" if provider != "shm" else None)
    fab_p, fab_d = TransferEngine(cfg), TransferEngine(cfg)
    events = QueueEvents()
    engine_thread_jobs = events.jobs
    try:
        # Decode side: the receiver is the engine's DecodeConnector
        receiver = KvReceiver(fab_d, events)
        decode = LLM(num_blocks=128, kv_connector=receiver, kv_cache_dtype=kv_dtype).engine
        assert receiver.layout.dtype == ("bfloat16" if kv_dtype == "bfloat16" else "float32")
        # Prefill side: the sender is the engine's PrefillConnector
        sender = KvSender(fab_p)
        prefill = LLM(num_blocks=64, max_batch_tokens=32, kv_connector=sender, kv_cache_dtype=kv_dtype).engine
        fab_p.connect(fab_d.peer_descriptor)

        for i, p in enumerate(PROMPTS):
            decode.add_request(p, params, request_id=f"r{i}", role=TransferRole.REMOTE_PREFILL)
        decode.step()
        tickets = {rid: receiver.address(t, 1) for rid, t in events.tickets.items()}   # a TP 1 prefill side
        futures = {}
        for rid, t in tickets.items():
            r = decode._tracked[rid].request
            futures[rid] = sender.add(t)
            futures[rid].add_done_callback(lambda _f, rid=rid: engine_thread_jobs.put(("release", rid)))
            prefill.add_request(r.prompt_token_ids[:-1], SamplingParams(max_tokens=1), request_id=rid,
                                role=TransferRole.PREFILL)
        while prefill.has_unfinished_requests():
            prefill.step()
        def still_waiting(ready: set[str]) -> None:
            assert all(decode._tracked[rid].request.status is RequestStatus.WAITING_FOR_KV
                       for rid in tickets if rid not in ready)

        def landed(rid: str) -> None:
            ctx = receiver.context(rid)
            assert ctx.hidden.shape == (decode.arch.hidden_size,) and torch.isfinite(ctx.hidden).all()

        ready = pump(prefill, sender, decode, receiver, engine_thread_jobs, set(tickets), each=still_waiting,
                     on_ready=landed)
        assert ready == set(tickets)
        results = {rid: f.result(timeout=10) for rid, f in futures.items()}
        for rid, res in results.items():
            assert res.num_writes == receiver_expected(decode, rid, tickets)
        # Overlap (D8): the short prompt runs in one pass; its layer-0 writes were posted by the
        # messenger thread while the same pass was still computing later layers.
        short = results["r0"]
        assert 0 < short.layer_post_times[0] < short.last_layer_time
        assert short.layer_post_times[0] < short.layer_post_times[-1]
        prefill.check_integrity()
        assert prefill.pool.num_used_blocks == 0

        done = {}
        while decode.has_unfinished_requests():
            done.update({o.request_id: o.completion for o in decode.step() if o.finished})
        for i, e in enumerate(expected):
            assert done[f"r{i}"].token_ids == e.token_ids
        decode.check_integrity()
        sender.close()
    finally:
        fab_p.close()
        fab_d.close()


def test_a_failed_pass_or_a_raising_post_fails_only_its_transfer(monkeypatch):
    """A forward pass that raises after layer 0 leaves its pass short of layers: its transfer fails
    (PassFailedError) at the next pass and later passes are posted (before, they queued behind it
    for ever: a later transfer posted only its context record). A post that raises (a bug, not
    the fabric) fails its own transfer (PostError); the messenger thread goes on."""
    cfg = FabricConfig(provider="shm")
    fab_p, fab_d = TransferEngine(cfg), TransferEngine(cfg)
    events = QueueEvents()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    sender = None
    try:
        receiver = KvReceiver(fab_d, events)
        decode = LLM(num_blocks=128, kv_connector=receiver).engine
        sender = KvSender(fab_p)
        prefill = LLM(num_blocks=64, max_batch_tokens=32, kv_connector=sender).engine
        fab_p.connect(fab_d.peer_descriptor)

        def start(rid: str, prompt: str):
            decode.add_request(prompt, params, request_id=rid, role=TransferRole.REMOTE_PREFILL)
            decode.step()
            ticket = receiver.address(events.tickets[rid], 1)
            future = sender.add(ticket)
            r = decode._tracked[rid].request
            prefill.add_request(r.prompt_token_ids[:-1], SamplingParams(max_tokens=1), request_id=rid,
                                role=TransferRole.PREFILL)
            return ticket, future

        def prefill_all() -> None:
            while prefill.has_unfinished_requests():
                prefill.step()

        _, failed = start("r0", PROMPTS[0])
        real = prefill.runner.execute

        def broken(sched, layer_cb, **kw):
            layer_cb(0)
            raise RuntimeError("injected: forward failed after layer 0")

        monkeypatch.setattr(prefill.runner, "execute", broken)
        with pytest.raises(RuntimeError, match="injected"):
            prefill.step()
        monkeypatch.setattr(prefill.runner, "execute", real)
        prefill.abort_request("r0")   # what EngineThread does with the requests of a failed step
        later, f1 = start("r1", PROMPTS[1])
        prefill_all()
        assert f1.result(timeout=10).num_writes == later.expected_writes
        with pytest.raises(PassFailedError, match=f"after 1 of {decode.arch.num_layers} layers"):
            failed.result(timeout=10)

        real_post = sender._post_layer

        def post(it, layer):
            if it.transfer.key == "r2" and layer == 3:
                raise ValueError("injected: a bug while posting")
            real_post(it, layer)

        monkeypatch.setattr(sender, "_post_layer", post)
        _, f2 = start("r2", PROMPTS[0])
        other, f3 = start("r3", PROMPTS[1])
        prefill_all()
        assert f3.result(timeout=10).num_writes == other.expected_writes
        with pytest.raises(PostError, match="injected: a bug while posting"):
            f2.result(timeout=10)
        monkeypatch.setattr(sender, "_post_layer", real_post)

        # the transport itself raising a non-fabric error (here on the context record's write): the
        # write is not counted outstanding, its staging slot comes back, the transfer fails
        real_write = sender.transport.write
        ctx_ticket = None

        def write(writes, *args, **kw):
            if ctx_ticket is not None and writes.dst == ctx_ticket.context:
                raise TypeError("injected: a bug below write_pages")
            return real_write(writes, *args, **kw)

        monkeypatch.setattr(sender.transport, "write", write)
        ctx_ticket, f4 = start("r4", PROMPTS[0])
        prefill_all()
        with pytest.raises(PostError, match="injected: a bug below write_pages"):
            f4.result(timeout=10)
        assert sender.staging_slots.free == sender.staging_slots.capacity
        for rid in ("r0", "r1", "r2", "r3", "r4"):
            sender.post_release(rid)   # the connector's KvReleased, taken by the engine's next step
        prefill.apply_kv_events()
        prefill.check_integrity()
        assert prefill.pool.num_used_blocks == 0
    finally:
        if sender is not None:
            sender.close()
        fab_p.close()
        fab_d.close()


def receiver_expected(decode, rid, tickets):
    n = len(decode.tokenize(PROMPTS[int(rid[1:])])) - 1
    return -(-n // decode.kv_cache.shape.page_size) * decode.arch.num_layers * 2 + 1


# --- the sender on its own: two real fabric engines, hand-made scheduler passes -------------------

def _request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=1), max_total_tokens=4096,
                   role=TransferRole.PREFILL)


def test_prefix_hit_sends_cached_pages_with_the_first_chunk():
    # 22 prefilled tokens = 6 pages of 4; pages 0 and 1 came from the prefix cache, so the
    # first computed chunk starts at token 8. Source pages 5, 6, 7 and destination pages 20, 21,
    # 22 are contiguous at both ends: the fabric merges them, and the counts stay exact.
    src_pages, dst_pages = [5, 6, 7, 12, 13, 14], (20, 21, 22, 23, 2, 3)
    pair = SenderPair(src_pages)
    try:
        req = _request("r-prefix", 23)
        fut = pair.add(pair.target("r-prefix", dst_pages, 22, tag=0x5151))
        before = pair.fab_p.stats()
        pair.run_pass([ScheduledChunk(req, start=8, num_tokens=8, samples=False)])
        pair.run_pass([ScheduledChunk(req, start=16, num_tokens=6, samples=False)])
        pair.prefill_done(req, torch.arange(16, dtype=torch.float32), torch.arange(50, dtype=torch.float32))
        assert pair.fired.get(timeout=10) == 0x5151
        result = fut.result(timeout=10)
        assert result.num_writes == 6 * SMALL.num_layers * 2 + 1 == fut.result().num_writes
        for layer in range(SMALL.num_layers):
            for kv in (0, 1):
                for i, (s, d) in enumerate(zip(src_pages, dst_pages, strict=True)):
                    assert pair.page_bytes(pair.dst, layer, kv, d) == pair.page_bytes(pair.src, layer, kv, s), \
                        (layer, kv, i)
        after = pair.fab_p.stats()
        assert after.entries - before.entries == result.num_writes
        # per layer and side: pages 0-2 as one write and page 3 alone (first pass), 4-5 as one
        assert after.writes - before.writes == SMALL.num_layers * 2 * 3 + 1
        assert pair.released == ["r-prefix"]
        assert pair.fab_d.imm_counter.landed(0x5151) == 0
    finally:
        pair.close()


def test_targets_with_out_of_range_tags_are_refused():
    pair = SenderPair([0])
    try:
        with pytest.raises(ValueError, match=r"imm_tag=16777216 outside 0..16777215"):
            pair.sender.add(TransferTicket("r-big-tag", pair.dst_region.descriptor, SMALL, (0,),
                                           pair.landing.region.descriptor, 0, 2**24, 7, 3))
    finally:
        pair.close()


def test_chunks_without_prefix_hit_send_each_page_once():
    src_pages, dst_pages = [3, 9, 4, 10], (0, 1, 2, 3)  # nothing contiguous at both ends
    pair = SenderPair(src_pages)
    try:
        req = _request("r-plain", 15)  # 14 prefilled tokens: 4 pages
        fut = pair.add(pair.target("r-plain", dst_pages, 14, tag=77))
        before = pair.fab_p.stats()
        for start, n in ((0, 5), (5, 5), (10, 4)):
            pair.run_pass([ScheduledChunk(req, start=start, num_tokens=n, samples=False)])
        pair.prefill_done(req, torch.zeros(16), torch.arange(50, dtype=torch.float32))
        assert pair.fired.get(timeout=10) == 77
        assert fut.result(timeout=10).num_writes == 4 * SMALL.num_layers * 2 + 1
        after = pair.fab_p.stats()
        assert after.writes - before.writes == after.entries - before.entries == 4 * SMALL.num_layers * 2 + 1
        for layer in range(SMALL.num_layers):
            for s, d in zip(src_pages, dst_pages, strict=True):
                assert pair.page_bytes(pair.dst, layer, 1, d) == pair.page_bytes(pair.src, layer, 1, s)
    finally:
        pair.close()


def test_the_context_record_lands_naming_its_transfer_and_a_bad_hidden_state_fails_only_its_own():
    """D19: the record the sender posts is the checked record of the ticket's transfer (request,
    this decode engine, attempt, tag; position num_prefill_tokens - 1); a hidden state the record
    cannot hold fails that transfer (INTERNAL) and gives its staging slot back."""
    pair = SenderPair([3, 9])
    try:
        req = _request("r-ctx", 8)   # 7 prefilled tokens: 2 pages of 4
        fut = pair.add(pair.target("r-ctx", (0, 1), 7, tag=91))
        pair.run_pass([ScheduledChunk(req, start=0, num_tokens=7, samples=False)])
        hidden = torch.arange(16, dtype=torch.float32)   # [hidden_size]
        pair.prefill_done(req, hidden, torch.arange(50, dtype=torch.float32))
        assert pair.fired.get(timeout=10) == 91
        fut.result(timeout=10)
        ident = TransferIdentity("r-ctx", pair.fab_d.engine_id, attempt=0, imm_tag=91)
        ctx = pair.codec.decode(pair.landing, 0, ExpectedRecord(ident, position=6))
        assert torch.equal(ctx.hidden, hidden) and ctx.top_ids[:3].tolist() == [49, 48, 47]
        with pytest.raises(ContextRecordError, match="attempt: got 0, expected 1"):
            pair.codec.decode(pair.landing, 0, ExpectedRecord(TransferIdentity("r-ctx", pair.fab_d.engine_id, 1, 91),
                                                              position=6))
        bad = _request("r-bad-hidden", 8)
        fut = pair.add(pair.target("r-bad-hidden", (2, 3), 7, tag=92))
        pair.run_pass([ScheduledChunk(bad, start=0, num_tokens=7, samples=False)])
        pair.prefill_done(bad, torch.zeros(8), torch.arange(50, dtype=torch.float32))
        with pytest.raises(ContextEncodeError, match=r"hidden state of shape \(8,\), the record holds \[16\]"):
            fut.result(timeout=10)
        assert pair.sender.staging_slots.free == pair.sender.staging_slots.capacity
        assert pair.released == ["r-ctx", "r-bad-hidden"]
    finally:
        pair.close()


class _Stale(QueueEvents):
    """QueueEvents that also records the receiver's stale-write reports."""

    def __init__(self) -> None:
        super().__init__()
        self.stale: list[tuple[int, int]] = []

    def kv_stale_write(self, tag: int, count: int) -> None:
        self.stale.append((tag, count))   # on the progress thread, just after the count is bumped:
                                          # a test waits for both before it reads the list


def test_receiver_tombstones_quarantines_fences_and_counts_stale_writes():
    """D20, S5: attempts are numbered per request; a write for a quarantined tag is harmless (counted
    as quarantined), one for a released, finished or unknown tag is stale (counted and reported, the
    unknown tag not kept); a fence lands through KvSender.fence; a fence landing after its wait is
    not stale."""
    pair = SenderPair([0, 1])
    events = _Stale()
    rx = KvReceiver(pair.fab_d, events)
    shape = KVCacheShape(SMALL.num_layers, SMALL.num_pages, SMALL.kv_heads, SMALL.page_size, SMALL.head_dim)
    pool = alloc_tensor((shape.num_layers, 2, shape.num_pages, shape.kv_heads, shape.page_size, shape.head_dim),
                        torch.float32, huge_pages=False)
    rx.register_kv_cache(KvCacheSpec(buffer=pool, shape=shape, dtype=torch.float32,
                                     groups=(AttentionGroupSpec("full", (0, 1, 2), None),), hidden_size=16,
                                     model_name="test"))
    one = np.zeros(1, dtype=np.uint64)
    page = np.full(1, SMALL.page_nbytes, dtype=np.uint64)

    def write(ticket_kv, tag: int) -> None:   # one page from the sender's pool, tagged
        pair.fab_p.write_pages_sync(pair.sender.kv_region, one, ticket_kv, one, page, tag, imm_mode="every",
                                    timeout=10)

    def settled(pred, what: str) -> None:
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline, what
            time.sleep(0.005)

    try:
        t0 = rx.prepare("r", 9, [3, 4])
        assert t0.attempt == 0 and rx.num_tags_in_use == 1 and rx.num_slots_in_use == 1
        tag0 = rx.quarantine("r")
        assert tag0 == t0.imm_tag and rx.num_quarantined == 1
        t1 = rx.prepare("r", 9, [5, 6])       # a new attempt while attempt 0 is quarantined
        assert t1.attempt == 1 and t1.imm_tag != tag0 and rx.num_slots_in_use == 2
        write(t0.kv, tag0)                     # a late write of attempt 0: into quarantined pages
        settled(lambda: rx.quarantined_writes == 1, "the quarantined write to be counted")
        assert rx.stale_writes == 0
        rx.release_quarantined(tag0)
        write(t0.kv, tag0)                     # after the release: stale
        settled(lambda: rx.stale_writes == 1 and len(events.stale) == 1,
                "the write after the release to be counted stale")
        rx.finish("r")
        write(t1.kv, t1.imm_tag)               # after the request finished: stale
        settled(lambda: rx.stale_writes == 2 and len(events.stale) == 2, "the write after finish to be counted stale")
        unknown = 0x0ABCDE
        write(t1.kv, unknown)
        settled(lambda: rx.stale_writes == 3 and len(events.stale) == 3, "the unknown tag to be counted stale")
        assert pair.fab_d.imm_counter.landed(unknown) == 0            # not kept forever
        assert [t for t, _ in events.stale] == [tag0, t1.imm_tag, unknown]
        # a fence: expected, posted by the sender, landed; once retired, a late one is not stale
        landed = queue.SimpleQueue()
        tag, region = rx.expect_fence(lambda: landed.put(True))
        pair.sender.fence(region, tag).result(timeout=10)
        assert landed.get(timeout=10)
        rx.retire_fence(tag)
        pair.sender.fence(region, tag).result(timeout=10)
        write(t1.kv, unknown + 1)              # behind the late fence on the same endpoint (WAW)
        settled(lambda: rx.stale_writes == 4 and len(events.stale) == 4,
                "the write behind the late fence to be counted stale")
        assert [t for t, _ in events.stale] == [tag0, t1.imm_tag, unknown, unknown + 1]   # not the fence
        assert rx.num_tags_in_use == rx.num_slots_in_use == rx.num_quarantined == rx.num_waiting == 0
    finally:
        pair.close()
