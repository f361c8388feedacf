"""Block pool and per-request block tables: exact ids, reference counts, integrity errors (E7: the
paged KV cache's shared pool, free list and reserved padding blocks)."""

import pytest

from pdserve.engine.cache.block_pool import BlockPool, CacheIntegrityError
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


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


def _h(name: str):
    from pdserve.engine.cache.block_hash import hash_block

    return hash_block(None, [ord(c) for c in name])


def test_freed_blocks_with_a_hash_stay_cached_and_the_most_recently_freed_is_demoted_first():
    pool = BlockPool(num_blocks=6, num_padding_blocks=1)            # usable 1..5
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.register(1, _h("a")) and pool.register(2, _h("b"))  # 3 stays unhashed (incomplete)
    pool.free([1, 2, 3])                                             # head first, as tables are freed
    assert (pool.num_empty_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (3, 0, 2)
    assert pool.num_free_blocks == 5
    pool.check_integrity()
    # Empty blocks go first (never-used 4, 5, then 3 freed without a hash) ...
    assert pool.allocate(3) == [4, 5, 3]
    assert pool.num_evictions == 0 and pool.lookup(_h("a")) == 1 and pool.lookup(_h("b")) == 2
    # ... then cached ones are demoted, most recently freed first: 2 before 1.
    assert pool.allocate(1) == [2]
    assert pool.num_evictions == 1 and pool.lookup(_h("b")) is None and pool.block_hash(2) is None
    assert pool.lookup(_h("a")) == 1 and pool.is_cached(1)
    assert pool.allocate(2) is None                                  # 1 free: nothing taken, nothing demoted
    assert pool.lookup(_h("a")) == 1 and pool.num_evictions == 1
    assert pool.allocate(1) == [1] and pool.lookup(_h("a")) is None
    assert (pool.num_empty_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (0, 5, 0)
    pool.check_integrity()


def test_shared_blocks_are_reference_counted_and_cached_only_when_the_last_holder_frees():
    pool = BlockPool(num_blocks=4, num_padding_blocks=1)
    (b,) = pool.allocate(1)
    assert pool.register(b, _h("x"))
    pool.acquire([b])                                    # a second request hits it while in use
    assert pool.ref_count(b) == 2 and not pool.is_cached(b)
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_cached_blocks == 0 and pool.num_used_blocks == 1
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.is_cached(b) and pool.num_used_blocks == 0
    pool.acquire([b])                                    # a hit on a cached block takes it back
    assert pool.ref_count(b) == 1 and not pool.is_cached(b) and pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_registration_keeps_the_first_copy_and_rejects_what_cannot_be_shared():
    pool = BlockPool(num_blocks=5, num_padding_blocks=1)
    a, b, c = pool.allocate(3)
    assert pool.register(a, _h("p"))
    assert not pool.register(b, _h("p"))                 # same content computed twice: first copy stays
    assert not pool.register(a, _h("q"))                 # a block keeps the hash it has
    assert pool.lookup(_h("p")) == a and pool.block_hash(b) is None
    with pytest.raises(CacheIntegrityError, match=f"block {c} has no hash"):
        pool.acquire([c])
    pool.free([c])
    with pytest.raises(CacheIntegrityError, match=f"block {c} is free"):
        pool.register(c, _h("r"))
    pool.free([a, b])
    assert pool.num_cached_blocks == 1 and pool.num_empty_blocks == 3   # b had no hash: empty
    pool.check_integrity()


def test_integrity_check_catches_a_cached_block_without_its_hash():
    pool = BlockPool(num_blocks=4, num_padding_blocks=1)
    (b,) = pool.allocate(1)
    pool.register(b, _h("z"))
    pool.free([b])
    pool._hash_of[b] = None                              # corrupt the books on purpose
    with pytest.raises(CacheIntegrityError, match=f"cached block {b} has no hash"):
        pool.check_integrity()
