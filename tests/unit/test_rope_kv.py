"""The C rotary embedding and KV-pool write (pdserve/kernels/ops/rope_kv.py) against their torch definitions.

rope must give the torch path's bits (no fused multiply-add; the engine's greedy outputs equal
transformers' only if it does); write_kv_rows must put every (token, head) row exactly where
index_copy_ puts it, in float32 or rounded to bfloat16 as .to(torch.bfloat16) rounds, and refuse a
row outside the pool before writing anything.
"""

from __future__ import annotations

import pytest
import torch
from support.native import skip_unless_built

from pdserve.kernels.ops import native
from pdserve.kernels.ops.rope_kv import rope, rope_qk, rope_reference, write_kv_rows

pytestmark = skip_unless_built(native.available(), "the C ops (pdserve.kernels.ops._cpu_ops)",
                               native.unavailable_reason())


def tables(T: int, D: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(T, D // 2, generator=gen) * 100
    emb = torch.cat((angle, angle), dim=-1)                                      # [T, D]
    sin = emb.sin()
    return emb.cos(), torch.cat((-sin[:, : D // 2], sin[:, D // 2 :]), dim=-1)  # cos, sin_signed: [T, D]


@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 9, 3, 64), (37, 9, 3, 64), (5, 4, 1, 128), (3, 2, 2, 16)])
def test_rope_matches_torch_bit_for_bit_on_strided_qkv_views(T, Hq, Hkv, D):
    gen = torch.Generator().manual_seed(T * D)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen)                     # [T, (Hq + 2 Hkv) D]
    cos, sin = tables(T, D, gen)
    q_view = qkv[:, : Hq * D].view(T, Hq, D)                                    # token stride (Hq + 2 Hkv) D
    k_view = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    for x in (q_view, k_view):
        got, want = rope(x, cos, sin), rope_reference(x, cos, sin)
        assert got.is_contiguous() and got.shape == x.shape
        assert torch.equal(got, want)
    assert torch.equal(qkv[:, : Hq * D].view(T, Hq, D), q_view)  # the input is not touched


@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 9, 3, 64), (37, 9, 3, 64), (5, 4, 1, 128), (3, 2, 2, 16)])
def test_rope_qk_gives_rope_of_the_q_and_k_heads_of_qkv_rows(T, Hq, Hkv, D):
    gen = torch.Generator().manual_seed(7 * T + D)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen)                     # [T, (Hq + 2 Hkv) D]
    cos, sin = tables(T, D, gen)
    q, k = rope_qk(qkv, cos, sin, Hq, Hkv, D)
    assert q.shape == (T, Hq, D) and k.shape == (T, Hkv, D) and q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, rope_reference(qkv[:, : Hq * D].view(T, Hq, D), cos, sin))
    assert torch.equal(k, rope_reference(qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D), cos, sin))
    # a single row cut out of a wider matrix (any row stride), and the torch path (bfloat16)
    wide = torch.randn(3, 2 * qkv.shape[1], generator=gen)[1:2, : qkv.shape[1]]
    q1, k1 = rope_qk(wide, cos[:1], sin[:1], Hq, Hkv, D)
    assert torch.equal(q1, rope_reference(wide[:, : Hq * D].view(1, Hq, D), cos[:1], sin[:1]))
    assert torch.equal(k1, rope_reference(wide[:, Hq * D : (Hq + Hkv) * D].view(1, Hkv, D), cos[:1], sin[:1]))
    qb, kb = rope_qk(qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(), Hq, Hkv, D)
    assert torch.equal(qb, rope_reference(qkv.bfloat16()[:, : Hq * D].view(T, Hq, D), cos.bfloat16(), sin.bfloat16()))
    assert kb.dtype == torch.bfloat16 and kb.shape == (T, Hkv, D)


def test_rope_qk_refuses_rows_narrower_than_the_q_and_k_heads():
    gen = torch.Generator().manual_seed(3)
    cos, sin = tables(2, 16, gen)
    with pytest.raises(ValueError, match=r"qkv \(2, 48\) is narrower than q and k heads \(2 \+ 2\) x 16"):
        rope_qk(torch.randn(2, 48), cos, sin, 2, 2, 16)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_qk(torch.randn(2, 4, 16), cos, sin, 2, 2, 16)


def test_rope_falls_back_to_torch_where_c_does_not_apply_and_checks_tables():
    gen = torch.Generator().manual_seed(1)
    cos, sin = tables(4, 8, gen)
    x = torch.randn(4, 2, 8, generator=gen)  # D = 8: halves are not whole 8-lane vectors
    assert torch.equal(rope(x, cos, sin), rope_reference(x, cos, sin))
    xb = x.to(torch.bfloat16)
    assert torch.equal(rope(xb, cos.to(torch.bfloat16), sin.to(torch.bfloat16)),
                       rope_reference(xb, cos.to(torch.bfloat16), sin.to(torch.bfloat16)))
    with pytest.raises(ValueError, match=r"tables \(3, 8\) / \(4, 8\) do not match x \(4, 2, 8\)"):
        rope(x, cos[:3], sin)


def pools(N: int, Hkv: int, P: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(N, Hkv, P, D, dtype=dtype), torch.zeros(N, Hkv, P, D, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_rows_puts_each_row_where_index_copy_does(dtype):
    T, Hq, Hkv, P, D, N = 7, 6, 2, 4, 64, 9
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen)                     # [T, (Hq + 2 Hkv) D]
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D).contiguous()           # [T, Hkv, D]
    v = qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D)                                # strided, as the model passes it
    # token t goes to page pages[t], slot t % P; row = (page * Hkv + head) * P + slot
    pages = torch.tensor([3, 3, 0, 8, 5, 5, 1])
    rows = ((pages[:, None] * Hkv + torch.arange(Hkv)) * P + (torch.arange(T) % P)[:, None]).reshape(-1)
    kp, vp = pools(N, Hkv, P, D, dtype)
    write_kv_rows(k, v, kp, vp, rows)
    kr, vr = pools(N, Hkv, P, D, dtype)
    kr.view(-1, D).index_copy_(0, rows, k.reshape(-1, D).to(dtype))
    vr.view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(dtype))
    assert torch.equal(kp, kr) and torch.equal(vp, vr)


def test_bfloat16_rows_round_as_torch_does_including_ties_and_specials():
    # ties (exact halves between two bf16 values) go to even; inf and NaN survive
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.4e38, float("inf"),
                            float("-inf"), float("nan"), 1e-40, -0.0, 65504.0, 1.00390625, 2.0 ** -130])
    D = 64
    x = torch.randn(1, 1, D)
    x[0, 0, : special.numel()] = special
    kp, vp = pools(1, 1, 1, D, torch.bfloat16)
    write_kv_rows(x, x, kp, vp, torch.tensor([0]))
    want = x.reshape(D).to(torch.bfloat16)
    got = kp.reshape(D)
    assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
    assert bool(got[want.isnan()].isnan().all())


def test_write_kv_rows_refuses_a_row_outside_the_pool_before_writing_anything():
    T, Hkv, P, D, N = 2, 2, 4, 16, 3
    k = torch.ones(T, Hkv, D)
    kp, vp = pools(N, Hkv, P, D, torch.float32)
    rows = torch.tensor([0, 1, N * Hkv * P, 2])
    with pytest.raises(ValueError, match=r"entry 2 of rows is 24, outside the pool's \[0, 24\) rows"):
        write_kv_rows(k, k, kp, vp, rows)
    assert int(kp.abs().sum()) == 0 and int(vp.abs().sum()) == 0
    with pytest.raises(ValueError, match=r"rows \(3,\) disagree"):
        write_kv_rows(k, k, kp, vp, rows[:3])
    with pytest.raises(ValueError, match="do not hold rows of head dim 16"):
        write_kv_rows(k, k, kp, torch.zeros(N, Hkv, P, D, dtype=torch.bfloat16), rows)
