"""Rotary embedding and the KV-pool write on CPU (csrc/rope_kv.c), each with a torch fallback.

- `rope(x, cos, sin_signed)`: rotate-half rotary embedding of x [T, H, D] with the step's tables
  [T, D] (sin_signed = sin with its first half negated), into a new contiguous [T, H, D]. x may be
  a strided view of the qkv projection's output (one token's heads D apart). Bit-identical to
  the torch path (x * cos + roll(x, D/2) * sin_signed, no fused multiply-add).
- `rope_qk(qkv, cos, sin_signed, Hq, Hkv, D)`: `rope` of the q heads and of the k heads straight out
  of a fused qkv projection's rows, one kernel call for both.
- `write_kv_rows(k, v, k_pool, v_pool, rows)`: k[t, h] and v[t, h] into row rows[t * Hkv + h] of
  the pools seen as [N * Hkv * P, D]; a bfloat16 pool stores the rows rounded to nearest even
  (as .to(torch.bfloat16)). Rows are checked against the pool before anything is written.

The C path takes float32 CPU inputs with unit element stride and heads D apart; anything else
goes through torch (index_copy_), which defines the semantics. Replaces, per decoder layer, a
roll + 2 multiplies + an add for each of q and k and two index_copy_ calls (slow on a pool of
gigabytes), a sizeable share of a 32-sequence decode step on the 135M default model (commit 6c30dcb).
"""

from __future__ import annotations

import torch

from pdserve.kernels.ops.native import ffi as _ffi, lib as _lib

_POOL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


_F32 = torch.float32


def _heads_ok(x: torch.Tensor) -> bool:
    """float32 CPU [T, H, D], elements and heads packed (tokens may be strided)."""
    return (x.dtype is _F32 and x.is_cpu and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and not x.requires_grad)


def _table_ok(t: torch.Tensor, T: int, D: int) -> bool:
    return t.dtype is _F32 and t.is_cpu and t.shape == (T, D) and t.is_contiguous()


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin_signed: [T, D] -> [T, H, D] (torch: roll, multiply, add)."""
    c, s = cos.unsqueeze(1), sin_signed.unsqueeze(1)                           # [T, 1, D]
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(s)                         # rotate_half(x) * sin
    # Not addcmul: its fused multiply-add rounds differently from the reference's x*cos + r.
    return rotated.add_(x * c)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (any strides); cos, sin_signed: [T, D] -> a new contiguous [T, H, D]."""
    T, H, D = x.shape
    if cos.shape != (T, D) or sin_signed.shape != (T, D):
        raise ValueError(f"rope: tables {tuple(cos.shape)} / {tuple(sin_signed.shape)} do not match x "
                         f"{tuple(x.shape)} (need [T, D] = [{T}, {D}])")
    if _lib is None or D % 16 or not _heads_ok(x) or not _table_ok(cos, T, D) or not _table_ok(sin_signed, T, D):
        return rope_reference(x, cos, sin_signed)
    out = torch.empty(T, H, D, dtype=_F32)                                      # [T, H, D]
    rc = _lib.op_rope(_ffi.cast("float *", out.data_ptr()), _ffi.cast("float *", x.data_ptr()),
                      _ffi.cast("float *", cos.data_ptr()), _ffi.cast("float *", sin_signed.data_ptr()),
                      T, H, D, x.stride(0))
    if rc != _lib.OP_OK:
        raise ValueError(f"rope: kernel refused x {tuple(x.shape)} strides {x.stride()} (code {rc})")
    return out


def rope_qk(
    qkv: torch.Tensor,               # [T, >= (Hq + Hkv) * D]: q heads from column 0, then k heads
    cos: torch.Tensor,               # [T, D]
    sin_signed: torch.Tensor,        # [T, D]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k [T, Hkv, D], new and contiguous
    """`rope` of the q heads and of the k heads of a fused qkv projection's rows, in one kernel call."""
    if qkv.dim() != 2:
        raise ValueError(f"rope_qk: qkv must be [T, width], got {tuple(qkv.shape)}")
    T, width = qkv.shape
    Hq, Hkv, D = num_heads, num_kv_heads, head_dim
    if width < (Hq + Hkv) * D:
        raise ValueError(f"rope_qk: qkv {tuple(qkv.shape)} is narrower than q and k heads ({Hq} + {Hkv}) x {D}")
    if (_lib is not None and D % 16 == 0 and qkv.dtype is _F32 and qkv.is_cpu and qkv.stride(1) == 1
            and not qkv.requires_grad and _table_ok(cos, T, D) and _table_ok(sin_signed, T, D)):
        q = torch.empty(T, Hq, D, dtype=_F32)                                   # [T, Hq, D]
        k = torch.empty(T, Hkv, D, dtype=_F32)                                  # [T, Hkv, D]
        rc = _lib.op_rope_qk_addr(q.data_ptr(), k.data_ptr(), qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                                  T, Hq, Hkv, D, qkv.stride(0) if T > 1 else width)
        if rc != _lib.OP_OK:
            raise ValueError(f"rope_qk: kernel refused qkv {tuple(qkv.shape)} strides {qkv.stride()} (code {rc})")
        return q, k
    q = rope(qkv[:, : Hq * D].view(T, Hq, D), cos, sin_signed)
    return q, rope(qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D), cos, sin_signed)


def write_kv_rows(
    k: torch.Tensor,          # [T, Hkv, D]
    v: torch.Tensor,          # [T, Hkv, D]
    k_pool: torch.Tensor,     # [N, Hkv, P, D]
    v_pool: torch.Tensor,     # [N, Hkv, P, D]
    rows: torch.Tensor,       # [T * Hkv] int64: row of (token t, head h) in the pool seen as [N*Hkv*P, D]
) -> None:
    """Copy the step's K/V rows into their pool rows (converted to the pool's dtype)."""
    T, Hkv, D = k.shape
    if v.shape != k.shape or rows.shape != (T * Hkv,):
        raise ValueError(f"write_kv_rows: k {tuple(k.shape)}, v {tuple(v.shape)}, rows {tuple(rows.shape)} "
                         f"disagree (need v like k and rows [T * Hkv] = [{T * Hkv}])")
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype or k_pool.shape[-1] != D:
        raise ValueError(f"write_kv_rows: pools {tuple(k_pool.shape)}/{k_pool.dtype} and "
                         f"{tuple(v_pool.shape)}/{v_pool.dtype} do not hold rows of head dim {D}")
    pool_rows = k_pool.numel() // D
    if (_lib is not None and _heads_ok(k) and _heads_ok(v) and k_pool.dtype in _POOL_DTYPES and k_pool.is_cpu
            and v_pool.is_cpu and k_pool.is_contiguous() and v_pool.is_contiguous()
            and rows.dtype is torch.int64 and rows.is_contiguous()):
        bad = _ffi.new("int64_t[2]")
        rc = _lib.op_write_kv_addr(k_pool.data_ptr(), v_pool.data_ptr(), k.data_ptr(), v.data_ptr(), rows.data_ptr(),
                                   T, Hkv, D, k.stride(0), v.stride(0), pool_rows, _POOL_DTYPES[k_pool.dtype], bad)
        if rc == _lib.OP_ERR_ROW:
            raise ValueError(f"write_kv_rows: entry {bad[0]} of rows is {bad[1]}, outside the pool's "
                             f"[0, {pool_rows}) rows ({tuple(k_pool.shape)})")
        if rc != _lib.OP_OK:
            raise ValueError(f"write_kv_rows: kernel refused k {tuple(k.shape)} strides {k.stride()}, "
                             f"v strides {v.stride()} (code {rc})")
        return
    k_pool.view(-1, D).index_copy_(0, rows, k.reshape(-1, D).to(k_pool.dtype))
    v_pool.view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(v_pool.dtype))
