"""Our Gemma 3 text decoder (Gemma3ForCausalLM) over the paged KV cache.

Gemma 3 differs from the Llama family in the places below; everything else (merged q|k|v and
gate|up projections laid out for tensor parallelism, rotary tables, the attention backend seam)
is shared through `pdserve.model.layers`.

- RMSNorm multiplies by (1 + weight) in float32 and casts afterwards (`GemmaRMSNorm`); the
  checkpoint stores the zero-centred weight.
- Token embeddings are scaled by sqrt(hidden_size), rounded to the model dtype.
- q and k are RMS-normed per head before RoPE; the softmax scale is query_pre_attn_scalar^-0.5.
- The MLP is GeGLU with the tanh GELU: down(gelu_tanh(gate(x)) * up(x)).
- Each layer norms its attention output and its MLP output before the residual add
  (post_attention_layernorm, pre/post_feedforward_layernorm).
- Layers are "sliding_attention" (local RoPE base, a window of sliding_window tokens) or
  "full_attention" (global RoPE base with its scaling); Gemma 3 interleaves five sliding layers
  per full one (E8).
- Optional final logit soft-capping: logits = cap * tanh(logits / cap).

The forward contract is `LlamaForCausalLM`'s, with one addition: `plan` may be a `LayerPlans`
(one backend plan per layer), which a hybrid model needs because its sliding and full layers read
different attention batches. The layer hook fires after each layer's attention output
projection (D7).

Tensor parallelism (pdserve/model/tp.py) splits Gemma 3 as it splits the Llama family: a rank
holds the q|k|v rows of its heads (its KV heads' GQA groups, or its share of a replicated KV
head's group) and its whole fold blocks of gate|up, and its row-parallel o_proj / down_proj
continue the ranks' fold (`set_tp_comm`). The per-head q/k norms work on whatever heads a rank
holds; the embedding (and its sqrt(hidden) scale), the four sandwich norms of each layer and the
residual stream are replicated on every rank, computed from the same broadcast sums, so every rank
holds the same bits. Every rank's layers of both kinds write their own KV heads into their own
pool (one pool of [layers, 2, pages, rank_kv_heads, P, D], whatever group table a page belongs
to). The leader alone applies the final norm, lm_head and soft-capping (`forward`); a worker rank
runs `forward_layers`. With `tp_invariant` (float32) o_proj and down_proj sum in the same fixed
fold blocks at every TP size, so TP 1 and TP N give the same bits, as for the Llama family.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.attention.base import AttentionBackend, LayerPlans
from pdserve.kernels.ops.linear import MAX_ROWS, linear
from pdserve.model.arch import FULL_ATTENTION, SLIDING_ATTENTION, ModelArch, rope_inv_freq
from pdserve.model.layers import (
    MergedColumnLinear,
    RotaryEmbedding,
    RowLinear,
    ShardedAttention,
    embedding_and_head,
    load_embedding_and_head,
)
from pdserve.model.llama import LayerHook
from pdserve.model.tp import RankShard, TPComm, row_fold_block, single_rank
from pdserve.model.weights import CheckpointReader


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and cast back to x's dtype.

    `weight` holds the checkpoint's zero-centred values in the model dtype; `scale` = 1 + weight
    in float32 is derived once by `load` (the reference adds the 1 in float32 on every call).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.register_buffer("scale", torch.ones(size, dtype=torch.float32), persistent=False)

    def load(self, weight: torch.Tensor) -> None:
        if weight.shape != self.weight.shape:
            raise ValueError(f"norm weight: expected shape {tuple(self.weight.shape)}, got {tuple(weight.shape)}")
        self.weight.data.copy_(weight)
        self.scale = 1.0 + self.weight.float()                                  # [size] float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., size]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.scale.shape, self.scale, self.eps)
        return F.rms_norm(x.float(), self.scale.shape, self.scale, self.eps).to(x.dtype)


class Gemma3Attention(ShardedAttention):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, shard: RankShard, invariant: bool) -> None:
        super().__init__(arch, dtype, shard, invariant, o_bias=arch.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps, dtype)
        self.scale = arch.attention_scale

    def forward(
        self,
        x: torch.Tensor,             # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # this layer type's rotary tables, [T, D] each
        k_pool: torch.Tensor,        # [N, Hkv, P, D]
        v_pool: torch.Tensor,        # [N, Hkv, P, D]
        backend: AttentionBackend,
        plan: object,
    ) -> torch.Tensor:               # [T, hidden]
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))              # [T, Hq, D]
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))           # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)                        # [T, Hkv, D]
        q, k = RotaryEmbedding.apply(cos_sin, q, k)
        o = backend.forward(q, k, v, k_pool, v_pool, plan, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, shard: RankShard, invariant: bool) -> None:
        super().__init__()
        inter, rows = arch.intermediate_size, shard.mlp_rows
        self.gate_up_proj = MergedColumnLinear(arch.hidden_size, [inter, inter], False, dtype, part_rows=[rows, rows])
        self.down_proj = RowLinear(inter, arch.hidden_size, False, dtype, in_cols=rows,
                                   fold_block=row_fold_block(shard.mlp_block, dtype, invariant))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))              # [T, inter] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, shard: RankShard, invariant: bool) -> None:
        super().__init__()
        eps, hidden = arch.rms_norm_eps, arch.hidden_size
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = Gemma3Attention(arch, dtype, shard, invariant)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = Gemma3MLP(arch, dtype, shard, invariant)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def norms(self) -> dict[str, GemmaRMSNorm]:
        """Checkpoint name (under layers.{i}.) -> norm module."""
        return {
            "input_layernorm": self.input_layernorm,
            "post_attention_layernorm": self.post_attention_layernorm,
            "pre_feedforward_layernorm": self.pre_feedforward_layernorm,
            "post_feedforward_layernorm": self.post_feedforward_layernorm,
            "self_attn.q_norm": self.self_attn.q_norm,
            "self_attn.k_norm": self.self_attn.k_norm,
        }


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, hf_config: object, dtype: torch.dtype, max_positions: int,
                 small_batch_max_tokens: int = MAX_ROWS, shard: RankShard | None = None,
                 tp_invariant: bool = False) -> None:
        """shard: what this tensor-parallel rank holds (pdserve/model/tp.py); None: TP 1.
        tp_invariant: sum o_proj / down_proj in the fixed fold blocks (float32: TP N == TP 1 bit for
        bit); False: each rank's share in one block (as LlamaForCausalLM)."""
        super().__init__()
        if arch.family != "gemma3":
            raise ValueError(f"Gemma3ForCausalLM cannot run model_type {arch.model_type!r} (family {arch.family!r})")
        # Accepted for the registry's one constructor contract and validated alike; Gemma 3 has no
        # C-op layer loop (its q/k norms and sandwich norms keep every pass on the module ops).
        if not 0 <= small_batch_max_tokens <= MAX_ROWS:
            raise ValueError(f"small_batch_max_tokens must be in [0, {MAX_ROWS}], got {small_batch_max_tokens}")
        self.arch = arch
        self.shard = shard or single_rank(arch.num_heads, arch.num_kv_heads, arch.intermediate_size)
        self.embed_tokens, self.lm_head_weight = embedding_and_head(   # lm_head_weight: [V, hidden]
            arch.vocab_size, arch.hidden_size, arch.tie_word_embeddings, dtype)
        # The reference keeps sqrt(hidden) as a float32 scalar and rounds it to the model dtype.
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size**0.5).to(dtype), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, dtype, self.shard, tp_invariant)
                                    for _ in range(arch.num_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        # One rotary table per layer type in use: local base for sliding layers, global for full.
        self.layer_types = arch.layer_types
        self.ropes = nn.ModuleDict()
        for layer_type in sorted(set(arch.layer_types)):
            inv_freq, scaling = rope_inv_freq(hf_config, arch.head_dim, layer_type)
            self.ropes[layer_type] = RotaryEmbedding(inv_freq, scaling, max_positions, dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,        # [T]
        positions: torch.Tensor,        # [T]
        k_pools: list[torch.Tensor],    # per layer [N, Hkv, P, D]
        v_pools: list[torch.Tensor],
        backend: AttentionBackend,
        plan: object,                   # one backend plan for every layer, or LayerPlans
        logits_indices: torch.Tensor,   # [S] rows whose next-token logits are wanted
        layer_hook: LayerHook | None = None,
        all_hidden: bool = False,       # return the final hidden state of every row, [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [S, V] float32, final hidden [S or T, hidden]
        h = self.forward_layers(input_ids, positions, k_pools, v_pools, backend, plan, layer_hook)  # [T, hidden]
        normed = self.norm(h) if all_hidden else None                          # [T, hidden]
        last = self.norm(h[logits_indices]) if normed is None else normed[logits_indices]  # [S, hidden]
        logits = linear(last, self.lm_head_weight)                           # [S, V]
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float(), last if normed is None else normed

    @torch.inference_mode()
    def forward_layers(
        self,
        input_ids: torch.Tensor,        # [T]
        positions: torch.Tensor,        # [T]
        k_pools: list[torch.Tensor],    # per layer [N, Hkv, P, D] (this rank's KV heads)
        v_pools: list[torch.Tensor],
        backend: AttentionBackend,
        plan: object,                   # one backend plan for every layer, or LayerPlans
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:                  # h [T, hidden]: the residual stream after the last layer
        """The scaled embedding and the decoder layers (what a tensor-parallel worker rank runs:
        the leader alone applies the final norm, lm_head and soft-capping)."""
        plans = self._layer_plans(plan)
        h = self.embed_tokens(input_ids) * self.embed_scale                    # [T, hidden]
        cos_sin = {t: rope.tables(positions) for t, rope in self.ropes.items()}
        for i, layer in enumerate(self.layers):
            residual = h
            a = layer.self_attn(layer.input_layernorm(h), cos_sin[self.layer_types[i]],
                                k_pools[i], v_pools[i], backend, plans[i])    # o_proj folded over the ranks
            if layer_hook is not None:
                layer_hook(i)
            h = residual + layer.post_attention_layernorm(a)
            residual = h
            h = residual + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        return h

    def set_tp_comm(self, comm: TPComm) -> None:
        """Connect every row-parallel layer to this rank's group (pdserve/parallel)."""
        for layer in self.layers:
            layer.self_attn.o_proj.comm = comm
            layer.mlp.down_proj.comm = comm

    def _layer_plans(self, plan: object) -> tuple[object, ...] | list[object]:
        if isinstance(plan, LayerPlans):
            if len(plan.plans) != self.arch.num_layers:
                raise ValueError(f"LayerPlans has {len(plan.plans)} plans for {self.arch.num_layers} layers")
            return plan.plans
        if self.arch.is_hybrid:
            raise ValueError(
                "a hybrid model (layers of types "
                f"{sorted(set(self.arch.layer_types))}) needs LayerPlans, one plan per layer: its "
                f"{SLIDING_ATTENTION} and {FULL_ATTENTION} layers read different attention batches"
            )
        return [plan] * self.arch.num_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face Gemma3ForCausalLM names) into our layout.

        Every parameter must be found and every checkpoint tensor must be used; otherwise a
        ValueError lists what is missing or unexpected.
        """
        ckpt = CheckpointReader(weights)
        take = ckpt.take

        def load_norm(norm: GemmaRMSNorm, name: str) -> None:
            t = take(name)
            if t is not None:
                norm.load(t)

        arch = self.arch
        bias = arch.attention_bias
        load_embedding_and_head(ckpt, self.embed_tokens, self.lm_head_weight, arch.tie_word_embeddings)
        load_norm(self.norm, "norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for j, part in enumerate(("q_proj", "k_proj", "v_proj")):
                w = take(f"{p}self_attn.{part}.weight")
                b = take(f"{p}self_attn.{part}.bias", required=bias)
                if w is not None:
                    attn.qkv_proj.load_part(j, w, b)
            w = take(f"{p}self_attn.o_proj.weight")
            if w is not None:
                attn.o_proj.load(w, take(f"{p}self_attn.o_proj.bias", required=bias))
            for j, part in enumerate(("gate_proj", "up_proj")):
                w = take(f"{p}mlp.{part}.weight")
                if w is not None:
                    mlp.gate_up_proj.load_part(j, w)
            w = take(f"{p}mlp.down_proj.weight")
            if w is not None:
                mlp.down_proj.load(w)
            for name, norm in layer.norms().items():
                load_norm(norm, f"{p}{name}.weight")
        ckpt.finish(arch.model_type)
