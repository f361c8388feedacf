"""What our model code needs to know about a checkpoint, read once from its Hugging Face config.

Two families of decoders are served: the Llama family (Llama, SmolLM, Mistral, Qwen2, Qwen3),
run by `pdserve.model.llama`, and Gemma 3 text models, run by `pdserve.model.gemma3`. Every layer
is either full attention or sliding-window attention (`layer_types`, E8): a query at position p
of a sliding layer attends to positions in (p - sliding_window, p].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
GEMMA3_MODEL_TYPES = ("gemma3_text",)
SUPPORTED_MODEL_TYPES = LLAMA_MODEL_TYPES + GEMMA3_MODEL_TYPES
GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh",)


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
    sliding_window: int | None     # window of the sliding layers; None when no layer slides
    family: str                    # "llama" or "gemma3": which model class runs the checkpoint
    layer_types: tuple[str, ...]   # per layer: "full_attention" or "sliding_attention"
    attention_scale: float         # softmax scale of q.k (head_dim^-0.5; Gemma: query_pre_attn_scalar^-0.5)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer types {bad} are not supported; known: {LAYER_TYPES}")
        sliding = SLIDING_ATTENTION in self.layer_types
        if sliding and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding layers need sliding_window >= 1, got {self.sliding_window!r}")
        if not sliding and self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window} but no layer is a sliding layer")

    @property
    def is_hybrid(self) -> bool:
        """Some layers full, some sliding (Gemma 3): they read different attention groups."""
        return len(set(self.layer_types)) > 1

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the attention window its queries see: sliding_window for a sliding layer,
        None (full attention) otherwise. A pass's attention batches are one per window in use
        (pdserve/engine/runner.py), so this names the batch each layer reads."""
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else None for t in self.layer_types)

    @classmethod
    def from_hf_config(cls, config: object) -> "ModelArch":
        model_type = getattr(config, "model_type", None)
        if model_type == "gemma3":
            raise ValueError(
                "model_type 'gemma3' is the multimodal Gemma 3 checkpoint; only Gemma 3 text models "
                "(model_type 'gemma3_text', e.g. gemma-3-270m and gemma-3-1b) are supported"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type in GEMMA3_MODEL_TYPES:
            return _gemma3_arch(config)
        return _llama_arch(config, model_type)


def _common(config: object) -> dict:
    num_heads = config.num_attention_heads
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        rms_norm_eps=float(config.rms_norm_eps),
        max_position_embeddings=int(config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _llama_arch(config: object, model_type: str) -> ModelArch:
    common = _common(config)
    n = common["num_layers"]
    # Qwen2 always has q/k/v biases; the others say so with attention_bias.
    attention_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    sliding = getattr(config, "sliding_window", None)
    if model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        sliding = None
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
    # Qwen2/Qwen3 configs list their layer types (sliding from max_window_layers on); Mistral
    # slides in every layer when it has a window; Llama never slides.
    declared = getattr(config, "layer_types", None)
    if sliding is None:
        layer_types = (FULL_ATTENTION,) * n
    elif declared:
        layer_types = tuple(declared)
    else:
        layer_types = (SLIDING_ATTENTION,) * n
    if SLIDING_ATTENTION not in layer_types:
        sliding = None
    return ModelArch(
        model_type=model_type,
        **common,
        attention_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        hidden_act=hidden_act,
        sliding_window=int(sliding) if sliding is not None else None,
        family="llama",
        layer_types=layer_types,
        attention_scale=common["head_dim"] ** -0.5,
    )


def _gemma3_arch(config: object) -> ModelArch:
    common = _common(config)
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in GEMMA3_ACTIVATIONS:
        raise ValueError(f"Gemma 3 hidden_activation {act!r} is not supported (only {GEMMA3_ACTIVATIONS})")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"attn_logit_softcapping={config.attn_logit_softcapping} is not supported "
            f"(Gemma 3 checkpoints do not use it; Gemma 2 did)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an encoder variant) is not supported")
    layer_types = tuple(config.layer_types)
    sliding = getattr(config, "sliding_window", None) if SLIDING_ATTENTION in layer_types else None
    cap = getattr(config, "final_logit_softcapping", None)
    return ModelArch(
        model_type=config.model_type,
        **common,
        attention_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=False,
        qk_norm=True,
        hidden_act=act,
        sliding_window=int(sliding) if sliding is not None else None,
        family="gemma3",
        layer_types=layer_types,
        attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        final_logit_softcapping=float(cap) if cap is not None else None,
    )


def rope_inv_freq(config: object, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling of the config's RoPE variant.

    layer_type: for configs whose RoPE differs per layer type (Gemma 3: a local base for sliding
    layers, the global base with its scaling for full layers), which one to compute.
    Plain RoPE is computed here; scaled variants (llama3, linear, yarn, ...) use transformers'
    reference initialisers so that our positions match the reference model exactly.
    """
    params = getattr(config, "rope_parameters", None) or {}
    per_type = any(t in params for t in LAYER_TYPES)
    if per_type:
        if layer_type not in params:
            raise ValueError(
                f"the config's RoPE is set per layer type ({sorted(params)}); "
                f"layer_type {layer_type!r} is not one of them"
            )
        params = params[layer_type] or {}
    legacy = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    kwargs = {"layer_type": layer_type} if per_type else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv, float(scaling)
