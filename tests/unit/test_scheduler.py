"""Scheduler unit tests: exact order, chunk sizes, budgets, admission, safety margin, preemption.

Requirements shown here: E2 (the batch is rebuilt every step), E3 (chunked prefill), E4 (token,
request and cache budgets), E5 (FIFO order), E6 (prefill-first), E10 (all-or-nothing admission),
E11 (safety margin).
"""

from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus, TransferRole
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import FifoScheduler, PrefillFirstScheduler, make_scheduler


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(max_tokens=100), max_total_tokens=10_000)


def _setup(num_blocks=64, page_size=4, **kw):
    mgr = KVCacheManager(BlockPool(num_blocks, 1), page_size)
    cfg = SchedulerConfig(**{"max_batch_tokens": 16, "max_requests_per_batch": 8, "safety_margin": 0.0, **kw})
    return make_scheduler(cfg, mgr), mgr


def _apply(sched_out):
    """What the engine's update does to progress: advance, and append a token where sampled."""
    for c in sched_out.chunks:
        c.request.num_computed_tokens = c.end
        if c.samples:
            c.request.output_token_ids.append(7)
            c.request.status = RequestStatus.DECODING


def _plan(out):
    return [(c.request_id, c.start, c.num_tokens, c.samples) for c in out.chunks]


def test_chunked_prefill_under_token_budget_then_decode():
    s, mgr = _setup()
    a, b = _req("a", 10), _req("b", 20)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    # a fits whole (10 tokens, samples); b gets the 6 tokens left of the budget (chunk, no sample).
    assert _plan(out) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert mgr.block_table("a") == [1, 2, 3] and mgr.block_table("b") == [4, 5]
    _apply(out)
    out = s.schedule()
    # FIFO: running decodes first (a), then the running prefill (b) continues with 14 of 15 budget.
    assert _plan(out) == [("a", 10, 1, True), ("b", 6, 14, True)]
    assert mgr.block_table("b") == [4, 5, 6, 7, 8]
    _apply(out)
    out = s.schedule()
    assert _plan(out) == [("a", 11, 1, True), ("b", 20, 1, True)]


def test_fifo_order_decodes_then_running_prefills_then_waiting_by_arrival():
    s, _ = _setup(max_batch_tokens=12)
    reqs = [_req("p", 20), _req("d", 3), _req("w1", 4), _req("w2", 4)]
    s.add_request(reqs[0])
    _apply(s.schedule())                 # p: 12 of 20 tokens
    s.add_request(reqs[1])
    out = s.schedule()                   # p continues (8 tokens), d admitted (3 tokens)
    assert _plan(out) == [("p", 12, 8, True), ("d", 0, 3, True)]
    _apply(out)
    s.add_request(reqs[2])
    s.add_request(reqs[3])
    out = s.schedule()
    # Decodes (p, d) first, then waiting in arrival order until the budget (12) runs out:
    # w1 takes 4, w2 takes 4 -> 10 tokens.
    assert _plan(out) == [("p", 20, 1, True), ("d", 3, 1, True), ("w1", 0, 4, True), ("w2", 0, 4, True)]


def test_request_cap_limits_sequences_per_pass():
    s, _ = _setup(max_requests_per_batch=2, max_batch_tokens=100)
    for i in range(3):
        s.add_request(_req(f"r{i}", 2))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_admission_allocates_nothing_when_the_chunk_does_not_fit():
    s, mgr = _setup(num_blocks=4, max_batch_tokens=64)   # 3 usable blocks of 4 tokens
    s.add_request(_req("big", 20))                        # first chunk 20 tokens -> 5 blocks
    out = s.schedule()
    assert out.is_empty
    assert mgr.pool.num_free_blocks == 3 and mgr.block_table("big") == []
    assert s.waiting[0].request_id == "big"


def test_safety_margin_blocks_new_prefills_but_not_decodes():
    s, mgr = _setup(num_blocks=11, safety_margin=0.5)     # 10 usable blocks, margin 5 free
    a = _req("a", 24)                                     # 6 blocks
    s.add_request(a)
    _apply(s.schedule())
    _apply(s.schedule())                                  # a finished its prefill: 6 blocks used, 4 free
    assert mgr.pool.num_free_blocks == 4
    s.add_request(_req("b", 2))
    out = s.schedule()
    assert _plan(out) == [("a", 24, 1, True)]            # only the decode runs; b waits (4/10 < 0.5)
    assert [r.request_id for r in s.waiting] == ["b"]


def test_fifo_default_safety_margin_is_015_and_prefill_first_is_zero():
    assert SchedulerConfig().effective_safety_margin == 0.15
    assert SchedulerConfig(scheduler_type="prefill_first").effective_safety_margin == 0.0
    s, _ = _setup(scheduler_type="prefill_first")
    assert isinstance(s, PrefillFirstScheduler)
    assert isinstance(_setup()[0], FifoScheduler)


def test_prefill_first_runs_chunked_prefills_before_decodes():
    s, _ = _setup(scheduler_type="prefill_first", max_batch_tokens=8)
    d = _req("d", 2)
    s.add_request(d)
    _apply(s.schedule())                                  # d is now decoding
    s.add_request(_req("p", 30))
    out = s.schedule()
    # The new prefill takes the budget first (8 tokens); the decode gets nothing this step.
    assert _plan(out) == [("p", 0, 8, False)]
    _apply(out)
    out = s.schedule()
    assert _plan(out) == [("p", 8, 8, False)]


def test_decode_out_of_blocks_is_reported_stalled_and_soft_reset_requeues_it():
    s, mgr = _setup(num_blocks=5, page_size=4, max_batch_tokens=64)  # 4 usable blocks
    a, b = _req("a", 8), _req("b", 8)                               # 2 blocks each
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert _plan(out) == [("a", 0, 8, True), ("b", 0, 8, True)]
    _apply(out)
    assert mgr.pool.num_free_blocks == 0
    s.add_request(_req("c", 1))
    out = s.schedule()
    # Both decodes need a third block and none is free: both are reported, nothing runs, and no
    # new request is admitted while requests stall.
    assert out.is_empty
    assert [(x.request_id, x.num_blocks) for x in out.stalled] == [("a", 1), ("b", 1)]
    assert [r.request_id for r in s.waiting] == ["c"]
    # The engine makes room; here b is soft-reset: its blocks are freed head first (3, 4).
    s.soft_reset(b)
    assert b.num_computed_tokens == 0 and b.status is RequestStatus.PENDING and b.output_token_ids == [7]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    out = s.schedule()
    assert _plan(out) == [("a", 8, 1, True)]
    assert mgr.block_table("a") == [1, 2, 3]
    mgr.check_integrity()
    # When a finishes, b comes back and recomputes prompt + its generated token (9 tokens).
    s.remove_request(a)
    out = s.schedule()
    assert _plan(out) == [("c", 0, 1, True), ("b", 0, 9, True)]     # one-token chunks go first


def test_a_running_chunk_shrinks_to_the_blocks_that_are_free():
    s, mgr = _setup(num_blocks=6, page_size=4, max_batch_tokens=9)  # 5 usable blocks
    a, p = _req("a", 4), _req("p", 20)
    s.add_request(a)
    s.add_request(p)
    out = s.schedule()
    assert _plan(out) == [("a", 0, 4, True), ("p", 0, 5, False)]  # 1 + 2 blocks
    _apply(out)
    out = s.schedule()
    # a's decode takes a fourth block; p wants 8 tokens (2 more blocks) but 1 is free, so its
    # chunk is cut to the 7 tokens that fill that block.
    assert _plan(out) == [("a", 4, 1, True), ("p", 5, 7, False)]
    assert out.stalled == () and mgr.pool.num_free_blocks == 0


def test_park_and_unpark_keep_offloaded_requests_ahead_of_new_ones():
    s, mgr = _setup(num_blocks=9, page_size=4, max_batch_tokens=64)
    a, b = _req("a", 4), _req("b", 4)
    s.add_request(a)
    s.add_request(b)
    _apply(s.schedule())
    s.park(a)                                                       # the engine copied a's KV out
    mgr.free(a)
    s.add_request(_req("c", 2))
    out = s.schedule()
    assert _plan(out) == [("b", 4, 1, True)]                        # c waits while a is offloaded
    assert s.has_work() and s.num_unfinished == 3
    s.unpark(a)
    assert s.running == [a, b]                                      # back in arrival order
    mgr.allocate_slots(a, 1)                                        # (the engine restores its blocks)
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["a", "b", "c"]


def test_prefill_only_request_computes_every_given_token_and_never_samples():
    s, _ = _setup(max_batch_tokens=5)
    r = Request("p", list(range(8)), SamplingParams(), max_total_tokens=100, role=TransferRole.PREFILL)
    s.add_request(r)
    out = s.schedule()
    assert _plan(out) == [("p", 0, 5, False)]
    _apply(out)
    out = s.schedule()
    assert _plan(out) == [("p", 5, 3, False)]           # all 8 tokens, no sample
    _apply(out)
    assert r.num_remaining_tokens == 0
