"""Block pool and per-request block tables: exact ids, reference counts, integrity errors."""

import pytest

from pdserve.cache.block_pool import BlockPool, CacheIntegrityError
from pdserve.cache.manager import KVCacheManager
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(), max_total_tokens=10_000)


def test_padding_blocks_are_never_handed_out():
    pool = BlockPool(num_blocks=6, num_padding_blocks=2)
    assert pool.num_usable_blocks == 4
    assert pool.allocate(4) == [2, 3, 4, 5]
    assert pool.allocate(1) is None  # "not now", nothing taken
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="block id 0"):
        pool.free([0])


def test_allocate_is_all_or_nothing_and_freed_ids_go_to_the_back():
    pool = BlockPool(num_blocks=8, num_padding_blocks=1)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert (a, b) == ([1, 2, 3], [4, 5])
    assert pool.allocate(3) is None
    assert pool.num_free_blocks == 2  # the failed call took nothing
    pool.free([2, 1])
    assert pool.allocate(4) == [6, 7, 2, 1]
    assert [pool.ref_count(i) for i in range(8)] == [0, 1, 1, 1, 1, 1, 1, 1]
    pool.check_integrity()


def test_double_free_and_negative_allocation_raise():
    pool = BlockPool(num_blocks=4, num_padding_blocks=1)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(CacheIntegrityError, match=f"double free of block {blk}"):
        pool.free([blk])
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


def test_manager_grows_tables_by_page_and_frees_everything():
    pool = BlockPool(num_blocks=10, num_padding_blocks=1)
    mgr = KVCacheManager(pool, page_size=4)
    r = _req("a", 9)
    assert mgr.blocks_needed(r, 9) == 3
    assert mgr.allocate_slots(r, 5) == [1, 2]         # positions 0..4 -> 2 pages
    r.num_computed_tokens = 5
    assert mgr.allocate_slots(r, 3) == []             # positions 5..7 fit in page 2
    r.num_computed_tokens = 8
    assert mgr.allocate_slots(r, 1) == [3]            # position 8 opens page 3
    assert mgr.block_table("a") == [1, 2, 3]
    other = _req("b", 30)
    assert mgr.allocate_slots(other, 30) is None      # needs 8 blocks, 6 free: nothing allocated
    assert pool.num_free_blocks == 6 and mgr.block_table("b") == []
    mgr.check_integrity()
    assert mgr.free(r) == 3
    assert pool.num_free_blocks == 9
    mgr.check_integrity()


def test_integrity_check_reports_numbers():
    pool = BlockPool(num_blocks=5, num_padding_blocks=1)
    mgr = KVCacheManager(pool, page_size=4)
    pool.allocate(2)  # held by nobody's table: a leak
    with pytest.raises(CacheIntegrityError, match=r"block tables hold 0 blocks but the pool has 2 references"):
        mgr.check_integrity()
