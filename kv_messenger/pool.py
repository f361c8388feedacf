"""What both connectors do with the engine's KV pool when it is handed over (register_kv_cache).

D16 rails: each rank's pool is registered on the rail (TransferEngine endpoint) of the libfabric
domain its placement names (kv_messenger.placement: the NIC nearest the pool's NUMA node), opened
on first use (`TransferEngine.open_rail`, its progress thread pinned to the placement's CPUs:
`pin_rail`); its descriptor then carries that rail's fabric address,
so the decode side's ticket names each rank's rail (TransferTicket.kv_ranks) and the prefill
side's writes of a rank post from its rail (fabric.engine: a write posts on its source region's
rail). A rank whose placement names no domain (one NIC or none, a NIC of unknown locality: every
test cluster), the domain rail 0 already has, or a domain no rail can open on (shm's single
domain, FabricConfig.multi_rail False, a domain the provider does not list; logged) stays on
rail 0: with one NIC nothing changes. efa and verbs rails are opened by domain name (efa's
"<device>-rdm", verbs' device), tcp's by name and interface address (fabric.engine.open_rail),
so on a multi-NIC EFA host each rank's pool goes to its nearest NIC's rail.

Bounds: `open_rail` opens a native endpoint (no peer involved, see fabric.engine); the rest is
sysfs reads and registrations. Nothing here waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fabric import FabricError, MemoryRegion, TransferEngine
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


Place = Callable[[KvCacheSpec, "str | None"], tuple[ShardPlacement, ...]]


def register_pool(transport: TransferEngine, spec: KvCacheSpec, context_slots: int, *,
                  place: Place | None = None) -> RegisteredPool:
    """Check the model can be moved, register every rank's pool on its placement's rail (module
    docstring) and allocate `context_slots` context slots (on rail 0, as the context travels to
    and from the leader); UnsupportedModelError (a ValueError) for sliding-window / hybrid models,
    ValueError for a pool that is not one contiguous buffer or a split off the plan's head boundary.
    `place(spec, provider)`: the placements (default `locate_shards`: this host's /sys)."""
    check_transferable(spec)
    shards = pool_shards(spec)
    buffers = [p.buffer for p in spec.shards] if spec.shards else [spec.buffer]
    for rank, buf in enumerate(buffers):
        if not buf.is_contiguous():
            raise ValueError(f"TP rank {rank}'s KV buffer must be contiguous to be registered as one region")
    placements = (place or locate_shards)(spec, transport.provider)
    rails = shard_rails(transport, placements, len(buffers))
    regions = tuple(transport.register(address=buf.data_ptr(), length=buf.numel() * buf.element_size(), rail=rail)
                    for buf, rail in zip(buffers, rails, strict=True))
    if len(transport.rails) > 1:
        logger.info("KV shard rails: %s", "; ".join(
            f"rank {rank} rail {rail} ({transport.rails[rail].domain})" for rank, rail in enumerate(rails)))
    codec = ContextCodec(spec.hidden_size, history_rows=spec.context_history_rows)
    return RegisteredPool(shards.layout, shards, regions, codec, codec.alloc_staging(transport, slots=context_slots),
                          placements)


def shard_rails(transport: TransferEngine, placements: Sequence[ShardPlacement], ranks: int) -> tuple[int, ...]:
    """Each rank's rail: the one on its placement's domain (opened if need be), else 0 (module
    docstring). `placements`: rank order, or () when unknown (every rank on rail 0)."""
    out = []
    refused: set[str] = set()
    for rank in range(ranks):
        domain = placements[rank].domain if rank < len(placements) else None
        rail = transport.rail_for(domain)
        if rail is None and domain not in refused:
            try:
                rail = transport.open_rail(domain)
                # its progress thread (posting, completions) next to its NIC, as the placement says
                transport.pin_rail(rail, placements[rank].cpus)
            except (ValueError, FabricError) as e:
                refused.add(domain)
                logger.warning("TP rank %d's KV pool stays on rail 0 (domain %s), not on its nearest domain %s: %s",
                               rank, transport.domain, domain, e)
        out.append(rail or 0)
    return tuple(out)


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
