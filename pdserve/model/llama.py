"""Our Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3) over the paged KV cache.

The forward pass takes the flat token axis of a whole batch ([T] ids and positions): token-wise
work (norms, projections, MLP) runs over all tokens of all sequences at once, attention runs per
sequence through the attention backend (E2). After each layer's attention output projection the
layer hook is called (D7: the KV messenger learns that layer L's KV is in the pool); under
tensor parallelism that is after the o_proj fold has reached every rank, so every rank has written
layer L's KV (the hook runs on the leader only).

Tensor parallelism (pdserve/model/tp.py): a rank's model holds its shard (`shard`); its row-parallel
layers continue the ranks' fold through `set_tp_comm`. With `tp_invariant` float32 models sum o_proj
and down_proj in fixed fold blocks at every TP size, TP 1 included, so TP 1 and TP N give the same
bits; without it (the model's default, and the engine's at TP 1 unless --tp-invariant) a layer sums
its whole share in one block, the plain kernels of a single-shard model.

The decoder layers run in one loop (`_run_layers`) over the ops object of the pass
(pdserve/model/layer_ops.py): the modules' own ops, or for passes of at most
`small_batch_max_tokens` float32 tokens the same C ops bound to the weights (bit-identical).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pdserve.kernels.attention.base import AttentionBackend
from pdserve.kernels.ops.linear import MAX_ROWS, linear
from pdserve.kernels.ops.norm_act import silu_mul
from pdserve.kernels.ops.rope_kv import rope_qk
from pdserve.model.arch import ModelArch, rope_inv_freq
from pdserve.model.layer_ops import CLayerOps, LayerOps, ModuleLayerOps
from pdserve.model.layers import (
    MergedColumnLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    ShardedAttention,
    embedding_and_head,
    load_embedding_and_head,
)
from pdserve.model.tp import RankShard, TPComm, row_fold_block, single_rank
from pdserve.model.weights import CheckpointReader

LayerHook = Callable[[int], None]


class Attention(ShardedAttention):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, shard: RankShard, invariant: bool = True) -> None:
        super().__init__(arch, dtype, shard, invariant, o_bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.scale = self.head_dim**-0.5

    def qkv_rope(
        self,
        x: torch.Tensor,             # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # rotary tables for the step, [T, D] each
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k [T, Hkv, D] rotated; v [T, Hkv, D]
        """The attention inputs of x; attention itself and o_proj are run by the layer loop."""
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)                                         # [T, (Hq + 2 Hkv) D]
        v = qkv[:, (Hq + Hkv) * D :].view(T, Hkv, D)                           # [T, Hkv, D]
        if self.q_norm is None:
            # rotated straight out of the qkv rows into contiguous q [T, Hq, D] and k [T, Hkv, D]
            q, k = rope_qk(qkv, *cos_sin, Hq, Hkv, D)
        else:
            q = self.q_norm.forward(qkv[:, : Hq * D].view(T, Hq, D))           # [T, Hq, D]
            k = self.k_norm.forward(qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D))  # [T, Hkv, D]
            q, k = RotaryEmbedding.apply(cos_sin, q, k)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, shard: RankShard, invariant: bool = True) -> None:
        super().__init__()
        inter = arch.intermediate_size
        rows = shard.mlp_rows
        self.gate_up_proj = MergedColumnLinear(arch.hidden_size, [inter, inter], arch.mlp_bias, dtype,
                                               part_rows=[rows, rows])
        self.down_proj = RowLinear(inter, arch.hidden_size, arch.mlp_bias, dtype, in_cols=rows,
                                   fold_block=row_fold_block(shard.mlp_block, dtype, invariant))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        return self.down_proj.forward(silu_mul(self.gate_up_proj.forward(x)))  # [T, 2 inter] -> [T, inter]


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, shard: RankShard, invariant: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype, shard, invariant)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype, shard, invariant)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, hf_config: object, dtype: torch.dtype, max_positions: int,
                 small_batch_max_tokens: int = MAX_ROWS, shard: RankShard | None = None,
                 tp_invariant: bool = False) -> None:
        """shard: what this tensor-parallel rank holds (pdserve/model/tp.py); None: TP 1.
        tp_invariant: sum o_proj / down_proj in the fixed fold blocks (float32: TP N == TP 1 bit for
        bit); False: each rank's share in one block (TP N within float32 rounding of TP 1; at TP 1 the
        plain kernels' sums). The engine resolves EngineConfig.tp_invariant (auto: on iff TP > 1)."""
        super().__init__()
        if not 0 <= small_batch_max_tokens <= MAX_ROWS:
            raise ValueError(f"small_batch_max_tokens must be in [0, {MAX_ROWS}], got {small_batch_max_tokens}")
        self.arch = arch
        self.shard = shard or single_rank(arch.num_heads, arch.num_kv_heads, arch.intermediate_size)
        self.small_batch_max_tokens = small_batch_max_tokens
        self.embed_tokens, self.lm_head_weight = embedding_and_head(   # lm_head_weight: [V, hidden]
            arch.vocab_size, arch.hidden_size, arch.tie_word_embeddings, dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, self.shard, tp_invariant)
                                    for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        inv_freq, scaling = rope_inv_freq(hf_config, arch.head_dim)
        self.rope = RotaryEmbedding(inv_freq, scaling, max_positions, dtype)
        # The layers bound to the C ops for few-token float32 passes: None = not bound yet,
        # False = they do not apply to this model (see _c_layer_ops).
        self._c_ops: CLayerOps | bool | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,        # [T]
        positions: torch.Tensor,        # [T]
        k_pools: list[torch.Tensor],    # per layer [N, Hkv, P, D]
        v_pools: list[torch.Tensor],
        backend: AttentionBackend,
        plan: object,
        logits_indices: torch.Tensor,   # [S] rows whose next-token logits are wanted
        layer_hook: LayerHook | None = None,
        num_layers: int | None = None,  # run only the first num_layers layers (a self-draft, E20)
        all_hidden: bool = False,       # return the final hidden state of every row, [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [S, V] float32, final hidden [S or T, hidden]
        h = self.forward_layers(input_ids, positions, k_pools, v_pools, backend, plan, layer_hook,
                                num_layers)                                             # [T, hidden]
        if all_hidden:   # a draft head writes its rows from every position's (E20)
            normed = self.norm.forward(h)                                              # [T, hidden]
            return linear(normed[logits_indices], self.lm_head_weight).float(), normed
        last = self.norm.forward(h[logits_indices])                                    # [S, hidden]
        logits = linear(last, self.lm_head_weight).float()                   # [S, V]
        return logits, last

    @torch.inference_mode()
    def forward_layers(
        self,
        input_ids: torch.Tensor,        # [T]
        positions: torch.Tensor,        # [T]
        k_pools: list[torch.Tensor],    # per layer [N, Hkv, P, D] (this rank's KV heads)
        v_pools: list[torch.Tensor],
        backend: AttentionBackend,
        plan: object,
        layer_hook: LayerHook | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor:                  # h [T, hidden]: the residual stream after the last layer
        """The embedding and the decoder layers (what a tensor-parallel worker rank runs: the
        leader alone applies the final norm and lm_head); `num_layers`: only the first ones."""
        h = self.embed_tokens(input_ids)                                       # [T, hidden]
        cos_sin = self.rope.tables(positions)
        x = self.layers[0].input_layernorm.forward(h)                           # [T, hidden]
        c_ops = self._c_layer_ops(h)
        # few tokens, float32 on CPU: the same ops, called by address; else the modules' ops
        ops = c_ops.begin_pass(h, x, cos_sin) if c_ops is not None else ModuleLayerOps(self.layers, h, x, cos_sin)
        self._run_layers(ops, k_pools, v_pools, backend, plan, layer_hook, num_layers)   # h updated in place
        return h

    def set_tp_comm(self, comm: TPComm) -> None:
        """Connect every row-parallel layer to this rank's group (pdserve/parallel)."""
        for layer in self.layers:
            layer.self_attn.o_proj.comm = comm
            layer.mlp.down_proj.comm = comm
        self._c_ops = None  # rebind: the C layer ops take the group's comm when they bind

    def _run_layers(
        self,
        ops: LayerOps,                  # the pass's ops over its residual stream (updated in place)
        k_pools: list[torch.Tensor],    # per layer [N, Hkv, P, D]
        v_pools: list[torch.Tensor],
        backend: AttentionBackend,
        plan: object,
        layer_hook: LayerHook | None,
        num_layers: int | None = None,
    ) -> None:
        """The decoder layers (the first `num_layers`, default all), the one loop of both ops
        objects (pdserve/model/layer_ops.py)."""
        scale = self.layers[0].self_attn.scale  # every layer has the same head_dim
        qkv, attn_out, mlp, attention = ops.qkv, ops.attn_out, ops.mlp, backend.forward  # looked up once
        for i in range(len(self.layers) if num_layers is None else num_layers):
            q, k, v = qkv(i)                                                   # [T, Hq|Hkv, D] of x
            a = attention(q, k, v, k_pools[i], v_pools[i], plan, scale)        # [T, Hq, D]
            attn_out(i, a)                                                     # o_proj
            if layer_hook is not None:
                layer_hook(i)
            mlp(i)                 # h += o; x = norm(h); h += mlp(x); x = next layer's input norm(h)

    def _c_layer_ops(self, h: torch.Tensor) -> CLayerOps | None:
        """The layers bound to the C ops if they take this pass, else None (module ops). Bound on
        first use and again whenever a weight's storage changed; a model they do not apply to is
        asked once."""
        c_ops = self._c_ops
        if c_ops is None or (c_ops is not False and not c_ops.still_bound()):
            c_ops = self._c_ops = CLayerOps.bind(self.layers, self.arch.rms_norm_eps,
                                                 self.small_batch_max_tokens) or False
        return c_ops if c_ops is not False and c_ops.accepts(h) else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into our layout.

        Every parameter must be found and every checkpoint tensor must be used; otherwise a
        ValueError lists what is missing or unexpected.
        """
        ckpt = CheckpointReader(weights)
        take, copy = ckpt.take, ckpt.copy
        arch = self.arch
        load_embedding_and_head(ckpt, self.embed_tokens, self.lm_head_weight, arch.tie_word_embeddings)
        copy(self.norm.weight, "norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for j, part in enumerate(("q_proj", "k_proj", "v_proj")):
                w = take(f"{p}self_attn.{part}.weight")
                b = take(f"{p}self_attn.{part}.bias", required=arch.attention_bias)
                if w is not None:
                    attn.qkv_proj.load_part(j, w, b)
            w = take(f"{p}self_attn.o_proj.weight")
            if w is not None:
                attn.o_proj.load(w, take(f"{p}self_attn.o_proj.bias", required=False))
            for j, part in enumerate(("gate_proj", "up_proj")):
                w = take(f"{p}mlp.{part}.weight")
                if w is not None:
                    mlp.gate_up_proj.load_part(j, w, take(f"{p}mlp.{part}.bias", required=arch.mlp_bias))
            w = take(f"{p}mlp.down_proj.weight")
            if w is not None:
                mlp.down_proj.load(w, take(f"{p}mlp.down_proj.bias", required=arch.mlp_bias))
            copy(layer.input_layernorm.weight, f"{p}input_layernorm.weight")
            copy(layer.post_attention_layernorm.weight, f"{p}post_attention_layernorm.weight")
            if arch.qk_norm:
                copy(attn.q_norm.weight, f"{p}self_attn.q_norm.weight")
                copy(attn.k_norm.weight, f"{p}self_attn.k_norm.weight")
        ckpt.finish(arch.model_type)
