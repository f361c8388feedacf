"""Transfer arithmetic, written once: where each page lives in bytes, which writes a prefill
makes, and how many immediate-data writes the decode side must count (D10, D13, D14).

The KV buffer of a node is `[layers, 2 (K, V), pages, kv_heads, page_size, head_dim]` (HND), so a
page of one layer and side is one contiguous run of `kv_heads * page_size * head_dim` elements,
and a rank's shard of it (a range of kv heads) is contiguous too.

`KvLayout` and the tensor-parallel shard plan (D14: which byte runs go from which prefill rank to
which decode rank) live in `shard_plan`; this module's `expected_writes` is that plan's count.
Equal sharding on both sides maps rank r to rank r and every page to one write per layer and side.

What the decode side counts, exactly: page writes, not posted operations. The sender hands the
fabric one entry per page, layer and side (and one for the context), with imm_mode "every". The
fabric coalesces entries that are contiguous in both the prefill node's and the decode node's
buffers into one RDMA write (D13: never more than one write per page), and that write carries
the number of entries it holds in the low 8 bits of its immediate data (fabric.imm). The
receiver's ImmCounter adds those up, so the count it expects depends only on page, layer and
shard counts, which both sides know, and never on which source pages happened to be adjacent.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_messenger.shard_plan import (
    DTYPE_SIZES as DTYPE_SIZES,  # re-exported: the wire's element sizes
    KvLayout,
    KvShards,
    expected_page_writes,
)
from pdserve.engine.kv_connector import KvCacheSpec


@dataclass(frozen=True)
class ShardingScheme:
    """A node's tensor-parallel size, as the wire carries it. Which heads each rank holds follows
    from it and the model's KV head count by one rule (`shard_plan.shard_kv_heads`): `kv_shards`."""

    tp_size: int = 1
    kv_heads_per_rank: int = 0  # the wire's field, informational (uneven splits have no one number)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")

    def kv_shards(self, layout: KvLayout) -> KvShards:
        """This node's side of a transfer: `layout` (kv_heads = the model's total) split over its ranks;
        ValueError naming the counts when the heads cannot be split."""
        return KvShards.of(layout, self.tp_size)


def num_prompt_pages(num_prefill_tokens: int, page_size: int) -> int:
    """Pages holding the prefilled tokens (every prompt token but the last, D17)."""
    return -(-num_prefill_tokens // page_size)


def expected_writes(
    num_prefill_tokens: int,
    layout: KvLayout,
    prefill_sharding: ShardingScheme,
    decode_sharding: ShardingScheme,
    context_writes: int = 1,
) -> int:
    """Immediate-data units (page writes) the decode side counts for one request, over all its ranks.

    `layout`: the geometry both sides share, kv_heads = the model's total. Equal sharding: pages x
    layers x (K, V) + the context write(s); otherwise the shard plan's count (shard_plan:
    pages x layers x (K, V) x the runs of a page, + the context). Coalesced writes carry several
    units, so this is also the number of entries the sender hands the fabric. ValueError naming
    both sides when the split cannot be planned.
    """
    pages = num_prompt_pages(num_prefill_tokens, layout.page_size)
    if prefill_sharding.tp_size == decode_sharding.tp_size == 1:
        return pages * layout.num_layers * 2 + context_writes
    return expected_page_writes(prefill_sharding.kv_shards(layout), decode_sharding.kv_shards(layout),
                                pages, context_writes).total


def completed_pages(start: int, end: int, final_end: int, page_size: int) -> range:
    """Page indices (within the request) that a chunk covering tokens [start, end) completes.

    A page is complete once all its tokens are computed; the last page of the prefill is complete
    when the last chunk (end == final_end) has run, even if it is only partly filled.
    """
    first = start // page_size
    done = end // page_size if end < final_end else -(-final_end // page_size)
    # Pages before `first` were completed by earlier chunks (a page that start falls inside
    # was not complete before this chunk, so it is ours).
    return range(first, max(first, done))


class UnsupportedModelError(ValueError):
    """The model cannot be served disaggregated (prefill and decode nodes): refused at node start."""


def layout_of(spec: KvCacheSpec) -> KvLayout:
    """The KvLayout of an engine's KV pool (buffer [layers, 2, pages, kv_heads, page_size, head_dim])."""
    s = spec.shape
    return KvLayout(s.num_layers, s.num_pages, s.kv_heads, s.page_size, s.head_dim,
                    str(spec.dtype).removeprefix("torch."))


def check_transferable(spec: KvCacheSpec) -> None:
    """Raise UnsupportedModelError unless the model's KV can be moved by the messenger.

    Every attention group travels (E8): the "full" group's pages in its layers, and a hybrid
    model's sliding-window group (Gemma 3) in its own layers, at its own block ids, only the pages
    the decode side's first step reads (`window_first_page`). A model with no full-attention layer
    (sliding only) is refused: the request's token pages are named by the full group's table.
    """
    names = [g.name for g in spec.groups]
    if "full" in names and set(names) <= {"full", "sliding"} and len(set(names)) == len(names):
        return
    described = []
    for g in spec.groups:
        window = "" if g.sliding_window is None else f", window {g.sliding_window} tokens"
        noun = "layer" if len(g.layers) == 1 else "layers"
        described.append(f"{g.name!r} ({len(g.layers)} {noun}: {list(g.layers)}{window})")
    raise UnsupportedModelError(
        f"model {spec.model_name!r} cannot be served by prefill/decode nodes: its KV cache has attention "
        f"groups {', '.join(described)}, and the KV messenger needs a 'full' group (plus at most one 'sliding' "
        f"group) to name a request's pages. Serve this model colocated (decode node --colocated, "
        f"pdserve up --colocated N)")


def window_first_page(num_prefill_tokens: int, sliding_window: int, page_size: int) -> int:
    """The first request page a sliding-window layer's first decode step reads: that step's query
    sits at position num_prefill_tokens (D17) and attends back `sliding_window` positions, to
    num_prefill_tokens - sliding_window + 1 (the engine's SlidingWindowTables.first_needed_page)."""
    return max(0, num_prefill_tokens - sliding_window + 1) // page_size
