"""Helpers that connect an engine's KV cache to the messenger (used by both node kinds)."""

from __future__ import annotations

import torch

from kv_messenger.plan import KvLayout

_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class UnsupportedModelError(ValueError):
    """The model cannot be served disaggregated (prefill and decode nodes): refused at node start."""


def check_transferable(engine) -> None:
    """Raise UnsupportedModelError unless every layer of the engine's model keeps its KV in the
    one "full" attention group.

    The messenger sends the pages of the "full" group's block table only (engine.block_table), at
    the same block ids in every layer. A sliding-window or hybrid model (Gemma 3: "full" and
    "sliding" groups, E8) keeps its sliding layers' KV in another table with other block ids, so
    a prefill/decode pair would silently decode over KV that never arrived. Until the messenger
    sends every group's pages, such models run colocated only.
    """
    groups = [g.group for g in engine.cache_manager.groups]
    if [g.name for g in groups] == ["full"]:
        return
    layer_types = tuple(engine.arch.layer_types)
    described = []
    for g in groups:
        kind = "full_attention" if g.sliding_window is None else "sliding_attention"
        layers = [i for i, t in enumerate(layer_types) if t == kind]
        window = "" if g.sliding_window is None else f", window {g.sliding_window} tokens"
        noun = "layer" if len(layers) == 1 else "layers"
        described.append(f"{g.name!r} ({len(layers)} {noun}: {layers}{window})")
    raise UnsupportedModelError(
        f"model {engine.source.name!r} cannot be served by prefill/decode nodes: its KV cache has attention "
        f"groups {', '.join(described)}, but the KV messenger transfers only the 'full' group's pages, so the "
        f"sliding-window layers' KV would never reach the decode node (wrong output, no error). Sliding-window "
        f"and hybrid models are not supported in disaggregated mode yet; serve this model colocated "
        f"(decode node --colocated, pdserve up --colocated N)")


def layout_of(kv_cache) -> KvLayout:
    """The KvLayout of a pdserve PagedKVCache (buffer [layers, 2, pages, kv_heads, page_size, head_dim])."""
    s = kv_cache.shape
    return KvLayout(s.num_layers, s.num_pages, s.kv_heads, s.page_size, s.head_dim, _DTYPE_NAMES[str(kv_cache.dtype)])


def register_kv(fabric_engine, kv_cache):
    """Register the whole KV buffer (one contiguous tensor) with the fabric engine."""
    buf = kv_cache.buffer
    if not buf.is_contiguous():
        raise ValueError("the KV buffer must be contiguous to be registered as one region")
    return fabric_engine.register(address=buf.data_ptr(), length=buf.numel() * buf.element_size())
