"""Helpers that connect an engine's KV cache to the messenger (used by both node kinds)."""

from __future__ import annotations

from kv_messenger.plan import KvLayout

_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


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
