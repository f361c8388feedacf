"""Our Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3) over the paged KV cache.

The forward pass takes the flat token axis of a whole batch ([T] ids and positions): token-wise
work (norms, projections, MLP) runs over all tokens of all sequences at once, attention runs per
sequence through the attention backend (E2). After each layer's attention output projection the
layer hook is called (D7: the KV messenger learns that layer L's KV is in the pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pdserve.kernels.attention.base import AttentionBackend
from pdserve.model.arch import ModelArch, rope_inv_freq
from pdserve.model.layers import (MergedColumnLinear, RMSNorm, RotaryEmbedding, RowLinear, embedding_and_head,
                                  load_embedding_and_head)
from pdserve.model.small_batch import SmallBatchLayers
from pdserve.model.weights import CheckpointReader
from pdserve.kernels.ops.linear import linear
from pdserve.kernels.ops.norm_act import silu_mul
from pdserve.kernels.ops.rope_kv import rope_qk

LayerHook = Callable[[int], None]


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedColumnLinear(arch.hidden_size, [q_size, kv_size, kv_size], arch.attention_bias, dtype)
        self.o_proj = RowLinear(q_size, arch.hidden_size, False, dtype)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,             # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # rotary tables for the step, [T, D] each
        k_pool: torch.Tensor,        # [N, Hkv, P, D]
        v_pool: torch.Tensor,        # [N, Hkv, P, D]
        backend: AttentionBackend,
        plan: object,
    ) -> torch.Tensor:               # [T, hidden]
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
        o = backend.forward(q, k, v, k_pool, v_pool, plan, self.scale)              # [T, Hq, D]
        return self.o_proj.forward(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnLinear(arch.hidden_size, [inter, inter], arch.mlp_bias, dtype)
        self.down_proj = RowLinear(inter, arch.hidden_size, arch.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        return self.down_proj.forward(silu_mul(self.gate_up_proj.forward(x)))  # [T, 2 inter] -> [T, inter]


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, hf_config: object, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens, self.lm_head_weight = embedding_and_head(   # lm_head_weight: [V, hidden]
            arch.vocab_size, arch.hidden_size, arch.tie_word_embeddings, dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        inv_freq, scaling = rope_inv_freq(hf_config, arch.head_dim)
        self.rope = RotaryEmbedding(inv_freq, scaling, max_positions, dtype)
        # The C-op layer loop for few-token float32 passes: None = not bound yet, False = does
        # not apply to this model (see _small_batch_layers).
        self._small_batch: SmallBatchLayers | bool | None = None

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
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [S, V] float32, final hidden [S, hidden]
        h = self.embed_tokens(input_ids)                                       # [T, hidden]
        cos_sin = self.rope.tables(positions)
        x = self.layers[0].input_layernorm.forward(h)                           # [T, hidden]
        small = self._small_batch_layers(h)
        if small is not None:  # few tokens, float32 on CPU: the same ops, called by address
            h += small.run(h, x, cos_sin, k_pools, v_pools, backend, plan, layer_hook)
        else:
            self._run_layers(h, x, cos_sin, k_pools, v_pools, backend, plan, layer_hook)
        last = self.norm.forward(h[logits_indices])                                    # [S, hidden]
        logits = linear(last, self.lm_head_weight).float()                   # [S, V]
        return logits, last

    def _run_layers(
        self,
        h: torch.Tensor,                # [T, hidden] residual stream, updated in place
        x: torch.Tensor,                # [T, hidden] layer 0's input norm of h
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        backend: AttentionBackend,
        plan: object,
        layer_hook: LayerHook | None,
    ) -> None:
        # Submodules are called through .forward: nn.Module.__call__'s hook machinery costs a few
        # microseconds per call, ~300 calls per pass, and no hooks are ever registered here.
        # The residual stream h is updated in place by add_rms_norm (h += delta, then the norm):
        # one pass per layer boundary instead of an add and a norm.
        layers = self.layers
        for i, layer in enumerate(layers):
            a = layer.self_attn.forward(x, cos_sin, k_pools[i], v_pools[i], backend, plan)
            if layer_hook is not None:
                layer_hook(i)
            x = layer.post_attention_layernorm.add_forward(h, a)                # h += a; norm(h)
            m = layer.mlp.forward(x)
            if i + 1 < len(layers):
                x = layers[i + 1].input_layernorm.add_forward(h, m)             # h += m; norm(h)
            else:
                h += m

    def _small_batch_layers(self, h: torch.Tensor) -> SmallBatchLayers | None:
        """The bound C-op layer loop for this pass, or None (module path). Bound on first use and
        again whenever a weight's storage changed; a model it does not apply to is asked once."""
        small = self._small_batch
        if small is None or (small is not False and not small.still_bound()):
            small = self._small_batch = SmallBatchLayers.bind(self.layers, self.arch.rms_norm_eps) or False
        return small if small is not False and small.accepts(h) else None

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
