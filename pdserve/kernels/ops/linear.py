"""`linear(x, weight, bias)`: F.linear, with a C kernel for the few-row (decode) case on CPU.

A decode step multiplies a handful of rows (one per running sequence) by every weight matrix.
That product is bound by reading the weights once; torch's CPU GEMM does not behave that way
for 2-32 rows (its time grows with the row count: the F.linear column of
bench/results/engine/linear_kernels.md). csrc/small_linear.c reads
each weight row once per call and reuses it for every input row. It is used when

- x is a float32 CPU matrix [M, K] with unit column stride and M <= `MAX_ROWS` (32),
- the weight is a contiguous float32 CPU [N, K] (the nn.Linear layout), bias float32 [N] or None,
- the kernel module is built (`available()`); otherwise, and for everything else, F.linear runs.

Numerics: every output element is summed in one fixed order regardless of M, so a sequence's
logits do not depend on which other sequences share its decode step; the order differs from
MKL's, so results differ from F.linear by float32 rounding (a few ulp of the dot product).
`linear_blocked(x, weight, bias, block)` sums the K axis in blocks of `block` columns folded left to
right ((b0 + b1) + b2 ...; then the bias) and `linear_block_parts` returns the blocks' partial
products unfolded: the TP-invariant reductions of row-parallel layers (pdserve/model/tp.py). Each
block's product is the C kernel's (same rule as `linear`: at most MAX_ROWS float32 rows) or
torch's GEMM over that block's columns (all blocks in one torch.bmm, each as F.linear gives it);
a rank holding some of the blocks computes each one the same way, bit for bit
(tests/unit/test_tp_split_and_fold.py).
The C layer loop (pdserve/model/layer_ops.py, EngineConfig.small_batch_max_tokens) calls the
same kernel for passes of at most MAX_ROWS tokens, which is why its results match this path's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.ops.native import available, lib as _lib, unavailable_reason

__all__ = ["MAX_ROWS", "available", "linear", "linear_block_parts", "linear_blocked", "max_rows", "small_linear",
           "unavailable_reason"]

# Up to this many rows the kernel beats or matches MKL (bench.engine.linear_kernels; 1 thread:
# bench/results/engine/linear_kernels.md, 2 threads: bench/results/engine/linear_kernels-2threads.md, where MKL
# scales poorly across threads at these shapes); from 48 rows on 1 thread MKL wins.
MAX_ROWS = 32
_F32 = torch.float32


def max_rows() -> int:
    """Largest M that goes to the C kernel: MAX_ROWS, or 0 when the kernel is not built."""
    return MAX_ROWS if _lib is not None else 0


def small_linear(
    x: torch.Tensor,                 # [M, K] float32 cpu, x.stride(1) == 1
    weight: torch.Tensor,            # [N, K] float32 cpu, contiguous
    bias: torch.Tensor | None = None,  # [N] float32 or None
    num_threads: int | None = None,
) -> torch.Tensor:                   # [M, N] float32
    """y = x weight^T (+ bias) with the C kernel, for any M; raises if it cannot run."""
    if _lib is None:
        raise RuntimeError(f"small-batch linear kernel is not built: {unavailable_reason()}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"small_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"small_linear: {name} must be float32 on cpu, got {t.dtype} on {t.device}")
    if not weight.is_contiguous() or (x.shape[0] > 1 and x.stride(1) != 1):
        raise ValueError(f"small_linear: weight must be contiguous and x have unit column stride "
                         f"(weight strides {weight.stride()}, x strides {x.stride()})")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"small_linear: bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
    if x.shape[0] > 0 and x.stride(1) != 1:  # a single row may carry any stride
        x = x.contiguous()
    return _run(x, weight, bias, torch.get_num_threads() if num_threads is None else num_threads)


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_threads: int) -> torch.Tensor:
    """The kernel call on checked arguments: x [M, K] unit column stride, weight [N, K] contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    ldx = x.stride(0) if m > 1 else k
    if ldx < k:  # rows overlap (an expanded tensor): the kernel reads rows ldx apart, so pack them
        x, ldx = x.contiguous(), k
    y = torch.empty(m, n, dtype=_F32)                                  # [M, N]
    rc = _lib.sl_linear_addr(y.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                             m, n, k, ldx, n, num_threads)
    if rc:  # SL_OK is 0
        raise ValueError(f"small_linear: kernel refused x {tuple(x.shape)} strides {x.stride()}, "
                         f"weight {tuple(weight.shape)} (code {rc})")
    return y


def linear(
    x: torch.Tensor,                 # [M, K]
    weight: torch.Tensor,            # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:                   # [M, N]
    """F.linear semantics; the C kernel takes the few-row float32 CPU case (see module docstring)."""
    # ~120 calls per decode step: plain attribute tests, cheapest and most selective first.
    if (
        x.dtype is _F32
        and weight.dtype is _F32
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and _lib is not None
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and x.stride(1) == 1
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is _F32 and bias.is_cpu and bias.shape == weight.shape[:1]
                              and bias.is_contiguous()))
        and not (x.requires_grad or weight.requires_grad)
    ):
        return _run(x, weight, bias, torch.get_num_threads())
    return F.linear(x, weight, bias)


def _c_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype is _F32 and weight.dtype is _F32 and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and _lib is not None and x.is_cpu and weight.is_cpu and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and x.stride(1) == 1 and weight.is_contiguous())


def linear_blocked(
    x: torch.Tensor,                 # [M, K]
    weight: torch.Tensor,            # [N, K]
    bias: torch.Tensor | None,       # [N]
    block: int,                      # fold block width along K (block >= K: plain linear)
) -> torch.Tensor:                   # [M, N]
    """x weight^T summed over K in blocks of `block`, folded left to right, then + bias."""
    K = x.shape[1]
    if block >= K:
        return linear(x, weight, bias)
    if _c_takes(x, weight) and (bias is None or (bias.dtype is _F32 and bias.is_contiguous())):
        m, n = x.shape[0], weight.shape[0]
        ldx = x.stride(0) if m > 1 else K
        if ldx < K:
            x, ldx = x.contiguous(), K
        y = torch.empty(m, n, dtype=_F32)                                  # [M, N]
        rc = _lib.sl_linear_blocked_addr(y.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                         0 if bias is None else bias.data_ptr(), m, n, K, ldx, n, block, 0,
                                         torch.get_num_threads())
        if rc:
            raise ValueError(f"linear_blocked: kernel refused x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                             f"block {block} (code {rc})")
        return y
    parts = _torch_block_parts(x, weight, block)                           # [nb, M, N]
    y = parts[0]                                                           # [M, N] (a view; parts is ours)
    for p in parts[1:]:                                                    # the left fold, block by block
        y += p
    if bias is not None:
        y += bias
    return y


def _torch_block_parts(
    x: torch.Tensor,                 # [M, K]
    weight: torch.Tensor,            # [N, K]
    block: int,                      # block width along K
) -> torch.Tensor:                   # [nb, M, N]: block j's x[:, blk j] weight[:, blk j]^T
    """Every block's product in one torch.bmm over strided views of x and the weight (no copy)
    where K is whole blocks of a row-major x and a contiguous weight; else one F.linear per block.
    bmm gives each block the product F.linear gives it, bit for bit (the same GEMM per batch
    entry; tests/unit/test_tp_split_and_fold.py), in one call instead of nb (one OpenMP region
    instead of nb: bench/results/tp/tp_invariant.md)."""
    M, K = x.shape
    N = weight.shape[0]
    nb = -(-K // block)
    if K % block == 0 and x.stride(1) == 1 and weight.is_contiguous():
        xs = x.as_strided((nb, M, block), (block, x.stride(0), 1))        # [nb, M, block]
        ws = weight.as_strided((nb, block, N), (block, 1, K))             # [nb, block, N] = blk j of W^T
        return torch.bmm(xs, ws)
    return torch.stack([F.linear(x[:, k0 : k0 + block], weight[:, k0 : k0 + block]) for k0 in range(0, K, block)])


def linear_block_parts(
    x: torch.Tensor,                 # [M, K]
    weight: torch.Tensor,            # [N, K]
    block: int,                      # block width along K
) -> torch.Tensor:                   # [nblocks, M, N]: block j's partial product x[:, blk j] weight[:, blk j]^T
    """The unfolded block partials of linear_blocked (no bias), for a rank that continues a fold."""
    M, K = x.shape
    N = weight.shape[0]
    nb = -(-K // block)
    if _c_takes(x, weight):
        ldx = x.stride(0) if M > 1 else K
        if ldx < K:
            x, ldx = x.contiguous(), K
        parts = torch.empty(nb, M, N, dtype=_F32)                         # [nb, M, N]
        rc = _lib.sl_linear_blocked_addr(parts.data_ptr(), x.data_ptr(), weight.data_ptr(), 0, M, N, K, ldx, N,
                                         block, M * N, torch.get_num_threads())
        if rc:
            raise ValueError(f"linear_block_parts: kernel refused x {tuple(x.shape)}, weight "
                             f"{tuple(weight.shape)}, block {block} (code {rc})")
        return parts
    return _torch_block_parts(x, weight, block)
