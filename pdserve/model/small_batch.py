"""The decoder layers of a Llama-family model for a few-token pass on CPU, straight on the C ops.

A batch-32 decode step runs ~12 small ops per layer; through the generic wrappers (pdserve.kernels.ops:
`linear`, `add_rms_norm`, `rope_qk`, `silu_mul`) each op re-checks its tensors and allocates its
output, and after every kernel the interpreter's own data has been pushed out of the caches by the
kernel's streams: ~13 ms of Python per 30-layer step measured inside the step (vs ~4 ms for the
same code in a hot loop). `SmallBatchLayers` checks the weights when it binds them, allocates one
set of scratch buffers per pass, and then calls the C ops by address: per layer 8 foreign calls
and the attention backend.

Same ops, same order, same arguments as the module path (LlamaForCausalLM's layer loop), so the
results are bit-identical (tested). It applies (`bind` returns None otherwise) to float32 CPU
weights with no q/k norm and no tensor-parallel split, and (`run`) to passes of at most
`pdserve.kernels.ops.linear.max_rows()` tokens; everything else takes the module path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.kernels.attention.base import AttentionBackend
from pdserve.kernels.ops.linear import max_rows
from pdserve.kernels.ops.native import lib as _lib

_F32 = torch.float32


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights as addresses (0 = no bias), and the tensors that own them."""

    tensors: tuple[torch.Tensor, ...]  # every bound tensor, kept to re-check its address per pass
    ln1: int                           # input_layernorm.weight [H]
    ln2: int                           # post_attention_layernorm.weight [H]
    qkv_w: int                         # [(Hq + 2 Hkv) D, H]
    qkv_b: int
    o_w: int                           # [H, Hq D]
    o_b: int
    gu_w: int                          # [2 I, H]
    gu_b: int
    down_w: int                        # [H, I]
    down_b: int


def _weight(t: torch.Tensor, shape: tuple[int, ...], what: str) -> int:
    """Address of a float32 CPU contiguous tensor of `shape`; raises naming it otherwise."""
    if t.dtype != _F32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"small-batch layers: {what} is {tuple(t.shape)}/{t.dtype}/{t.device}"
                         f"{'' if t.is_contiguous() else '/strided'}, expected contiguous float32 cpu {shape}")
    return t.data_ptr()


class SmallBatchLayers:
    """The layer loop of a bound Llama-family model on the C ops (see the module docstring)."""

    def __init__(self, layers: Sequence[torch.nn.Module], eps: float) -> None:
        first = layers[0].self_attn
        self.hq, self.hkv, self.d = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden = layers[0].input_layernorm.weight.shape[0]
        self.inter = layers[0].mlp.down_proj.weight.shape[1]
        self.eps = eps
        self.scale = first.scale
        H, I, qkv_n = self.hidden, self.inter, (self.hq + 2 * self.hkv) * self.d
        bound = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            parts = {
                "ln1": (layer.input_layernorm.weight, (H,)),
                "ln2": (layer.post_attention_layernorm.weight, (H,)),
                "qkv_w": (attn.qkv_proj.weight, (qkv_n, H)), "qkv_b": (attn.qkv_proj.bias, (qkv_n,)),
                "o_w": (attn.o_proj.weight, (H, self.hq * self.d)), "o_b": (attn.o_proj.bias, (H,)),
                "gu_w": (mlp.gate_up_proj.weight, (2 * I, H)), "gu_b": (mlp.gate_up_proj.bias, (2 * I,)),
                "down_w": (mlp.down_proj.weight, (H, I)), "down_b": (mlp.down_proj.bias, (H,)),
            }
            addrs = {name: 0 if t is None else _weight(t, shape, f"layer {i} {name}")
                     for name, (t, shape) in parts.items()}
            tensors = tuple(t for t, _ in parts.values() if t is not None)
            bound.append(_Layer(tensors=tensors, **addrs))
        self.layers = tuple(bound)
        self._addrs = tuple(t.data_ptr() for layer in self.layers for t in layer.tensors)

    @staticmethod
    def bind(layers: Sequence[torch.nn.Module], eps: float) -> SmallBatchLayers | None:
        """Bound layers, or None where this path does not apply (no C ops, q/k norm, TP split,
        weights that are not float32 on the CPU)."""
        if _lib is None or max_rows() == 0 or not layers:
            return None
        for layer in layers:
            attn = layer.self_attn
            if attn.q_norm is not None or attn.qkv_proj.tp_size != 1 or attn.o_proj.tp_size != 1:
                return None
            if layer.mlp.gate_up_proj.tp_size != 1 or layer.mlp.down_proj.tp_size != 1:
                return None
            for p in layer.parameters():
                if p.dtype != _F32 or p.device.type != "cpu":
                    return None
        return SmallBatchLayers(layers, eps)

    def still_bound(self) -> bool:
        """True while every bound weight still has the storage it had when bound (a reload that
        replaced a parameter's storage, e.g. .to(), makes this False and the caller rebinds)."""
        return self._addrs == tuple(t.data_ptr() for layer in self.layers for t in layer.tensors)

    def accepts(self, h: torch.Tensor) -> bool:
        """h: the pass's residual stream [T, hidden]; this path runs T <= max_rows() float32 rows."""
        return (h.dtype is _F32 and h.is_cpu and h.dim() == 2 and h.shape[0] <= max_rows()
                and h.shape[1] == self.hidden and h.is_contiguous())

    def run(
        self,
        h: torch.Tensor,                     # [T, hidden] residual stream, updated in place
        x: torch.Tensor,                     # [T, hidden] layer 0's input norm of h
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, D] each, float32 contiguous
        k_pools: list[torch.Tensor],         # per layer [N, Hkv, P, D]
        v_pools: list[torch.Tensor],
        backend: AttentionBackend,
        plan: object,
        layer_hook: Callable[[int], None] | None,
    ) -> torch.Tensor:                       # the last layer's MLP output [T, hidden] (not yet added to h)
        T, H, I = h.shape[0], self.hidden, self.inter
        Hq, Hkv, D = self.hq, self.hkv, self.d
        qkv_n, attn_n = (Hq + 2 * Hkv) * D, Hq * D
        cos, sin = cos_sin
        if not (x.dtype is _F32 and x.is_contiguous() and x.shape == h.shape):
            raise ValueError(f"small-batch layers: x {tuple(x.shape)}/{x.dtype} does not match h {tuple(h.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous() or t.shape != (T, D):
                raise ValueError(f"small-batch layers: {name} table {tuple(t.shape)}/{t.dtype} is not "
                                 f"contiguous float32 [{T}, {D}]")
        # Scratch for the whole pass; the backend reads q, k, v during its call and keeps none.
        qkv = torch.empty(T, qkv_n, dtype=_F32)                               # [T, (Hq + 2 Hkv) D]
        q = torch.empty(T, Hq, D, dtype=_F32)                                 # [T, Hq, D]
        k = torch.empty(T, Hkv, D, dtype=_F32)                                # [T, Hkv, D]
        v = qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D)                          # [T, Hkv, D] view
        o = torch.empty(T, H, dtype=_F32)                                     # [T, H] attention projection
        gu = torch.empty(T, 2 * I, dtype=_F32)                                # [T, 2 I]
        act = torch.empty(T, I, dtype=_F32)                                   # [T, I]
        m = torch.empty(T, H, dtype=_F32)                                     # [T, H] MLP output
        hp, xp, qkvp, qp, kp = h.data_ptr(), x.data_ptr(), qkv.data_ptr(), q.data_ptr(), k.data_ptr()
        op, gup, actp, mp = o.data_ptr(), gu.data_ptr(), act.data_ptr(), m.data_ptr()
        cosp, sinp = cos.data_ptr(), sin.data_ptr()
        nt, eps, scale = torch.get_num_threads(), self.eps, self.scale
        linear, norm, rope = _lib.sl_linear_addr, _lib.op_add_rms_norm_addr, _lib.op_rope_qk_addr
        silu = _lib.op_silu_mul_addr
        for i, w in enumerate(self.layers):
            if i:  # h += previous MLP output; x = input_layernorm(h)
                _ok(norm(xp, hp, mp, w.ln1, T, H, H, H, H, eps), "input_layernorm", i)
            _ok(linear(qkvp, xp, w.qkv_w, w.qkv_b, T, qkv_n, H, H, qkv_n, nt), "qkv_proj", i)
            _ok(rope(qp, kp, qkvp, cosp, sinp, T, Hq, Hkv, D, qkv_n), "rope", i)
            a = backend.forward(q, k, v, k_pools[i], v_pools[i], plan, scale)  # [T, Hq, D]
            if layer_hook is not None:
                layer_hook(i)
            if not (a.dtype is _F32 and a.is_contiguous() and a.shape == q.shape):
                raise ValueError(f"small-batch layers: attention output {tuple(a.shape)}/{a.dtype} is not "
                                 f"contiguous float32 {tuple(q.shape)}")
            _ok(linear(op, a.data_ptr(), w.o_w, w.o_b, T, H, attn_n, attn_n, H, nt), "o_proj", i)
            _ok(norm(xp, hp, op, w.ln2, T, H, H, H, H, eps), "post_attention_layernorm", i)
            _ok(linear(gup, xp, w.gu_w, w.gu_b, T, 2 * I, H, H, 2 * I, nt), "gate_up_proj", i)
            _ok(silu(actp, gup, T, I, I, 2 * I, nt), "silu_mul", i)
            _ok(linear(mp, actp, w.down_w, w.down_b, T, H, I, I, H, nt), "down_proj", i)
        return m


def _ok(rc: int, op: str, layer: int) -> None:
    if rc:  # SL_OK and OP_OK are 0
        raise RuntimeError(f"small-batch layers: the {op} kernel of layer {layer} refused its arguments (code {rc})")
