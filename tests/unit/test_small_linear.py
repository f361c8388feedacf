"""The small-batch linear kernel (pdserve/kernels/ops): exact enough, batch invariant, dispatched right."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.native import skip_unless_built

from pdserve.kernels.ops import linear as ops_linear
from pdserve.kernels.ops.linear import linear, max_rows, small_linear

pytestmark = skip_unless_built(ops_linear.available(), "the small linear kernel (pdserve.kernels.ops._cpu_ops)",
                               ops_linear.unavailable_reason())


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 8, 9, 17])
@pytest.mark.parametrize("n,k", [(1, 8), (2, 13), (7, 64), (96, 576), (100, 1001)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(m: int, n: int, k: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g)                                   # [M, K]
    w = torch.randn(n, k, generator=g)                                   # [N, K]
    b = torch.randn(n, generator=g) if with_bias else None               # [N]
    y = small_linear(x, w, b)                                            # [M, N]
    assert y.shape == (m, n) and y.dtype == torch.float32
    # float32 dot products of length K with unit-variance terms: error ~ eps * sqrt(K) * |terms|.
    tol = 1e-6 * k ** 0.5 * 4 + 1e-6
    assert torch.allclose(y.double(), _reference(x, w, b), atol=tol, rtol=1e-5)


def test_strided_rows_and_single_row_views() -> None:
    big = torch.randn(6, 300)
    x = big[:, 10:266]                                                   # [6, 256], row stride 300
    w = torch.randn(33, 256)
    assert torch.allclose(small_linear(x, w).double(), _reference(x, w, None), atol=1e-4)
    col = torch.randn(256, 4)[:, 1:2].t()                                # [1, 256], column stride 4
    assert torch.allclose(small_linear(col, w).double(), _reference(col, w, None), atol=1e-4)


def test_batch_invariant_across_rows_and_threads() -> None:
    """A row's output is bit-identical whatever other rows or thread count share the call."""
    x = torch.randn(16, 576)
    w = torch.randn(1537, 576)
    b = torch.randn(1537)
    full = small_linear(x, w, b, num_threads=1)
    for threads in (2, 3):
        assert torch.equal(small_linear(x, w, b, num_threads=threads), full)
    for i in range(16):
        assert torch.equal(small_linear(x[i : i + 1], w, b)[0], full[i])
    assert torch.equal(small_linear(x[3:10], w, b), full[3:10])


def test_dispatch() -> None:
    w = torch.randn(64, 32)
    few = torch.randn(max_rows(), 32)
    assert torch.equal(linear(few, w), small_linear(few, w))
    many = torch.randn(max_rows() + 1, 32)
    assert torch.equal(linear(many, w), F.linear(many, w))
    half = torch.randn(2, 32, dtype=torch.bfloat16)
    assert torch.equal(linear(half, w.bfloat16()), F.linear(half, w.bfloat16()))
    transposed = torch.randn(64, 32).t()                                 # non-contiguous weight
    x = torch.randn(2, 64)
    assert torch.equal(linear(x, transposed), F.linear(x, transposed))
    batched = torch.randn(2, 3, 32)                                      # not a matrix
    assert torch.equal(linear(batched, w), F.linear(batched, w))


def test_dispatch_never_hands_the_kernel_a_shape_or_layout_it_would_misread() -> None:
    w, b = torch.randn(64, 32), torch.randn(64)
    with pytest.raises(RuntimeError):                                    # x has 33 columns, w 32
        linear(torch.randn(4, 33), w)
    with pytest.raises(RuntimeError):                                    # a bias of the wrong length
        linear(torch.randn(4, 32), w, torch.randn(63))
    row = torch.randn(1, 32)
    overlapping = row.expand(4, 32)                                      # stride (0, 1): rows overlap
    assert torch.equal(linear(overlapping, w, b), small_linear(row, w, b).expand(4, 64))
    with pytest.raises(RuntimeError):                                    # a float64 bias: torch's dtype error
        linear(torch.randn(4, 32), w, b.double())


def test_bad_arguments_name_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"x \(2, 8\) and weight \(4, 9\)"):
        small_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="float32"):
        small_linear(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8))
    with pytest.raises(ValueError, match="contiguous"):
        small_linear(torch.randn(2, 8), torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="bias"):
        small_linear(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5))


def test_the_row_limit_is_the_kernel_constant() -> None:
    # The C layer ops (EngineConfig.small_batch_max_tokens <= MAX_ROWS) rely on linear() taking the
    # kernel for every pass they run; no environment variable moves it.
    assert max_rows() == ops_linear.MAX_ROWS == 32
