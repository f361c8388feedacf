"""The engine's head rule (pdserve/model/tp.py) and the transfer plan's (kv_messenger/shard_plan.py)
are written twice, because the engine room may not import kv_messenger. This test keeps them one rule:
over a wide grid of (query heads, KV heads, TP size) both give the same heads per rank, or both refuse
with a ValueError; and the engine's whole-model plan assigns each rank the KV heads the transfer plan's
scheme says it holds."""

from __future__ import annotations

import pytest

from kv_messenger import shard_plan
from pdserve.model import tp

KV_HEADS = range(1, 17)
TP_SIZES = range(1, 33)
GROUPS = range(1, 9)          # query heads per KV head


def _outcome(fn, *args):
    """('ok', value) or ('refused', None); anything but a ValueError propagates."""
    try:
        return "ok", fn(*args)
    except ValueError:
        return "refused", None


def test_kv_heads_agree_over_grid():
    splits = refusals = 0
    for k in KV_HEADS:
        for n in TP_SIZES:
            engine = _outcome(tp.shard_kv_heads, k, n)
            plan = _outcome(shard_plan.shard_kv_heads, k, n)
            assert engine[0] == plan[0], (k, n, engine, plan)
            if engine[0] == "ok":
                assert engine[1] == plan[1], (k, n, engine[1], plan[1])
                splits += 1
            else:
                refusals += 1
    # the grid reaches all three branches: even/uneven groups, replica sets and refusals
    assert splits > 100 and refusals > 100, (splits, refusals)


def test_query_heads_agree_over_grid():
    replicated = uneven = refusals = 0
    for k in KV_HEADS:
        for g in GROUPS:
            q = k * g
            for n in TP_SIZES:
                engine = _outcome(tp.shard_query_heads, q, k, n)
                plan = _outcome(shard_plan.shard_query_heads, q, k, n)
                assert engine[0] == plan[0], (q, k, n, engine, plan)
                if engine[0] == "refused":
                    refusals += 1
                    continue
                # the engine answers [start, end) per rank, the plan the heads themselves
                as_heads = tuple(tuple(range(a, b)) for a, b in engine[1])
                assert as_heads == plan[1], (q, k, n, engine[1], plan[1])
                replicated += n > k
                uneven += n <= k and k % n != 0
    assert replicated > 50 and uneven > 50 and refusals > 100, (replicated, uneven, refusals)


@pytest.mark.parametrize("q,k", [(0, 1), (3, 2), (7, 4), (-4, 2)])
def test_query_heads_not_whole_groups_refused_by_both(q, k):
    for n in (1, 2, 4):
        with pytest.raises(ValueError):
            tp.shard_query_heads(q, k, n)
        with pytest.raises(ValueError):
            shard_plan.shard_query_heads(q, k, n)


@pytest.mark.parametrize("k,n", [(0, 1), (1, 0), (-2, 2), (2, -1), (2.0, 1), (2, "2"), (True, 1), (2, False)])
def test_bad_counts_refused_by_both(k, n):
    with pytest.raises(ValueError):
        tp.shard_kv_heads(k, n)
    with pytest.raises(ValueError):
        shard_plan.shard_kv_heads(k, n)


def test_engine_plan_ranks_hold_the_transfer_schemes_heads():
    # TP sizes up to tp.MLP_FOLD_BLOCKS: beyond it the engine refuses for the MLP, not the heads
    checked = 0
    for k in KV_HEADS:
        for g in (1, 2, 3, 4, 8):
            for n in range(1, tp.MLP_FOLD_BLOCKS + 1):
                heads = _outcome(shard_plan.shard_query_heads, k * g, k, n)
                model = _outcome(tp.plan_tensor_parallel, k * g, k, 1024, n)
                assert model[0] == heads[0], (k, g, n, model, heads)
                if model[0] == "refused":
                    continue
                scheme = shard_plan.TpScheme.split(k, n)
                assert model[1].kv_head_assignment == scheme.rank_heads, (k, g, n)
                assert tuple(tuple(range(*r.q_heads)) for r in model[1].ranks) == heads[1], (k, g, n)
                checked += 1
    assert checked > 200, checked
