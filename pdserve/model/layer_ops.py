"""The per-layer ops of one forward pass of a Llama-family model, behind one interface.

LlamaForCausalLM runs its decoder layers in one loop (`LlamaForCausalLM._run_layers`) over an
ops object chosen per pass:

- `ModuleLayerOps`: the layers' own modules (pdserve.kernels.ops' `linear`, `add_rms_norm`,
  `rope_qk`, `silu_mul`, each checking its tensors, allocating its output and picking C or
  torch), for every pass and every model;
- `CLayerOps.begin_pass(...)`: the same C ops called by address for a pass of at most
  `small_batch_max_tokens` float32 tokens (EngineConfig; 0: never). A batch-32 decode step runs
  ~12 small ops per layer, and through the generic wrappers their checks and allocations cost
  more than the arithmetic (the paired A/B of commit 4e1421f); `CLayerOps` checks the weights
  once when it binds them, and a pass allocates one set of scratch buffers, then makes 8 foreign
  calls per layer besides attention.

Both run the same kernels in the same order with the same arguments: for a pass of at most
`pdserve.kernels.ops.linear.MAX_ROWS` tokens the module path's `linear` takes the same C kernel,
so tokens and logprobs are bit-identical on the two (tested); o_proj and down_proj take the
blocked kernel with the layers' fold blocks on both (pdserve/model/tp.py). `CLayerOps.bind` returns None, and
every pass takes the module ops, for weights that are not float32 on the CPU, q/k norms and
a shard whose row-parallel layers are not yet connected to its tensor-parallel group. Under tensor
parallelism both paths continue the ranks' fold of o_proj and down_proj in the same way (rank 0's
folded prefix, the later ranks' block partials; pdserve/model/tp.py).

An ops object holds the pass's residual stream h and the current norm output x; the loop asks
it, per layer i: `qkv(i)` (q, k, v of x: projection and rotary), `attn_out(i, a)` (the output
projection of attention's result) and `mlp(i)` (h += attention; x = post-attention norm of h;
h += MLP of x; x = the next layer's input norm of h, after the last layer only h += MLP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kernels.ops.linear import MAX_ROWS
from pdserve.kernels.ops.native import lib as _lib

_F32 = torch.float32


class LayerOps(Protocol):
    """One pass's per-layer ops (see the module docstring); h is updated in place."""

    def qkv(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] (rotated, contiguous), v [T, Hkv, D] of layer i from x."""

    def attn_out(self, i: int, a: torch.Tensor) -> None:
        """Layer i's output projection of the attention result a [T, Hq, D]."""

    def mlp(self, i: int) -> None:
        """h += the projection; x = norm(h); h += MLP(x); x = layer i + 1's input norm of h."""


class ModuleLayerOps:
    """LayerOps through the layers' modules (any dtype, device, q/k norm, TP split)."""

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        h: torch.Tensor,                             # [T, hidden] residual stream, updated in place
        x: torch.Tensor,                             # [T, hidden] layer 0's input norm of h
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, D] each
    ) -> None:
        self.layers, self.h, self.x, self.cos_sin = layers, h, x, cos_sin
        self.o: torch.Tensor | None = None           # [T, hidden] the current layer's attention projection

    def qkv(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.layers[i].self_attn.qkv_rope(self.x, self.cos_sin)

    def attn_out(self, i: int, a: torch.Tensor) -> None:
        self.o = self.layers[i].self_attn.o_proj.forward(a.reshape(a.shape[0], -1))  # [T, Hq D] -> [T, hidden]

    def mlp(self, i: int) -> None:
        # Submodules are called through .forward: nn.Module.__call__'s hook machinery costs a few
        # microseconds per call, ~300 calls per pass, and no hooks are ever registered here.
        # add_forward updates h in place (h += delta, then the norm): one pass per layer boundary.
        layer, layers = self.layers[i], self.layers
        x = layer.post_attention_layernorm.add_forward(self.h, self.o)         # h += o; norm(h)
        m = layer.mlp.forward(x)                                               # [T, hidden]
        if i + 1 < len(layers):
            self.x = layers[i + 1].input_layernorm.add_forward(self.h, m)      # h += m; norm(h)
        else:
            self.h += m


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
    o_kb: int                          # o_proj's fold block (pdserve/model/tp.py)
    down_kb: int                       # down_proj's fold block
    o_bias: torch.Tensor | None        # the row-parallel biases, added by the fold's last rank under TP
    down_bias: torch.Tensor | None


def _weight(t: torch.Tensor, shape: tuple[int, ...], what: str) -> int:
    """Address of a float32 CPU contiguous tensor of `shape`; raises naming it otherwise."""
    if t.dtype != _F32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"C layer ops: {what} is {tuple(t.shape)}/{t.dtype}/{t.device}"
                         f"{'' if t.is_contiguous() else '/strided'}, expected contiguous float32 cpu {shape}")
    return t.data_ptr()


class CLayerOps:
    """A Llama-family model's layers bound to the C ops (see the module docstring); `begin_pass`
    gives the LayerOps of one pass."""

    def __init__(self, layers: Sequence[torch.nn.Module], eps: float, max_tokens: int) -> None:
        first = layers[0].self_attn
        self.hq, self.hkv, self.d = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden = layers[0].input_layernorm.weight.shape[0]
        self.inter = layers[0].mlp.down_proj.weight.shape[1]
        self.eps = eps
        self.max_tokens = max_tokens
        H, I, qkv_n = self.hidden, self.inter, (self.hq + 2 * self.hkv) * self.d  # noqa: E741 - I as in the shape comments
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
            bound.append(_Layer(tensors=tensors, o_kb=attn.o_proj.fold_block, down_kb=mlp.down_proj.fold_block,
                                o_bias=attn.o_proj.bias, down_bias=mlp.down_proj.bias, **addrs))
        self.layers = tuple(bound)
        # the TP group's comm (pdserve/model/tp.py TPComm) when the layers are a rank's shard, else None
        self.comm = layers[0].self_attn.o_proj.comm if layers[0].self_attn.o_proj.tp_split else None
        self._addrs = tuple(t.data_ptr() for layer in self.layers for t in layer.tensors)

    @staticmethod
    def bind(layers: Sequence[torch.nn.Module], eps: float, max_tokens: int) -> CLayerOps | None:
        """Bound layers, or None where the C ops do not apply (max_tokens 0, C ops not built, q/k
        norm, a TP shard not yet connected to its group, weights that are not float32 on the CPU).
        Raises ValueError when max_tokens is outside [0, MAX_ROWS] (the module path's linear would not take the C
        kernel for such passes, and the two paths would differ)."""
        if not 0 <= max_tokens <= MAX_ROWS:
            raise ValueError(f"C layer ops: max_tokens must be in [0, {MAX_ROWS}] (the small linear kernel's "
                             f"row limit), got {max_tokens}")
        if _lib is None or max_tokens == 0 or not layers:
            return None
        for layer in layers:
            attn = layer.self_attn
            if attn.q_norm is not None:
                return None
            rows = (attn.o_proj, layer.mlp.down_proj)
            if any(r.tp_split and r.comm is None for r in rows):   # a shard not connected to its group yet
                return None
            for p in layer.parameters():
                if p.dtype != _F32 or p.device.type != "cpu":
                    return None
        return CLayerOps(layers, eps, max_tokens)

    def still_bound(self) -> bool:
        """True while every bound weight still has the storage it had when bound (a reload that
        replaced a parameter's storage, e.g. .to(), makes this False and the caller rebinds)."""
        return self._addrs == tuple(t.data_ptr() for layer in self.layers for t in layer.tensors)

    def accepts(self, h: torch.Tensor) -> bool:
        """h: the pass's residual stream [T, hidden]; the C ops run T <= max_tokens float32 rows."""
        return (h.dtype is _F32 and h.is_cpu and h.dim() == 2 and h.shape[0] <= self.max_tokens
                and h.shape[1] == self.hidden and h.is_contiguous())

    def begin_pass(
        self,
        h: torch.Tensor,                             # [T, hidden] residual stream, updated in place
        x: torch.Tensor,                             # [T, hidden] layer 0's input norm of h
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, D] each, float32 contiguous
    ) -> _CPass:
        """The LayerOps of one pass over h (accepts(h) must hold); checks x and the rotary tables."""
        T, D = h.shape[0], self.d
        cos, sin = cos_sin
        if not (x.dtype is _F32 and x.is_contiguous() and x.shape == h.shape):
            raise ValueError(f"C layer ops: x {tuple(x.shape)}/{x.dtype} does not match h {tuple(h.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous() or t.shape != (T, D):
                raise ValueError(f"C layer ops: {name} table {tuple(t.shape)}/{t.dtype} is not "
                                 f"contiguous float32 [{T}, {D}]")
        return _c_pass(self, h, x, cos, sin)


@dataclass(frozen=True)
class _CPass:
    """LayerOps of one pass on the C ops (built by _c_pass): closures over the pass's addresses,
    so that a layer costs three calls and no attribute lookups besides its weights."""

    qkv: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attn_out: Callable[[int, torch.Tensor], None]
    mlp: Callable[[int], None]
    buffers: tuple[torch.Tensor, ...]  # the scratch tensors whose addresses the closures hold


def _c_pass(bound: CLayerOps, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> _CPass:
    """The C ops of one pass over h, in scratch buffers allocated once for the pass. The attention
    backend reads q, k, v during its call and keeps none of them."""
    T, H, I = h.shape[0], bound.hidden, bound.inter  # noqa: E741 - I: the intermediate size, as in the shape comments
    Hq, Hkv, D = bound.hq, bound.hkv, bound.d
    qkv_n, attn_n = (Hq + 2 * Hkv) * D, Hq * D
    layers, n_layers, eps = bound.layers, len(bound.layers), bound.eps
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
    nt = torch.get_num_threads()
    linear, norm, rope = _lib.sl_linear_addr, _lib.op_add_rms_norm_addr, _lib.op_rope_qk_addr
    blocked = _lib.sl_linear_blocked_addr  # the row-parallel layers' TP-invariant fold
    comm = bound.comm
    if comm is not None:  # a rank's block partials of o_proj / down_proj, continuing the ranks' fold
        first = layers[0]
        o_parts = torch.empty(-(-attn_n // first.o_kb), T, H, dtype=_F32)  # [nb_o, T, H]
        d_parts = torch.empty(-(-I // first.down_kb), T, H, dtype=_F32)    # [nb_down, T, H]
    silu = _lib.op_silu_mul_addr
    q_shape = q.shape

    def qkv_rope(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = layers[i]
        _ok(linear(qkvp, xp, w.qkv_w, w.qkv_b, T, qkv_n, H, H, qkv_n, nt), "qkv_proj", i)
        _ok(rope(qp, kp, qkvp, cosp, sinp, T, Hq, Hkv, D, qkv_n), "rope", i)
        return q, k, v

    def attn_out(i: int, a: torch.Tensor) -> None:             # a: [T, Hq, D]
        if not (a.dtype is _F32 and a.is_contiguous() and a.shape == q_shape):
            raise ValueError(f"C layer ops: attention output {tuple(a.shape)}/{a.dtype} is not "
                             f"contiguous float32 {tuple(q_shape)}")
        w = layers[i]
        if comm is None:
            _ok(blocked(op, a.data_ptr(), w.o_w, w.o_b, T, H, attn_n, attn_n, H, w.o_kb, 0, nt), "o_proj", i)
        elif comm.rank == 0:
            _ok(blocked(op, a.data_ptr(), w.o_w, 0, T, H, attn_n, attn_n, H, w.o_kb, 0, nt), "o_proj", i)
            _tp_fold(comm, o, None, w.o_bias)
        else:
            _ok(blocked(o_parts.data_ptr(), a.data_ptr(), w.o_w, 0, T, H, attn_n, attn_n, H, w.o_kb, T * H, nt),
                "o_proj", i)
            _tp_fold(comm, o, o_parts, w.o_bias)

    def mlp(i: int) -> None:
        w = layers[i]
        _ok(norm(xp, hp, op, w.ln2, T, H, H, H, H, eps), "post_attention_layernorm", i)  # h += o; x = norm(h)
        _ok(linear(gup, xp, w.gu_w, w.gu_b, T, 2 * I, H, H, 2 * I, nt), "gate_up_proj", i)
        _ok(silu(actp, gup, T, I, I, 2 * I, nt), "silu_mul", i)
        if comm is None:
            _ok(blocked(mp, actp, w.down_w, w.down_b, T, H, I, I, H, w.down_kb, 0, nt), "down_proj", i)
        elif comm.rank == 0:
            _ok(blocked(mp, actp, w.down_w, 0, T, H, I, I, H, w.down_kb, 0, nt), "down_proj", i)
            _tp_fold(comm, m, None, w.down_bias)
        else:
            _ok(blocked(d_parts.data_ptr(), actp, w.down_w, 0, T, H, I, I, H, w.down_kb, T * H, nt), "down_proj", i)
            _tp_fold(comm, m, d_parts, w.down_bias)
        if i + 1 < n_layers:  # h += m; x = the next layer's input_layernorm(h)
            _ok(norm(xp, hp, mp, layers[i + 1].ln1, T, H, H, H, H, eps), "input_layernorm", i + 1)
        else:
            h.add_(m)

    return _CPass(qkv=qkv_rope, attn_out=attn_out, mlp=mlp, buffers=(h, x, qkv, q, k, o, gu, act, m))


def _tp_fold(comm: object, y: torch.Tensor, parts: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """The ranks' fold of a row-parallel output, as RowLinear.forward does it: rank 0 (parts None)
    has folded its prefix into y and sends it on; rank r adds its block partials [nb, T, H] to what
    arrives from rank r - 1 and sends it on, the last rank adds the bias; the last rank's y is
    broadcast to every rank (y: [T, H], updated in place)."""
    r, n = comm.rank, comm.size
    if parts is None:
        comm.send(y, 1)
    else:
        comm.recv(y, r - 1)
        for p in parts:
            y += p
        if r + 1 < n:
            comm.send(y, r + 1)
        elif bias is not None:
            y += bias
    comm.broadcast(y, n - 1)


def _ok(rc: int, op: str, layer: int) -> None:
    if rc:  # SL_OK and OP_OK are 0
        raise RuntimeError(f"C layer ops: the {op} kernel of layer {layer} refused its arguments (code {rc})")
