"""Which model class runs a checkpoint: `build_model(arch, hf_config, dtype, max_model_len, ...)`.

The class is chosen by the checkpoint's family (read from its config's model_type into
`ModelArch.family`); the config's `architectures` must name a causal-LM head we implement. Every
class has `LlamaForCausalLM`'s forward contract and a `load_weights` that takes Hugging Face
tensor names, so the runner and the engine drive any of them the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.ops.linear import MAX_ROWS
from pdserve.model.arch import ModelArch
from pdserve.model.gemma3 import Gemma3ForCausalLM
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.tp import RankShard

_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}

# Hugging Face head classes we serve, per family (a config may omit `architectures`).
_HF_ARCHITECTURES: dict[str, frozenset[str]] = {
    "llama": frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}),
    "gemma3": frozenset({"Gemma3ForCausalLM"}),
}


def model_class(arch: ModelArch, hf_config: object) -> type[nn.Module]:
    """The class that runs `arch`; ValueError naming the model type and architectures otherwise."""
    cls = _CLASSES.get(arch.family)
    if cls is None:
        raise ValueError(f"no model class for family {arch.family!r} (model_type {arch.model_type!r})")
    declared = tuple(getattr(hf_config, "architectures", None) or ())
    unknown = [a for a in declared if a not in _HF_ARCHITECTURES[arch.family]]
    if unknown:
        raise ValueError(
            f"architectures {unknown} of model_type {arch.model_type!r} are not supported; "
            f"supported: {sorted(_HF_ARCHITECTURES[arch.family])}"
        )
    if arch.is_hybrid and cls is LlamaForCausalLM:
        raise ValueError(
            f"model_type {arch.model_type!r} mixes layer types {sorted(set(arch.layer_types))} "
            f"(e.g. Qwen2 with use_sliding_window and max_window_layers < num_hidden_layers); "
            f"only Gemma 3 supports per-layer attention types"
        )
    return cls


def build_model(arch: ModelArch, hf_config: object, dtype: torch.dtype, max_model_len: int,
                small_batch_max_tokens: int = MAX_ROWS, shard: RankShard | None = None,
                tp_invariant: bool = False) -> nn.Module:
    """An empty model (weights not loaded) for `arch`, with rotary tables for max_model_len positions;
    passes of at most small_batch_max_tokens float32 tokens run the C-op layer ops where the
    model has them (EngineConfig.small_batch_max_tokens; 0: never). shard: a tensor-parallel
    rank's share (pdserve/model/tp.py; every family); None: the whole model.
    tp_invariant: the TP-invariant fold of the row-parallel layers (EngineConfig)."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    cls = model_class(arch, hf_config)
    return cls(arch, hf_config, dtype, max_model_len, small_batch_max_tokens=small_batch_max_tokens,
               shard=shard, tp_invariant=tp_invariant)
