"""What both connectors do with the engine's KV pool when it is handed over (register_kv_cache)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from fabric import MemoryRegion, TransferEngine
from kv_messenger.context import ContextCodec, Staging
from kv_messenger.placement import ShardPlacement, placement_summary, shard_placements
from kv_messenger.plan import KvLayout, check_transferable, layout_of
from kv_messenger.shard_plan import KvShards, TpScheme
from pdserve.engine.kv_connector import KvCacheSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegisteredPool:
    layout: KvLayout                    # the pool's geometry as the wire describes it (kv_heads: the model's total)
    shards: KvShards                    # this node's split of it over its TP ranks (one rank at TP 1)
    regions: tuple[MemoryRegion, ...]   # every rank's pool, rank order, one registration each (D13, D15)
    codec: ContextCodec                 # the context record of this model (D12)
    context: Staging                    # registered context slots: send staging or landing area
    placements: tuple[ShardPlacement, ...] = ()   # D16: each rank's NUMA node, NIC and CPUs (() if unreadable)

    @property
    def region(self) -> MemoryRegion:
        """Rank 0's pool (the whole pool at TP 1)."""
        return self.regions[0]


def pool_shards(spec: KvCacheSpec) -> KvShards:
    """The node's side of a transfer: the model's total layout split as the engine split it.

    At TP 1 one rank holds every head. Under TP the heads each rank's pool holds must be the shard
    plan's rule (`TpScheme.split`, which the peer applies to our tp_size), with one geometry; ValueError
    naming the rank otherwise."""
    rank0 = layout_of(spec)
    if not spec.shards:
        return KvShards.of(rank0, 1)
    total = 1 + max(h for pool in spec.shards for h in pool.kv_heads)
    scheme = TpScheme.split(total, len(spec.shards))
    held = tuple(tuple(pool.kv_heads) for pool in spec.shards)
    if held != scheme.rank_heads:
        raise ValueError(f"the engine's KV heads per rank {list(held)} differ from the transfer plan's rule "
                         f"{list(scheme.rank_heads)} for {total} KV heads at tensor-parallel size {len(spec.shards)}")
    layouts = []
    for pool in spec.shards:
        b = pool.buffer   # [num_layers, 2, num_pages, len(kv_heads), page_size, head_dim]
        if tuple(b.shape) != (rank0.num_layers, 2, rank0.num_pages, len(pool.kv_heads), rank0.page_size,
                              rank0.head_dim) or b.dtype != spec.dtype:
            raise ValueError(f"TP rank {pool.rank}'s KV pool is {tuple(b.shape)} {b.dtype}, not rank 0's geometry "
                             f"with its {len(pool.kv_heads)} heads")
        layouts.append(replace(rank0, kv_heads=len(pool.kv_heads)))
    return KvShards.from_rank_layouts(scheme, layouts)


def register_pool(transport: TransferEngine, spec: KvCacheSpec, context_slots: int) -> RegisteredPool:
    """Check the model can be moved, register every rank's pool and allocate `context_slots` context
    slots; UnsupportedModelError (a ValueError) for sliding-window / hybrid models, ValueError for a
    pool that is not one contiguous buffer or a split off the plan's head boundary."""
    check_transferable(spec)
    shards = pool_shards(spec)
    buffers = [p.buffer for p in spec.shards] if spec.shards else [spec.buffer]
    regions = []
    for rank, buf in enumerate(buffers):
        if not buf.is_contiguous():
            raise ValueError(f"TP rank {rank}'s KV buffer must be contiguous to be registered as one region")
        regions.append(transport.register(address=buf.data_ptr(), length=buf.numel() * buf.element_size()))
    codec = ContextCodec(spec.hidden_size)
    return RegisteredPool(shards.layout, shards, tuple(regions), codec,
                          codec.alloc_staging(transport, slots=context_slots), locate_shards(spec, transport.provider))


def locate_shards(spec: KvCacheSpec, provider: str | None) -> tuple[ShardPlacement, ...]:
    """D16: where each rank's pool sits and what is closest to it (kv_messenger.placement), logged
    once. Advisory: a host whose /sys cannot be read (a container without it) gets () and a warning,
    never a refused node."""
    try:
        placements = shard_placements(spec, provider)
    except (OSError, ValueError) as e:   # TopologyError is a ValueError
        logger.warning("KV shard placement unknown (%s: %s): transfers use the node's one fabric engine and "
                       "threads stay where the launcher put them", type(e).__name__, e)
        return ()
    logger.info("%s", placement_summary(placements))
    return placements
