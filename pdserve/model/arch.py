"""What our model code needs to know about a checkpoint, read once from its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, config: object) -> "ModelArch":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # Qwen2 always has q/k/v biases; the others say so with attention_bias.
        attention_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        sliding = getattr(config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            sliding = None
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=hidden_act,
            sliding_window=sliding,
        )


def rope_inv_freq(config: object, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling of the config's RoPE variant.

    Plain RoPE is computed here; scaled variants (llama3, linear, yarn, ...) use transformers'
    reference initialisers so that our positions match the reference model exactly.
    """
    params = getattr(config, "rope_parameters", None) or {}
    legacy = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv, float(scaling)
