"""Sliding-window allocator (E8): pages stay bounded by the window, recycled entries point at the
padding block with logical indexing kept, and hybrid admission checks every group (E10)."""

from __future__ import annotations

import pytest

from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.groups import FULL, PADDING_BLOCK, AttentionGroup, attention_groups
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.request import Request, TransferRole
from pdserve.engine.sampling_params import SamplingParams

P, W = 4, 10
SLIDING = AttentionGroup("sliding", W)


def _req(rid: str, n: int, **kw) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=1000), max_total_tokens=10_000, **kw)


def _check_window(mgr: KVCacheManager, r: Request, start: int, end: int) -> None:
    """Every position written by chunk [start, end) or read by its queries has a real page."""
    table = mgr.block_table(r.request_id, "sliding")
    assert len(table) == -(-end // P)                               # logical indexing
    lo = max(0, start - W + 1)
    for pos in range(lo, end):
        assert table[pos // P] != PADDING_BLOCK, (start, end, pos, table)


def test_a_long_decode_keeps_only_the_pages_its_window_needs():
    mgr = KVCacheManager(BlockPool(64, 1), P, (FULL, SLIDING))
    assert mgr.group_names == ("full", "sliding") and mgr.prefix_cache is None
    r = _req("r", 6)
    assert mgr.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    bound = -(-(W - 1 + 1) // P) + 1                                  # ceil((W - 1 + chunk) / P) + 1
    peak = 0
    for pos in range(6, 200):
        assert mgr.allocate_slots(r, 1) is not None
        _check_window(mgr, r, pos, pos + 1)
        sliding = mgr.block_table("r", "sliding")
        real = [b for b in sliding if b != PADDING_BLOCK]
        peak = max(peak, len(real))
        assert len(real) <= bound
        assert all(b == PADDING_BLOCK for b in sliding[: len(sliding) - len(real)])  # a prefix of padding
        assert len(mgr.block_table("r", "full")) == -(-(pos + 1) // P)             # full keeps everything
        assert mgr.pool.num_used_blocks == len(mgr.block_table("r")) + len(real)
        r.num_computed_tokens = pos + 1
    assert peak == bound == 4
    assert mgr.max_blocks_per_request(200, 1) == 50 + bound
    mgr.check_integrity()
    assert mgr.free(r) == 50 + len(real)
    assert mgr.pool.num_used_blocks == 0


def test_chunked_prefill_longer_than_the_window_recycles_between_chunks():
    mgr = KVCacheManager(BlockPool(64, 1), P, (SLIDING,))
    assert mgr.group_names == ("sliding",)
    r = _req("r", 100)
    chunk = 8
    bound = -(-(W - 1 + chunk) // P) + 1
    for start in range(0, 96, chunk):
        assert mgr.allocate_slots(r, chunk) is not None
        _check_window(mgr, r, start, start + chunk)
        assert mgr.num_held_blocks("r") <= bound
        r.num_computed_tokens = start + chunk
    assert mgr.max_blocks_per_request(100, chunk) == bound
    with pytest.raises(KeyError, match="unknown attention group 'full'"):
        mgr.block_table("r")
    mgr.check_integrity()


def test_recycled_pages_are_reused_and_the_first_chunk_keeps_every_page():
    mgr = KVCacheManager(BlockPool(16, 1), P, (SLIDING,))
    r = _req("r", 16)
    assert mgr.allocate_slots(r, 16) == [1, 2, 3, 4]                 # start 0: all queries need all pages
    r.num_computed_tokens = 16
    # Position 16 reads positions > 6: pages 0 (0..3) leaves the window; page 4 is new. The freed
    # block joins the back of the free list, so the new page is a never-used one.
    assert mgr.allocate_slots(r, 1) == [5]
    assert mgr.block_table("r", "sliding") == [PADDING_BLOCK, 2, 3, 4, 5]
    assert mgr.pool.num_free_blocks == 15 - 4
    mgr.check_integrity()


def test_prefill_only_requests_recycle_nothing_while_they_run():
    mgr = KVCacheManager(BlockPool(32, 1), P, (SLIDING,))
    r = _req("r", 40, role=TransferRole.PREFILL)
    assert len(mgr.allocate_slots(r, 40)) == 10                        # reserved whole at admission
    r.num_computed_tokens = 32
    assert mgr.allocate_slots(r, 8) == []
    assert PADDING_BLOCK not in mgr.block_table("r", "sliding")        # a transfer may still read them


def test_hybrid_admission_is_all_or_nothing_over_both_groups():
    mgr = KVCacheManager(BlockPool(13, 1), P, (FULL, SLIDING))        # 12 usable
    a = _req("a", 24)                                                   # 6 + 6 blocks at its first chunk
    assert mgr.allocate_slots(a, 24) is not None
    assert mgr.pool.num_free_blocks == 0
    b = _req("b", 4)
    assert mgr.allocate_slots(b, 4) is None and not mgr.has("b")
    a.num_computed_tokens = 24
    # a's decode recycles sliding pages 0..2 (positions < 15) and needs one new page per group:
    # net -1, so it fits in a full pool and leaves one block free.
    assert mgr.blocks_needed(a, 1) == 0
    assert len(mgr.allocate_slots(a, 1)) == 2
    assert mgr.block_table("a", "sliding")[:3] == [PADDING_BLOCK] * 3
    assert mgr.pool.num_free_blocks == 1
    # b needs one page in each group: two blocks, one free: refused, nothing taken.
    assert mgr.allocate_slots(b, 4) is None and not mgr.has("b") and mgr.pool.num_free_blocks == 1
    mgr.check_integrity()


def test_groups_from_layer_types():
    assert attention_groups(None, None) == (FULL,)
    assert attention_groups(["full_attention"] * 2, 64) == (FULL,)
    assert attention_groups(["sliding_attention"] * 2, 64) == (AttentionGroup("sliding", 64),)
    assert attention_groups(["sliding_attention", "full_attention"], 64) == (FULL, AttentionGroup("sliding", 64))
    with pytest.raises(ValueError, match="no sliding_window"):
        attention_groups(["sliding_attention"], None)
    with pytest.raises(ValueError, match="unknown layer types"):
        attention_groups(["chunked_attention"], 64)
    with pytest.raises(ValueError, match="needs a window"):
        AttentionGroup("sliding", 0)
