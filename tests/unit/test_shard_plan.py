"""The tensor-parallel shard plan (D13, D14; kv_messenger.shard_plan), checked by applying it.

A fake global KV whose every element encodes (layer, K/V, page, head, token, element) is sharded
into per-rank HND pools as the engine's rule says, the plan's writes are applied with plain
memory copies into zeroed decode pools, and every decode pool must equal its own sharding of the
global tensor, with each destination byte written exactly once and the count the decode side
expects equal to the writes made. Over prefill TP x decode TP in {1, 2, 4, 8} and KV heads in
{1, 2, 3, 4, 8} (every pair the rule allows, uneven groups included), plus shapes other engines
got wrong.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from kv_messenger.plan import ShardingScheme, expected_writes
from kv_messenger.shard_plan import (
    KvLayout,
    KvShards,
    TpScheme,
    check_compatible,
    expected_page_writes,
    plan_transfer,
    shard_kv_heads,
)
from pdserve.model.tp import shard_query_heads as query_head_ranges

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 3, 4, 8)
LAYERS, PAGE, HEAD_DIM = 2, 4, 8
SRC_PAGES = np.array([3, 0, 4])      # request page i sits at SRC_PAGES[i] on every prefill rank
DST_PAGES = np.array([5, 1, 2])      # ... and at DST_PAGES[i] on every decode rank
SRC_POOL, DST_POOL = 5, 6
ELEM = {"float32": np.uint32, "bfloat16": np.uint16}


def shard_query_heads(num_q_heads: int, num_kv_heads: int, tp_size: int) -> tuple[tuple[int, ...], ...]:
    """The engine's query-head rule ([start, end) per rank; the plan never needs it) as the heads."""
    return tuple(tuple(range(a, b)) for a, b in query_head_ranges(num_q_heads, num_kv_heads, tp_size))


def splittable(k: int, n: int) -> bool:
    return n <= k or n % k == 0


GRID = [(p, d, k, "float32") for p, d, k in itertools.product(TPS, TPS, HEADS) if splittable(k, p) and splittable(k, d)]
# Shapes other engines' trackers report broken: 8 -> 16 ranks with 8 KV heads (replicas on the
# decode side only), 1 -> 4 ranks with 2 KV heads; and the same two in a 2-byte dtype.
EXTRA = [(8, 16, 8, "float32"), (1, 4, 2, "float32"), (8, 16, 8, "bfloat16"), (1, 4, 2, "bfloat16")]


def global_kv(k: int, dtype: str) -> np.ndarray:
    """[layers, 2, request pages, k, page, head_dim]: element value = its flat index + 1 (unique, never 0)."""
    shape = (LAYERS, 2, len(SRC_PAGES), k, PAGE, HEAD_DIM)
    return (np.arange(int(np.prod(shape)), dtype=np.int64) + 1).astype(ELEM[dtype]).reshape(shape)


def rank_pool(g: np.ndarray, heads: tuple[int, ...], pages: np.ndarray, pool_pages: int, fill: int) -> np.ndarray:
    """One rank's pool [layers, 2, pool_pages, len(heads), page, head_dim] holding the global KV's
    `heads` at `pages`, `fill` everywhere else."""
    pool = np.full((LAYERS, 2, pool_pages, len(heads), PAGE, HEAD_DIM), fill, dtype=g.dtype)
    pool[:, :, pages] = g[:, :, :, list(heads)]
    return pool


def apply_plan(plan, src_pools: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """Copy every planned entry byte for byte; (decode pools as bytes, per-byte write counts, entries per rank)."""
    dst = plan.dst
    dst_bytes = [np.zeros(dst.rank_layout(r).nbytes, dtype=np.uint8) for r in range(dst.scheme.tp_size)]
    counts = [np.zeros(dst.rank_layout(r).nbytes, dtype=np.uint8) for r in range(dst.scheme.tp_size)]
    entries = [0] * dst.scheme.tp_size
    src_bytes = [p.reshape(-1).view(np.uint8) for p in src_pools]
    for layer in range(LAYERS):
        for rw in plan.layer_writes(layer, SRC_PAGES, DST_PAGES):
            for so, do, n in zip(rw.src_offsets.tolist(), rw.dst_offsets.tolist(), rw.lengths.tolist(), strict=True):
                dst_bytes[rw.dst_rank][do:do + n] = src_bytes[rw.src_rank][so:so + n]
                counts[rw.dst_rank][do:do + n] += 1
                entries[rw.dst_rank] += 1
    return dst_bytes, counts, entries


@pytest.mark.parametrize("p_tp,d_tp,k,dtype", GRID + EXTRA)
def test_plan_reassembles_every_decode_shard(p_tp, d_tp, k, dtype):
    g = global_kv(k, dtype)
    src = KvShards.of(KvLayout(LAYERS, SRC_POOL, k, PAGE, HEAD_DIM, dtype), p_tp)
    dst = KvShards.of(KvLayout(LAYERS, DST_POOL, k, PAGE, HEAD_DIM, dtype), d_tp)
    src_pools = [rank_pool(g, h, SRC_PAGES, SRC_POOL, fill=0xAB) for h in src.scheme.rank_heads]
    holders = src.scheme.replica_sets
    seeds = range(3) if any(len(h) > 1 for h in holders) else range(1)
    n_pages = len(SRC_PAGES)
    for seed in seeds:
        plan = plan_transfer(src, dst, random.Random(seed))
        dst_bytes, counts, entries = apply_plan(plan, src_pools)
        for r, heads in enumerate(dst.scheme.rank_heads):
            want = rank_pool(g, heads, DST_PAGES, DST_POOL, fill=0)
            got = dst_bytes[r].view(g.dtype).reshape(want.shape)
            assert np.array_equal(got, want), f"decode rank {r} (heads {heads}) differs, seed {seed}"
            mask = np.zeros(want.shape, dtype=np.uint8)
            mask[:, :, DST_PAGES] = 1
            per_byte = np.repeat(mask.reshape(-1), g.dtype.itemsize)
            assert np.array_equal(counts[r], per_byte), (
                f"decode rank {r}: bytes written {sorted(set(counts[r].tolist()))} times, want exactly once in "
                f"the request's pages and never elsewhere")
            # One write per page per run of heads the same sources hold, never one per head (D13):
            # the fewest runs any plan could use.
            groups = len({holders[h] for h in heads})
            assert plan.runs_to(r) == groups
        # The canonical entry order: entry i's source bytes are entry i's destination bytes (what S7's
        # checksums compare), whichever replicas this seed chose.
        for layer in range(LAYERS):
            e = plan.layer_entries(layer, SRC_PAGES, DST_PAGES)
            src_b = [p.reshape(-1).view(np.uint8) for p in src_pools]
            for i in range(len(e.lengths)):
                so, do, n = int(e.src_offsets[i]), int(e.dst_offsets[i]), int(e.lengths[i])
                assert np.array_equal(src_b[e.src_ranks[i]][so:so + n], dst_bytes[e.dst_ranks[i]][do:do + n])
            assert np.array_equal(e.dst_offsets, plan_transfer(src, dst, random.Random(seed + 100))
                                  .layer_entries(layer, SRC_PAGES, DST_PAGES).dst_offsets)
        want_count = plan.expected_writes(n_pages)
        assert want_count == expected_page_writes(src, dst, n_pages)
        assert list(want_count.per_rank) == [entries[0] + 1] + entries[1:]   # + the context write on the leader
        assert want_count.total == sum(entries) + 1
        # plan.py's count (what the receiver tells its ImmCounter) is the same number.
        assert expected_writes(n_pages * PAGE - 1, src.layout, ShardingScheme(p_tp), ShardingScheme(d_tp)) \
            == want_count.total


def test_the_head_rule():
    assert shard_kv_heads(8, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert shard_kv_heads(3, 2) == ((0, 1), (2,))                      # uneven whole GQA groups
    assert shard_kv_heads(5, 4) == ((0, 1), (2,), (3,), (4,))
    assert shard_kv_heads(2, 4) == ((0,), (0,), (1,), (1,))              # replica sets {0, 1}, {2, 3}
    assert shard_kv_heads(8, 16)[:4] == ((0,), (0,), (1,), (1,))
    assert shard_kv_heads(1, 8) == ((0,),) * 8
    assert TpScheme.split(2, 4).replica_sets == ((0, 1), (2, 3))
    # The default model (9 query, 3 KV heads) at TP 2: rank 0 holds groups 0-1, rank 1 group 2.
    assert shard_query_heads(9, 3, 2) == ((0, 1, 2, 3, 4, 5), (6, 7, 8))
    assert shard_query_heads(8, 2, 4) == ((0, 1), (2, 3), (4, 5), (6, 7))
    for k, n in [(3, 4), (3, 8), (2, 3), (8, 12)]:
        with pytest.raises(ValueError, match=rf"cannot split {k} KV heads over tensor-parallel size {n}"):
            shard_kv_heads(k, n)
    with pytest.raises(ValueError, match="each KV head's 4 replicas"):
        shard_query_heads(6, 2, 8)
    with pytest.raises(ValueError, match="rank 1 heads"):
        TpScheme(2, 4, ((0, 1), (3, 2)))
    with pytest.raises(ValueError, match=r"KV heads \[3\] are held by no rank"):
        TpScheme(2, 4, ((0, 1), (2,)))


def test_uneven_and_replicated_plans_exactly():
    f32 = KvLayout(LAYERS, 4, 3, PAGE, HEAD_DIM, "float32")
    hb = PAGE * HEAD_DIM * 4
    plan = plan_transfer(KvShards.of(f32, 2), KvShards.of(f32, 1), random.Random(0))
    assert [(w.src_rank, w.src_offset, w.dst_rank, w.dst_offset, w.length) for w in plan.runs] == [
        (0, 0, 0, 0, 2 * hb), (1, 0, 0, 2 * hb, hb)]                   # rank 1's head lands after rank 0's two
    plan = plan_transfer(KvShards.of(f32, 1), KvShards.of(f32, 2), random.Random(0))
    assert [(w.src_rank, w.src_offset, w.dst_rank, w.dst_offset, w.length) for w in plan.runs] == [
        (0, 0, 0, 0, 2 * hb), (0, 2 * hb, 1, 0, hb)]
    # prefill 1 -> decode 4 with 2 KV heads: every decode replica receives its head.
    two = KvLayout(LAYERS, 4, 2, PAGE, HEAD_DIM, "float32")
    plan = plan_transfer(KvShards.of(two, 1), KvShards.of(two, 4), random.Random(0))
    assert [(w.dst_rank, w.src_offset, w.length) for w in plan.runs] == [(0, 0, hb), (1, 0, hb), (2, hb, hb),
                                                                          (3, hb, hb)]


def test_source_replicas_are_chosen_at_random_and_reproducibly():
    two = KvLayout(LAYERS, 4, 2, PAGE, HEAD_DIM, "float32")
    src, dst = KvShards.of(two, 8), KvShards.of(two, 1)          # each head on 4 prefill ranks
    chosen: dict[tuple[int, ...], set[int]] = {(0,): set(), (1,): set()}
    for seed in range(40):
        plan = plan_transfer(src, dst, random.Random(seed))
        assert plan == plan_transfer(src, dst, random.Random(seed))
        for w in plan.runs:
            chosen[w.heads].add(w.src_rank)
    assert chosen == {(0,): {0, 1, 2, 3}, (1,): {4, 5, 6, 7}}


def test_tp1_is_the_one_page_write_the_sender_makes_today():
    layout = KvLayout(3, 10, 3, 16, 64, "float32")
    shards = KvShards.of(layout)
    plan = plan_transfer(shards, shards, random.Random(0))
    src, dst = np.array([4, 7]), np.array([1, 2])
    (rw,) = plan.layer_writes(2, src, dst)
    sk, sv = layout.page_offsets(2, src)
    dk, dv = layout.page_offsets(2, dst)
    assert (rw.src_rank, rw.dst_rank) == (0, 0)
    assert np.array_equal(rw.src_offsets, np.concatenate([sk, sv]))
    assert np.array_equal(rw.dst_offsets, np.concatenate([dk, dv]))
    assert np.array_equal(rw.lengths, np.full(4, layout.page_nbytes, dtype=np.uint64))
    assert expected_writes(511, layout, ShardingScheme(), ShardingScheme()) == 32 * 3 * 2 + 1


@pytest.mark.parametrize("field,value", [("dtype", "bfloat16"), ("head_dim", 32), ("page_size", 8),
                                         ("num_layers", 3), ("kv_heads", 4)])
def test_incompatible_layouts_are_refused_naming_both_sides(field, value):
    a = KvLayout(LAYERS, 4, 2, PAGE, HEAD_DIM, "float32")
    b = KvLayout(**{**a.__dict__, field: value})
    src, dst = KvShards.of(a, 2), KvShards.of(b, 1)
    for call in (lambda: check_compatible(src, dst), lambda: plan_transfer(src, dst, random.Random(0)),
                 lambda: expected_page_writes(src, dst, 3)):
        with pytest.raises(ValueError, match=rf"differ in {field}.*prefill side \(tp 2, .*decode side \(tp 1, "):
            call()
    with pytest.raises(ValueError, match=rf"differ in {field}"):   # the 1:1 check a ticket makes
        a.compatible_with(b)


def test_rank_buffers_off_the_head_boundary_are_refused():
    scheme = TpScheme.split(3, 2)
    rank = KvLayout(LAYERS, 4, 2, PAGE, HEAD_DIM, "float32")
    ok = KvShards.from_rank_layouts(scheme, [rank, KvLayout(LAYERS, 4, 1, PAGE, HEAD_DIM, "float32")])
    assert ok == KvShards.of(KvLayout(LAYERS, 4, 3, PAGE, HEAD_DIM, "float32"), 2)
    with pytest.raises(ValueError, match="rank 1's buffer holds 2 KV heads .* gives it 1: the split is not at"):
        KvShards.from_rank_layouts(scheme, [rank, rank])
    with pytest.raises(ValueError, match="rank 1's geometry"):
        KvShards.from_rank_layouts(scheme, [rank, KvLayout(LAYERS, 5, 1, PAGE, HEAD_DIM, "float32")])
    with pytest.raises(ValueError, match="cannot split 3 KV heads over tensor-parallel size 4"):
        expected_writes(17, KvLayout(LAYERS, 4, 3, PAGE, HEAD_DIM, "float32"), ShardingScheme(4), ShardingScheme(1))
