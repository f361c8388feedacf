"""Transfer arithmetic, written once: where each page lives in bytes, which writes a prefill
makes, and how many immediate-data writes the decode side must count (D10, D13, D14).

The KV buffer of a node is `[layers, 2 (K, V), pages, kv_heads, page_size, head_dim]` (HND), so a
page of one layer and side is one contiguous run of `kv_heads * page_size * head_dim` elements,
and a rank's shard of it (a range of kv heads) is contiguous too.

Equal sharding on both sides (the only scheme so far) maps rank r to rank r and every page to one
write per layer and side. Mismatched tensor-parallel sizes (D14) slot in here: `expected_writes`
and `page_writes` are the two functions that change.

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

import numpy as np

from pdserve.engine.kv_connector import KvCacheSpec

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KvLayout:
    """Geometry of one node's registered KV buffer (and how to address bytes in it)."""

    num_layers: int
    num_pages: int
    kv_heads: int
    page_size: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "kv_heads", "page_size", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"KvLayout.{name} must be an integer >= 1, got {v!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KvLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")

    @property
    def page_nbytes(self) -> int:
        return self.kv_heads * self.page_size * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.num_layers * 2 * self.num_pages * self.page_nbytes

    def page_offsets(self, layer: int, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of K and V of `pages` (int array) in `layer`: two uint64 arrays."""
        base_k = (layer * 2 + 0) * self.num_pages * self.page_nbytes
        base_v = (layer * 2 + 1) * self.num_pages * self.page_nbytes
        p = pages.astype(np.uint64) * np.uint64(self.page_nbytes)
        return p + np.uint64(base_k), p + np.uint64(base_v)

    def compatible_with(self, other: "KvLayout") -> None:
        """Raise ValueError naming the mismatch if pages of `other` cannot be copied 1:1 into ours."""
        for name in ("num_layers", "kv_heads", "page_size", "head_dim", "dtype"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise ValueError(f"KV layouts differ in {name}: {a!r} here vs {b!r} on the peer")


@dataclass(frozen=True)
class ShardingScheme:
    """A node's tensor-parallel split of the KV heads."""

    tp_size: int = 1
    kv_heads_per_rank: int = 0  # 0: all heads on every rank (tp_size 1)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")


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
    """Immediate-data units (page writes) the decode side counts for one request.

    Equal sharding: pages x layers x (K, V) + the context write(s). Coalesced writes carry
    several units, so this is also the number of entries the sender hands the fabric.
    """
    if prefill_sharding.tp_size != decode_sharding.tp_size:
        raise ValueError(
            f"tensor-parallel shard mismatch (prefill tp={prefill_sharding.tp_size}, "
            f"decode tp={decode_sharding.tp_size}) is not supported yet"
        )
    pages = num_prompt_pages(num_prefill_tokens, layout.page_size)
    return pages * layout.num_layers * 2 + context_writes


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
    """Raise UnsupportedModelError unless every layer of the model keeps its KV in the one "full"
    attention group.

    The messenger sends the pages of the "full" group's block table only, at the same block ids
    in every layer. A sliding-window or hybrid model (Gemma 3: "full" and "sliding" groups, E8)
    keeps its sliding layers' KV in another table with other block ids, so a prefill/decode pair
    would silently decode over KV that never arrived. Until the messenger sends every group's
    pages, such models run colocated only.
    """
    if [g.name for g in spec.groups] == ["full"]:
        return
    described = []
    for g in spec.groups:
        window = "" if g.sliding_window is None else f", window {g.sliding_window} tokens"
        noun = "layer" if len(g.layers) == 1 else "layers"
        described.append(f"{g.name!r} ({len(g.layers)} {noun}: {list(g.layers)}{window})")
    raise UnsupportedModelError(
        f"model {spec.model_name!r} cannot be served by prefill/decode nodes: its KV cache has attention "
        f"groups {', '.join(described)}, but the KV messenger transfers only the 'full' group's pages, so the "
        f"sliding-window layers' KV would never reach the decode node (wrong output, no error). Sliding-window "
        f"and hybrid models are not supported in disaggregated mode yet; serve this model colocated "
        f"(decode node --colocated, pdserve up --colocated N)")
