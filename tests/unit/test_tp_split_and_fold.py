"""Tensor parallelism, in process (E22, issue 16): the head and MLP split rule, the refusal of
splits that cannot be made, the TP-invariant blocked fold of the row-parallel kernels (a rank
holding some of the blocks reproduces the TP 1 sum bit for bit when it continues the fold), and
the step message's round trip. The rank processes themselves: tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.attention.base import AttentionBatch
from pdserve.kernels.ops.linear import MAX_ROWS, linear_block_parts, linear_blocked
from pdserve.kernels.ops.native import available
from pdserve.model.tp import (
    mlp_fold_block,
    o_proj_fold_heads,
    plan_tensor_parallel,
    shard_kv_heads,
    shard_query_heads,
)
from pdserve.parallel.messages import StepMessage


def test_uneven_groups_earlier_ranks_get_the_extra_group():
    assert shard_kv_heads(3, 2) == ((0, 1), (2,))
    assert shard_query_heads(9, 3, 2) == ((0, 6), (6, 9))     # the default model at TP 2: 6 and 3 heads
    assert shard_kv_heads(5, 3) == ((0, 1), (2, 3), (4,))
    assert shard_kv_heads(4, 2) == ((0, 1), (2, 3))


def test_replica_sets_split_their_groups_query_heads():
    assert shard_kv_heads(2, 4) == ((0,), (0,), (1,), (1,))
    assert shard_query_heads(4, 2, 4) == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert shard_kv_heads(3, 9) == tuple((r // 3,) for r in range(9))


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "words"), [
    (9, 3, 4, ["3 KV heads", "tensor_parallel_size 4"]),              # 4 > 3, 4 % 3 != 0
    (9, 3, 6, ["9 query heads", "3 per KV head", "3 % 2"]),            # replica sets of 2 over 3-head groups
])
def test_impossible_splits_are_refused_naming_the_counts(heads, kv_heads, tp, words):
    with pytest.raises(ValueError) as info:
        plan_tensor_parallel(heads, kv_heads, 1536, tp)
    for w in words:
        assert w in str(info.value)


def test_more_ranks_than_mlp_blocks_or_the_largest_size_is_refused():
    with pytest.raises(ValueError, match=r"intermediate_size 24 \(3 fold blocks of 8\).*tensor_parallel_size 4"):
        plan_tensor_parallel(4, 4, 24, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size 16 is above the largest supported, 8"):
        plan_tensor_parallel(16, 16, 1536, 16)


def test_o_proj_fold_blocks_are_the_finest_split_a_supported_size_makes():
    assert o_proj_fold_heads(9, 3) == 3     # default model: no size <= 8 splits a group (9 would)
    assert o_proj_fold_heads(4, 2) == 1     # TP 4: replica sets of 2 split each 2-head group
    assert o_proj_fold_heads(12, 2) == 1    # replica sets of 2 and 3 (TP 4, 6): 3-head and 2-head shares
    assert o_proj_fold_heads(16, 8) == 2    # 2-head groups, no size <= 8 splits them
    for heads, kv in ((9, 3), (4, 2), (12, 2), (16, 8), (8, 1)):
        g = o_proj_fold_heads(heads, kv)
        for tp in range(1, 9):
            try:
                q = shard_query_heads(heads, kv, tp)
            except ValueError:
                continue
            assert all(a % g == 0 and b % g == 0 for a, b in q), (heads, kv, tp)


def test_mlp_rows_are_contiguous_whole_blocks():
    plan = plan_tensor_parallel(9, 3, 1536, 3)
    assert mlp_fold_block(1536) == 192
    assert [r.mlp_rows for r in plan.ranks] == [(0, 576), (576, 1152), (1152, 1536)]  # 3, 3, 2 blocks
    assert plan.kv_head_assignment == ((0,), (1,), (2,))


def _rank_fold(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, block: int, cuts: list[int]) -> torch.Tensor:
    """What RowLinear's ranks compute, in one process: rank 0 folds its prefix, every later rank adds
    its blocks' partials to the running sum, the last adds the bias."""
    y = linear_blocked(x[:, : cuts[1]], w[:, : cuts[1]].contiguous(), None, block)
    for a, b in zip(cuts[1:-1], cuts[2:], strict=True):
        for p in linear_block_parts(x[:, a:b].contiguous(), w[:, a:b].contiguous(), block):
            y += p
    return y + bias


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, 33, 100])   # the C kernel up to 32 rows, torch's matmul above
@pytest.mark.parametrize(("K", "block", "cuts"), [
    (576, 192, [0, 384, 576]),           # o_proj of the default model at TP 2 (2 and 1 groups of 3 heads)
    (64, 16, [0, 16, 32, 48, 64]),       # o_proj of a replica-set split (one 16-wide head per rank)
    (1536, 192, [0, 768, 1536]),         # down_proj at TP 2
    (1536, 192, [0, 576, 1152, 1536]),   # down_proj at TP 3 (3, 3, 2 blocks)
    (100, 24, [0, 48, 96, 100]),         # a short last block and a k tail inside blocks
])
def test_ranks_continuing_the_fold_give_the_tp1_bits(rows, K, block, cuts, one_thread):
    if rows <= MAX_ROWS and not available():
        pytest.skip("C ops not built")
    g = torch.Generator().manual_seed(rows * 7 + K)
    x, w = torch.randn(rows, K, generator=g), torch.randn(96, K, generator=g)
    bias = torch.randn(96, generator=g)
    tp1 = linear_blocked(x, w, bias, block)
    assert torch.equal(_rank_fold(x, w, bias, block, cuts), tp1)
    assert torch.allclose(tp1, F.linear(x, w, bias), rtol=1e-4, atol=1e-3)   # the same product


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "N", "K", "block"), [
    (33, 576, 576, 192), (100, 576, 1536, 192), (257, 96, 64, 16), (64, 40, 100, 24)])  # last: a short block
def test_torch_path_blocks_in_one_bmm_are_the_per_block_f_linear_fold(rows, N, K, block, threads):
    """The torch path (over MAX_ROWS rows) takes every block's product from one torch.bmm: each must
    be F.linear's product of that block, folded left to right, bit for bit, on a row-major slice too."""
    g = torch.Generator().manual_seed(rows + K)
    wide, w, bias = torch.randn(rows, K + 8, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x = wide[:, 4 : 4 + K]                                 # [rows, K], row stride K + 8, storage offset 4
    ref = F.linear(x[:, :block], w[:, :block])
    for k0 in range(block, K, block):
        ref = ref + F.linear(x[:, k0 : k0 + block], w[:, k0 : k0 + block])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(linear_blocked(x, w, bias, block), ref + bias)
        parts = linear_block_parts(x, w, block)            # [nb, rows, N]
        assert all(torch.equal(p, F.linear(x[:, j * block : (j + 1) * block], w[:, j * block : (j + 1) * block]))
                   for j, p in enumerate(parts))
    finally:
        torch.set_num_threads(previous)


def test_one_block_is_the_plain_kernel(one_thread):
    x, w = torch.randn(4, 200), torch.randn(48, 200)
    assert torch.equal(linear_blocked(x, w, None, 200), linear_blocked(x, w, None, 10_000))
    assert torch.allclose(linear_blocked(x, w, None, 8), x @ w.T, rtol=1e-4, atol=1e-4)


def test_step_message_round_trip_rebuilds_kv_rows_for_the_rank():
    P, H = 4, 2
    pages, offs = torch.tensor([3, 3, 5], dtype=torch.int64), torch.tensor([0, 1, 2], dtype=torch.int64)
    batch = AttentionBatch(query_start=torch.tensor([0, 1, 3], dtype=torch.int32),
                           context_lens=torch.tensor([1, 11], dtype=torch.int32),
                           block_tables=torch.tensor([[3, 0, 0], [1, 2, 5]], dtype=torch.int32),
                           slot_pages=pages, slot_offsets=offs, kv_rows=torch.zeros(0, dtype=torch.int64),
                           num_decode=1, q_lens=(1, 2), ctx_lens=(1, 11), page_size=P, window=7)
    msg = StepMessage(torch.tensor([5, 6, 7]), torch.tensor([0, 9, 10]), (batch,))
    back = StepMessage.decode(msg.encode(), kv_heads=H)
    assert torch.equal(back.input_ids, msg.input_ids) and torch.equal(back.positions, msg.positions)
    b = back.batches[0]
    for name in ("query_start", "context_lens", "block_tables", "slot_pages", "slot_offsets"):
        assert torch.equal(getattr(b, name), getattr(batch, name)), name
        assert getattr(b, name).dtype == getattr(batch, name).dtype, name
    assert (b.num_decode, b.q_lens, b.ctx_lens, b.page_size, b.window) == (1, (1, 2), (1, 11), P, 7)
    expected = ((pages[:, None] * H + torch.arange(H)[None, :]) * P + offs[:, None]).reshape(-1)
    assert torch.equal(b.kv_rows, expected)
    assert back.num_layers is None                          # every layer
    draft = StepMessage(msg.input_ids, msg.positions, (batch,), num_layers=8)   # a self-draft's pass
    assert StepMessage.decode(draft.encode(), kv_heads=H).num_layers == 8
    with pytest.raises(ValueError, match="at least one layer, not num_layers=0"):
        StepMessage(msg.input_ids, msg.positions, (batch,), num_layers=0)


def test_tensor_parallel_flags_are_generated_with_the_tp_alias():
    import argparse

    from pdserve.serving.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["-tp", "2"])).tensor_parallel_size == 2
    assert engine_config(p.parse_args(["--tensor-parallel-size", "4"])).tensor_parallel_size == 4
    assert engine_config(p.parse_args([])).tensor_parallel_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        engine_config(p.parse_args(["-tp", "0"]))


def test_tp_invariant_is_auto_on_iff_tp_above_1_and_the_flags_force_it():
    import argparse

    from pdserve.engine.config import EngineConfig
    from pdserve.serving.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    resolved = {argv: (c.tp_invariant, c.tp_invariant_active)
                for argv in ((), ("-tp", "2"), ("--tp-invariant",), ("--no-tp-invariant", "-tp", "2"))
                for c in [engine_config(p.parse_args(list(argv)))]}
    assert resolved == {
        (): (None, False),                                  # TP 1 default: the plain kernels' sums
        ("-tp", "2"): (None, True),                         # auto: on above TP 1
        ("--tp-invariant",): (True, True),                  # a TP 1 node matching TP > 1 nodes
        ("--no-tp-invariant", "-tp", "2"): (False, False),
    }
    assert "(default: auto, on iff -tp > 1;" in " ".join(p.format_help().split())
    with pytest.raises(ValueError, match="tp_invariant must be True, False or None .*got 'yes'"):
        EngineConfig(tp_invariant="yes")


def test_tp1_model_sums_in_one_block_unless_asked_for_the_fold():
    from transformers import LlamaConfig

    from pdserve.model.arch import ModelArch
    from pdserve.model.registry import build_model

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    arch = ModelArch.from_hf_config(cfg)
    plain = build_model(arch, cfg, torch.float32, 64).layers[0]
    folded = build_model(arch, cfg, torch.float32, 64, tp_invariant=True).layers[0]
    assert (plain.self_attn.o_proj.fold_block, plain.mlp.down_proj.fold_block) == (32, 64)   # whole rows
    assert folded.self_attn.o_proj.fold_block == o_proj_fold_heads(4, 2) * 8
    assert folded.mlp.down_proj.fold_block == mlp_fold_block(64)


def test_the_launcher_gives_every_node_tp_invariant_when_any_node_runs_tp_above_1():
    import argparse

    from pdserve.tools.launcher import ClusterConfig, add_up_args, config_from_args, plan

    def argvs(config: ClusterConfig) -> dict[str, tuple[str, ...]]:
        return {s.name: s.argv for s in plan(config, ports=range(42000, 42010)) if s.name != "router"}

    def has(argv: tuple[str, ...], *flags: str) -> bool:
        return any(argv[i : i + len(flags)] == flags for i in range(len(argv)))

    plain = argvs(ClusterConfig(prefill=1, decode=1, node_metrics=False))
    assert not any(has(a, "--tp-invariant") or has(a, "-tp") for a in plain.values())
    mixed = argvs(ClusterConfig(prefill=1, decode=2, prefill_tp=2, node_metrics=False))
    assert has(mixed["prefill-0"], "-tp", "2") and not has(mixed["decode-0"], "-tp")
    assert all(has(a, "--tp-invariant") for a in mixed.values())     # the TP 1 decode nodes too
    uniform = argvs(ClusterConfig(colocated=2, engine_args=("-tp", "2"), node_metrics=False))
    assert all(has(a, "--tp-invariant") for a in uniform.values())
    override = argvs(ClusterConfig(decode_tp=2, engine_args=("--no-tp-invariant",), node_metrics=False))
    a = override["prefill-0"]                                          # the explicit choice comes last
    assert a.index("--no-tp-invariant") > a.index("--tp-invariant")
    with pytest.raises(ValueError, match=r"engine_args set the tensor-parallel size \(2\).*prefill_tp"):
        ClusterConfig(prefill_tp=2, engine_args=("--tensor-parallel-size=2",))
    with pytest.raises(ValueError, match="decode_tp must be >= 1"):
        ClusterConfig(decode_tp=0)

    p = argparse.ArgumentParser()
    add_up_args(p)
    c = config_from_args(p.parse_args(["--tp", "2", "--decode-tp", "1"]))
    assert (c.prefill_tp, c.decode_tp) == (2, 1)
