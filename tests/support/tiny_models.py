"""Tiny random-weight checkpoints for tests, built locally (nothing is downloaded).

:func:`make_tiny_checkpoint` writes a Hugging Face checkpoint directory (``config.json``,
``model.safetensors`` in float32, ``generation_config.json``) plus the default model's
tokenizer, so the tiny models tokenize and chat-template exactly like SmolLM2 and have its
vocabulary size (49152) and BOS/EOS/PAD ids.

Architectures (:data:`TINY_ARCHS`), all hidden 64, 4 query heads, 2 KV heads (GQA), head_dim
16, intermediate 128, 2 layers, 2048 positions:

- ``llama``: tied embeddings, default RoPE (like SmolLM2);
- ``llama3``: untied ``lm_head``, ``llama3`` RoPE scaling with all three frequency bands used;
- ``qwen2``: q/k/v projection biases (as transformers' Qwen2 always has them), tied embeddings;
- ``qwen3``: per-head q/k RMSNorm, untied ``lm_head``;
- ``mistral``: Mistral defaults with ``sliding_window=None`` (plain full attention), untied.

:data:`TINY_GEMMA3` (``gemma3``, kept out of TINY_ARCHS: it has its own tests) is a hybrid
Gemma 3 text model with the same sizes but 4 layers: sliding, full, sliding, sliding with a
16-token window (:data:`TINY_GEMMA3_WINDOW`), a local RoPE base for sliding layers and a linearly
scaled global one for the full layer, query_pre_attn_scalar 24 (so the softmax scale is not
head_dim^-0.5), final logit soft-capping at 30, tied embeddings.

Weights are drawn with a seeded generator at std 0.2 (not transformers' 0.02), norm weights
around 1 (Gemma's zero-centred ones around 0, i.e. a scale around 1) and biases non-zero, so that
greedy decoding has clear top-1 margins and a model that skips a bias or a norm weight produces
different tokens.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from typing import Any

import torch
import transformers

from pdserve.model.loader import ModelSource, resolve_model

TINY_ARCHS: tuple[str, ...] = ("llama", "llama3", "qwen2", "qwen3", "mistral")
TINY_GEMMA3 = "gemma3"
TINY_GEMMA3_WINDOW = 16

TINY_VOCAB_SIZE = 49152
TINY_INIT_STD = 0.2
# Embedding and lm_head std: logits get std ~4 over 49152 tokens, so the gap between the top
# two logits is typically ~1 and a float32 reordering of sums (~1e-5) rarely flips greedy.
TINY_VOCAB_STD = 0.5
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "initializer_range": TINY_INIT_STD,
    "hidden_act": "silu",
}

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 the wavelengths are 6, 32, 164, 838, ... so against 256 positions
    # some are kept (< 64), one is smoothed and the rest are scaled.
    "original_max_position_embeddings": 256,
}

_ARCH_SETTINGS: dict[str, tuple[type[transformers.PretrainedConfig], dict[str, Any]]] = {
    "llama": (
        transformers.LlamaConfig,
        {
            "head_dim": 16,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "llama3": (
        transformers.LlamaConfig,
        {"head_dim": 16, "tie_word_embeddings": False, "rope_parameters": _LLAMA3_ROPE},
    ),
    "qwen2": (
        transformers.Qwen2Config,
        {"tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None},
    ),
    "qwen3": (
        transformers.Qwen3Config,
        {
            "head_dim": 16,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
        },
    ),
    "mistral": (
        transformers.MistralConfig,
        {"head_dim": 16, "tie_word_embeddings": False, "sliding_window": None},
    ),
    TINY_GEMMA3: (
        transformers.Gemma3TextConfig,
        {
            "head_dim": 16,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            "sliding_window": TINY_GEMMA3_WINDOW,
            "query_pre_attn_scalar": 24,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
        },
    ),
}


def default_model_source() -> ModelSource:
    """The default model (converted and cached on first use: ~35 s once, then instant)."""
    return resolve_model(None)


def tiny_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    """The transformers config of a tiny ``arch`` model, with the default model's token ids."""
    if arch not in _ARCH_SETTINGS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {(*TINY_ARCHS, TINY_GEMMA3)}")
    config_class, arch_kwargs = _ARCH_SETTINGS[arch]
    common = {k: v for k, v in _COMMON.items() if not (arch == TINY_GEMMA3 and k == "hidden_act")}
    kwargs = {**common, **_default_token_ids(), **arch_kwargs, **overrides}
    config = config_class(**kwargs)
    config.dtype = "float32"
    return config


def make_tiny_checkpoint(
    arch: str, out_dir: pathlib.Path, *, seed: int = 0, **overrides: Any
) -> pathlib.Path:
    """Write a tiny random ``arch`` checkpoint plus the default tokenizer into ``out_dir``.

    ``overrides`` are config fields (e.g. ``num_hidden_layers=3``, ``tie_word_embeddings=False``).
    The same ``arch``, ``seed`` and ``overrides`` always give the same weights.
    """
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    norm_center = 0.0 if config.model_type.startswith("gemma") else 1.0  # Gemma norms scale by 1 + w
    _randomize(model, seed=seed, std=float(config.initializer_range), vocab_std=TINY_VOCAB_STD,
               norm_center=norm_center)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _copy_tokenizer(default_model_source().path, out_dir)
    return out_dir


@torch.no_grad()
def _randomize(model: torch.nn.Module, *, seed: int, std: float, vocab_std: float, norm_center: float = 1.0) -> None:
    """Seeded weights: matrices N(0, std), embedding and lm_head N(0, vocab_std),
    norm weights U(norm_center - 0.2, norm_center + 0.2), biases N(0, std). Tied parameters are
    listed (and drawn) once."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            scale = vocab_std if ("embed_tokens" in name or "lm_head" in name) else std
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
        elif name.endswith("bias"):
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        elif "norm" in name:
            param.copy_(norm_center - 0.2 + 0.4 * torch.rand(param.shape, generator=generator))
        else:
            raise ValueError(f"no init rule for parameter {name!r} of shape {tuple(param.shape)}")
    if not all(math.isfinite(float(p.abs().max())) for p in model.parameters()):
        raise ValueError("tiny model weights are not finite")


def _default_token_ids() -> dict[str, int]:
    """BOS, EOS and PAD ids of the default model (read from its cached config files)."""
    path = default_model_source().path
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    ids: dict[str, int] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = generation.get(key, config.get(key))
        if isinstance(value, list):
            value = value[0]
        if isinstance(value, int):
            ids[key] = value
    return ids


def _copy_tokenizer(source_dir: pathlib.Path, out_dir: pathlib.Path) -> None:
    copied = 0
    for file_name in TOKENIZER_FILES:
        source = source_dir / file_name
        if source.is_file():
            shutil.copyfile(source, out_dir / file_name)
            copied += 1
    if not (out_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in '{source_dir}' to copy ({copied} files copied)"
        )
