"""Fused per-token ops of a decoder layer on CPU (csrc/norm_act.c), each with a torch fallback.

- `add_rms_norm(h, delta, weight, eps)`: h += delta in place (the residual stream), then returns
  RMSNorm(h) * weight. One pass over the row instead of torch's add + pow + mean + rsqrt + two
  muls (each an op dispatch that costs more than the arithmetic at decode sizes).
- `silu_mul(gate_up)`: silu(gate) * up from the gate|up projection's output, [T, 2I] -> [T, I].
- `argmax_rows(x)`: each row's argmax (first index on ties, first NaN wins, as torch.argmax).

The C path runs for float32 CPU tensors whose rows are contiguous; anything else takes the torch
path, which defines the semantics. Numerics: the C sums run in a fixed order different from
torch's, and SiLU uses a Cephes exp (1-2 ulp), so results differ from torch by float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.ops.native import ffi as _ffi, lib as _lib

_F32 = torch.float32


def _ptr(t: torch.Tensor, kind: str = "float *"):  # a cffi pointer
    return _ffi.cast(kind, t.data_ptr())


def _check(rc: int, op: str, **tensors: torch.Tensor) -> None:
    if rc != _lib.OP_OK:
        shapes = ", ".join(f"{k}={tuple(t.shape)}/{t.stride()}" for k, t in tensors.items())
        raise ValueError(f"{op}: kernel refused its arguments (code {rc}): {shapes}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Hugging Face reference computes it (float32 math, weight applied last)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rows_ok(t: torch.Tensor) -> bool:
    """A float32 CPU matrix with unit column stride that the C ops may read and write."""
    return t.dtype is _F32 and t.is_cpu and t.dim() == 2 and t.stride(1) == 1 and not t.requires_grad


def add_rms_norm(
    h: torch.Tensor,                  # [T, H] residual stream, updated in place when delta is given
    delta: torch.Tensor | None,       # [T, H] added to h first, or None
    weight: torch.Tensor,             # [H]
    eps: float,
) -> torch.Tensor:                    # [T, H] RMSNorm(h + delta) * weight
    # Called twice per decoder layer: the checks are plain attribute tests (no generic helpers),
    # and the kernel takes integer addresses.
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} does not match h {tuple(h.shape)}")
    if weight.shape != h.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} does not match rows of {h.shape[-1]}")
    if (_lib is not None and _rows_ok(h) and (delta is None or _rows_ok(delta))
            and weight.dtype is _F32 and weight.is_cpu and weight.is_contiguous()):
        rows, size = h.shape
        out = torch.empty(rows, size, dtype=_F32)                     # [T, H]
        rc = _lib.op_add_rms_norm_addr(out.data_ptr(), h.data_ptr(), 0 if delta is None else delta.data_ptr(),
                                       weight.data_ptr(), rows, size, size, h.stride(0),
                                       0 if delta is None else delta.stride(0), eps)
        if rc:
            _check(rc, "add_rms_norm", h=h, weight=weight)
        return out
    if delta is not None:
        h.add_(delta)
    if h.dtype == torch.float32:
        return F.rms_norm(h, weight.shape, weight, eps)
    return rms_norm_reference(h, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate_up[:, :I]) * gate_up[:, I:]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: last dim {gate_up.shape[-1]} is not gate|up of equal halves")
    if _lib is not None and _rows_ok(gate_up):
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=_F32)              # [T, I]
        rc = _lib.op_silu_mul_addr(out.data_ptr(), gate_up.data_ptr(), rows, width // 2, width // 2,
                                   gate_up.stride(0), torch.get_num_threads())
        if rc:
            _check(rc, "silu_mul", gate_up=gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """torch.argmax(x, dim=-1)."""
    if _lib is not None and _rows_ok(x) and x.shape[1] > 0:
        rows, width = x.shape
        out = torch.empty(rows, dtype=torch.int64)                    # [R]
        rc = _lib.op_argmax_rows(_ptr(out, "int64_t *"), _ptr(x), rows, width, x.stride(0))
        _check(rc, "argmax_rows", x=x)
        return out
    return x.argmax(dim=-1)
