"""The KV-head split rule (pdserve/model/tp.py, issue 30 item 4), written once: both the engine's
ranks and the transfer plan's schemes (kv_messenger/shard_plan.py, through the engine's connector
seam) are that one function, and over a wide grid of (query heads, KV heads, TP size) it gives an
even split by whole GQA groups with the earlier ranks holding the extra one, replica sets when TP
exceeds the heads, and refusals naming the counts for everything else (docs/tp-shard-mismatch.md)."""

from __future__ import annotations

import pytest

from kv_messenger import shard_plan
from pdserve.engine import kv_connector
from pdserve.model import tp

KV_HEADS = range(1, 17)
TP_SIZES = range(1, 33)
GROUPS = range(1, 9)          # query heads per KV head


def test_both_sides_import_the_one_rule():
    assert kv_connector.shard_kv_heads is tp.shard_kv_heads
    assert shard_plan.shard_kv_heads is tp.shard_kv_heads
    assert shard_plan.TpScheme.split(3, 2).rank_heads == tp.shard_kv_heads(3, 2)


def test_kv_heads_over_grid():
    even = uneven = replicated = refused = 0
    for k in KV_HEADS:
        for n in TP_SIZES:
            if n > k and n % k:
                with pytest.raises(ValueError, match=rf"cannot split {k} KV heads over tensor-parallel size {n}"):
                    tp.shard_kv_heads(k, n)
                refused += 1
                continue
            split = tp.shard_kv_heads(k, n)
            assert len(split) == n, (k, n, split)
            if n > k:      # replica sets of R = n / k consecutive ranks, one head each
                r = n // k
                assert split == tuple((rank // r,) for rank in range(n)), (k, n, split)
                replicated += 1
                continue
            # contiguous, in rank order, every head once; the first k % n ranks hold one more
            assert [h for heads in split for h in heads] == list(range(k)), (k, n, split)
            base, extra = divmod(k, n)
            assert [len(heads) for heads in split] == [base + (rank < extra) for rank in range(n)], (k, n, split)
            even += extra == 0
            uneven += extra != 0
    # the grid reaches every branch: even and uneven groups, replica sets and refusals
    assert even > 30 and uneven > 50 and replicated > 20 and refused > 100, (even, uneven, replicated, refused)


def test_query_heads_over_grid():
    replicated = uneven = refused = 0
    for k in KV_HEADS:
        for g in GROUPS:
            q = k * g
            for n in TP_SIZES:
                if n > k and (n % k or g % (n // k)):
                    with pytest.raises(ValueError):
                        tp.shard_query_heads(q, k, n)
                    refused += 1
                    continue
                ranges = tp.shard_query_heads(q, k, n)
                kv = tp.shard_kv_heads(k, n)
                if n <= k:     # a rank holds the query heads of its KV heads' groups
                    assert ranges == tuple((heads[0] * g, (heads[-1] + 1) * g) for heads in kv), (q, k, n)
                    uneven += k % n != 0
                    continue
                # a replica set splits its KV head's g query heads evenly, in rank order
                r, per = n // k, g // (n // k)
                assert ranges == tuple((kv[rank][0] * g + (rank % r) * per, kv[rank][0] * g + (rank % r + 1) * per)
                                       for rank in range(n)), (q, k, n)
                replicated += 1
    assert replicated > 50 and uneven > 50 and refused > 100, (replicated, uneven, refused)


def test_replicas_that_cannot_split_their_group_are_refused_naming_the_counts():
    with pytest.raises(ValueError, match=r"6 query heads \(3 per KV head, 2 KV heads\).*each KV head's 4 replicas"):
        tp.shard_query_heads(6, 2, 8)


@pytest.mark.parametrize("q,k", [(0, 1), (3, 2), (7, 4), (-4, 2)])
def test_query_heads_not_whole_groups_refused(q, k):
    for n in (1, 2, 4):
        with pytest.raises(ValueError, match="are not whole GQA groups"):
            tp.shard_query_heads(q, k, n)


@pytest.mark.parametrize("k,n", [(0, 1), (1, 0), (-2, 2), (2, -1), (2.0, 1), (2, "2"), (True, 1), (2, False)])
def test_bad_counts_refused(k, n):
    with pytest.raises(ValueError, match="both must be integers >= 1"):
        tp.shard_kv_heads(k, n)
    with pytest.raises(ValueError, match="both must be integers >= 1"):
        tp.shard_query_heads(4, k, n)


def test_engine_plan_ranks_hold_the_transfer_schemes_heads():
    # the whole-model plan (what the engine's ranks load) against the scheme the transfer plans with;
    # TP sizes up to tp.MLP_FOLD_BLOCKS: beyond it the engine refuses for the MLP, not the heads
    checked = 0
    for k in KV_HEADS:
        for g in (1, 2, 3, 4, 8):
            for n in range(1, tp.MLP_FOLD_BLOCKS + 1):
                try:
                    heads = tp.shard_query_heads(k * g, k, n)
                except ValueError:
                    with pytest.raises(ValueError, match=f"KV heads over tensor_parallel_size {n}"):
                        tp.plan_tensor_parallel(k * g, k, 1024, n)
                    continue
                model = tp.plan_tensor_parallel(k * g, k, 1024, n)
                assert model.kv_head_assignment == shard_plan.TpScheme.split(k, n).rank_heads, (k, g, n)
                assert tuple(r.q_heads for r in model.ranks) == heads, (k, g, n)
                checked += 1
    assert checked > 200, checked
