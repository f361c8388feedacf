"""What both connectors do with the engine's KV pool when it is handed over (register_kv_cache)."""

from __future__ import annotations

from dataclasses import dataclass

from fabric import MemoryRegion, TransferEngine
from kv_messenger.context import ContextCodec, Staging
from kv_messenger.plan import KvLayout, check_transferable, layout_of
from pdserve.engine.kv_connector import KvCacheSpec


@dataclass(frozen=True)
class RegisteredPool:
    layout: KvLayout            # the pool's geometry, as the wire describes it
    region: MemoryRegion        # the whole pool, one registration (D13)
    codec: ContextCodec         # the context record of this model (D12)
    context: Staging            # registered context slots: send staging or landing area


def register_pool(transport: TransferEngine, spec: KvCacheSpec, context_slots: int) -> RegisteredPool:
    """Check the model can be moved, register its pool and allocate `context_slots` context slots;
    UnsupportedModelError (a ValueError) for sliding-window / hybrid models, ValueError for a pool
    that is not one contiguous buffer."""
    check_transferable(spec)
    if not spec.buffer.is_contiguous():
        raise ValueError("the KV buffer must be contiguous to be registered as one region")
    region = transport.register(address=spec.buffer.data_ptr(), length=spec.nbytes)
    codec = ContextCodec(spec.hidden_size)
    return RegisteredPool(layout_of(spec), region, codec, codec.alloc_staging(transport, slots=context_slots))
