"""Fused CPU ops (pdserve/kernels/ops/norm_act.py): agree with torch, update the residual in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.native import skip_unless_built

from pdserve.kernels.ops import native
from pdserve.kernels.ops.norm_act import add_rms_norm, argmax_rows, rms_norm_reference, silu_mul

pytestmark = skip_unless_built(native.available(), "the C ops (pdserve.kernels.ops._cpu_ops)",
                               native.unavailable_reason())


@pytest.mark.parametrize("rows,size", [(1, 8), (3, 13), (32, 576), (5, 960), (0, 16)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(rows: int, size: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(rows * 100 + size)
    h = torch.randn(rows, size, generator=g) * 3                         # [T, H]
    delta = torch.randn(rows, size, generator=g) if with_delta else None  # [T, H]
    w = torch.randn(size, generator=g)                                   # [H]
    expected_h = h + delta if with_delta else h.clone()
    expected = rms_norm_reference(expected_h.double(), w.double(), 1e-5)
    out = add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, expected_h)                                    # residual updated in place
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_add_rms_norm_strided_rows_and_fallback() -> None:
    big = torch.randn(4, 40)
    h = big[:, 4:36]                                                     # [4, 32], row stride 40
    delta = torch.randn(4, 32)
    w = torch.rand(32)
    expected = rms_norm_reference(h + delta, w, 1e-6)
    out = add_rms_norm(h, delta, w, 1e-6)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(big[:, 4:36], h)                                  # the view's storage was updated
    hb = torch.randn(4, 32).bfloat16()                                   # torch path
    db = torch.randn(4, 32).bfloat16()
    expected_b = rms_norm_reference(hb + db, w.bfloat16(), 1e-6)
    assert torch.equal(add_rms_norm(hb, db, w.bfloat16(), 1e-6), expected_b)


def test_add_rms_norm_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"delta \(2, 8\) does not match h \(2, 9\)"):
        add_rms_norm(torch.randn(2, 9), torch.randn(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match=r"weight \(8,\)"):
        add_rms_norm(torch.randn(2, 9), None, torch.ones(8), 1e-5)


@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 13), (32, 1536), (0, 8)])
def test_silu_mul(rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 8              # [T, 2I]
    expected = F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    out = silu_mul(gate_up)
    assert out.shape == (rows, inter)
    assert torch.allclose(out.double(), expected, rtol=2e-6, atol=1e-7)


def test_silu_mul_rows_split_over_threads_give_the_one_thread_bits() -> None:
    gate_up = torch.randn(32, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 8  # [T, 2I]: threaded
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = silu_mul(gate_up)
        torch.set_num_threads(2)
        two = silu_mul(gate_up)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_silu_extremes() -> None:
    gate = torch.tensor([[-200.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 200.0]])
    out = silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    expected = F.silu(gate.double())
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), expected, rtol=2e-6, atol=1e-30)
    with pytest.raises(ValueError, match="equal halves"):
        silu_mul(torch.randn(2, 7))


def test_silu_vector_lanes_follow_exp8s_range() -> None:
    # exp8 (pdserve/kernels/csrc/exp8.h) gives exactly 0 for x <= -87, so a vector lane's silu(g) is
    # -0.0 there (torch: a tiny negative number); just above -87 it is exp's normal-range result.
    gate = torch.tensor([[-87.0, -87.5, -100.0, -1e30, -86.9, -80.0, -50.0, -30.0]])  # one 8-lane vector
    out = silu_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))[0]
    assert torch.equal(out[:4], torch.zeros(4)) and (out[4:] < 0).all()
    assert torch.allclose(out[4:].double(), F.silu(gate[0, 4:].double()), rtol=2e-6, atol=0)


def test_argmax_rows_matches_torch() -> None:
    x = torch.randn(9, 1003)
    x[1, 17] = x[1, 900] = x[1].max() + 1                                # tie: first index wins
    x[2, 500] = float("nan")                                             # NaN wins, as in torch
    x[2, 600] = float("nan")
    x[3] = float("-inf")
    x[4, 1002] = float("inf")                                            # in the scalar tail
    x[5, :] = 0.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    strided = torch.randn(4, 2000)[:, 7:1507]
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))
    assert torch.equal(argmax_rows(torch.randn(0, 5)), torch.randn(0, 5).argmax(dim=-1))
