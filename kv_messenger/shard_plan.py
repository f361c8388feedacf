"""The tensor-parallel shard plan (D13, D14): which contiguous byte runs of a page go from which
prefill rank to which decode rank. One pure function (`plan_transfer`) serves the sender (what to
write), the receiver (what to count: `ShardPlan.expected_writes`, the same numbers without a
plan: `expected_page_writes`) and the compatibility check (`check_compatible`), so the three can
never disagree.

Head assignment: `TpScheme.split` applies THE engine's rule (`shard_kv_heads`, written once in
pdserve/model/tp.py, reached through the engine's connector seam pdserve.engine.kv_connector, as
the layering forbids this room the model) to either side's tensor-parallel size: the prefill node
applies it to the decode node's TP size and the decode node to the prefill node's, so both sides
plan with the split the other's engine really made. In short, K KV heads on N ranks: contiguous
whole GQA groups, the first K % N ranks holding one more; replica sets when N > K and N % K == 0
(rank r holds head r // (N / K)); anything else refused. How nodes of different TP sizes pair
(this plan, the write counts, the refusals): docs/tp-shard-mismatch.md.

Geometry: a node's KV buffer is `[layers, 2 (K, V), pages, kv_heads, page_size, head_dim]` (HND,
`KvLayout`) on every rank, with that rank's heads in ascending order, so one page of one layer and
side on rank r is `[len(heads_r), page_size, head_dim]` and every run of consecutive heads is one
contiguous byte range at `(h - first_head_r) * head_nbytes`. Every rank of a side has the same
number of pages (one block table drives them all); a request's page i sits at the same page id on
every rank of its side.

The plan, per page (the same for every page, layer and side of a request): for each destination
rank, its heads are cut into segments of consecutive heads held by exactly the same set of source
ranks; each segment is one write, from one source rank of that set chosen at random per request
(`random.Random` argument: a load spread that tests can reproduce). So:
- equal schemes: one write per rank and page, rank r -> rank r (1:1);
- prefill TP > decode TP: each prefill rank writes its slice at its offset inside the decode page;
- decode TP > prefill TP: each decode rank receives its slice from the prefill rank holding it;
- source replicas: one replica writes, chosen at random; destination replicas: every one receives.
The number of writes depends on the segments only, never on the random choice, so the decode side
counts without knowing the choice. Never one write per head or per token (D13): a segment is as
long as the source and destination holdings allow.

How each side uses it (both know both schemes: the ticket carries the decode side's, the node
info the prefill side's):
- sender, per request: `plan = plan_transfer(src, dst, rng)`; per finished layer,
  `plan.layer_writes(layer, src_pages, dst_pages)` gives one `RankWrites` per (prefill rank,
  decode rank) pair: one `TransferEngine.write` call from that prefill rank's registered pool to that decode
  rank's descriptor (D15: one messenger holds every rank's registration).
- receiver: `expected_page_writes(src, dst, pages).total` is its ImmCounter target (`per_rank`
  splits it; the context write counts on rank 0, the leader).
- checksums (S7): `plan.layer_entries(...)` lists the same entries in a canonical order that does
  not depend on the replica choice, so source-side and destination-side hashes compare by index.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pdserve.engine.kv_connector import shard_kv_heads

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KvLayout:
    """Geometry of one node's registered KV buffer (and how to address bytes in it).

    For a tensor-parallel side (`KvShards`), `kv_heads` is the model's total; each rank's own buffer
    is `KvShards.rank_layout(r)` (the same geometry with that rank's head count)."""

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
    def head_nbytes(self) -> int:
        """Bytes of one head in one page: [page_size, head_dim] elements."""
        return self.page_size * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def page_nbytes(self) -> int:
        return self.kv_heads * self.head_nbytes

    @property
    def nbytes(self) -> int:
        return self.num_layers * 2 * self.num_pages * self.page_nbytes

    def page_offsets(self, layer: int, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of K and V of `pages` (int array) in `layer`: two uint64 arrays."""
        base_k = (layer * 2 + 0) * self.num_pages * self.page_nbytes
        base_v = (layer * 2 + 1) * self.num_pages * self.page_nbytes
        p = pages.astype(np.uint64) * np.uint64(self.page_nbytes)
        return p + np.uint64(base_k), p + np.uint64(base_v)

    def compatible_with(self, other: KvLayout) -> None:
        """Raise ValueError naming the mismatch if pages of `other` cannot be copied 1:1 into ours."""
        for name in ("num_layers", "kv_heads", "page_size", "head_dim", "dtype"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise ValueError(f"KV layouts differ in {name}: {a!r} here vs {b!r} on the peer")


# --- head assignment (the rule is the engine's `shard_kv_heads`; a scheme is its answer) ---------

@dataclass(frozen=True)
class TpScheme:
    """A side's tensor-parallel split of the KV heads: which global heads each rank holds."""

    tp_size: int
    num_kv_heads: int
    rank_heads: tuple[tuple[int, ...], ...]   # [tp_size] ascending, contiguous global head ids

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.num_kv_heads < 1:
            raise ValueError(f"TpScheme needs tp_size >= 1 and num_kv_heads >= 1, got {self.tp_size}, "
                             f"{self.num_kv_heads}")
        if len(self.rank_heads) != self.tp_size:
            raise ValueError(f"TpScheme: {len(self.rank_heads)} head lists for tp_size {self.tp_size}")
        for r, heads in enumerate(self.rank_heads):
            if not heads or list(heads) != list(range(heads[0], heads[0] + len(heads))):
                raise ValueError(f"TpScheme: rank {r} heads {heads} are not a non-empty ascending contiguous run")
            if heads[0] < 0 or heads[-1] >= self.num_kv_heads:
                raise ValueError(f"TpScheme: rank {r} heads {heads} outside 0..{self.num_kv_heads - 1}")
        missing = set(range(self.num_kv_heads)) - {h for heads in self.rank_heads for h in heads}
        if missing:
            raise ValueError(f"TpScheme: KV heads {sorted(missing)} are held by no rank")

    @classmethod
    def split(cls, num_kv_heads: int, tp_size: int) -> TpScheme:
        """The split an engine of `tp_size` ranks makes: `shard_kv_heads`, the engine's own rule."""
        return cls(tp_size, num_kv_heads, shard_kv_heads(num_kv_heads, tp_size))

    @property
    def replica_sets(self) -> tuple[tuple[int, ...], ...]:
        """[num_kv_heads]: the ranks holding each global head (more than one: replicas)."""
        return tuple(tuple(r for r, heads in enumerate(self.rank_heads) if h in heads)
                     for h in range(self.num_kv_heads))

    def describe(self) -> str:
        return f"tp {self.tp_size}, {self.num_kv_heads} KV heads as {list(self.rank_heads)}"


@dataclass(frozen=True)
class KvShards:
    """One side of a transfer: its scheme and the geometry every rank's pool shares
    (`layout.kv_heads` is the total; rank r's buffer is `rank_layout(r)`)."""

    scheme: TpScheme
    layout: KvLayout

    def __post_init__(self) -> None:
        if self.layout.kv_heads != self.scheme.num_kv_heads:
            raise ValueError(f"KvShards: layout has {self.layout.kv_heads} KV heads, scheme "
                             f"{self.scheme.num_kv_heads}")

    @classmethod
    def of(cls, layout: KvLayout, tp_size: int = 1) -> KvShards:
        """The engine's split of `layout` (total heads) over `tp_size` ranks."""
        return cls(TpScheme.split(layout.kv_heads, tp_size), layout)

    @classmethod
    def from_rank_layouts(cls, scheme: TpScheme, rank_layouts: tuple[KvLayout, ...] | list[KvLayout]) -> KvShards:
        """A side as its ranks announce their own buffers: each must hold exactly its scheme's heads, with
        one shared geometry; ValueError naming the rank otherwise (a split off the head boundary)."""
        if len(rank_layouts) != scheme.tp_size:
            raise ValueError(f"{len(rank_layouts)} rank layouts for {scheme.describe()}")
        first = rank_layouts[0]
        for r, lay in enumerate(rank_layouts):
            if lay.kv_heads != len(scheme.rank_heads[r]):
                raise ValueError(f"rank {r}'s buffer holds {lay.kv_heads} KV heads ({lay.page_nbytes} bytes a page) "
                                 f"but {scheme.describe()} gives it {len(scheme.rank_heads[r])}: the split is "
                                 f"not at the scheme's head boundary")
            other = replace(lay, kv_heads=first.kv_heads)
            if other != first:
                raise ValueError(f"rank {r}'s geometry {lay} differs from rank 0's {first} beyond its head count")
        return cls(scheme, replace(first, kv_heads=scheme.num_kv_heads))

    def rank_layout(self, rank: int) -> KvLayout:
        return replace(self.layout, kv_heads=len(self.scheme.rank_heads[rank]))

    def describe(self) -> str:
        g = self.layout
        return (f"{self.scheme.describe()}, {g.num_layers} layers, page_size {g.page_size}, "
                f"head_dim {g.head_dim}, {g.dtype}")


# --- the plan ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardRun:
    """One write of every page (of one layer and side): `length` bytes at `src_offset` within the
    source rank's page to `dst_offset` within the destination rank's page; global heads `heads`."""

    src_rank: int
    src_offset: int
    dst_rank: int
    dst_offset: int
    length: int
    heads: tuple[int, ...]


@dataclass(frozen=True)
class ExpectedWrites:
    """Immediate-data units (page writes) a decode side counts for one request."""

    per_rank: tuple[int, ...]   # [decode tp_size]; the context write(s) are counted on rank 0 (the leader)
    total: int


@dataclass(frozen=True)
class LayerEntries:
    """Every entry of one layer in the canonical order (run by run as `ShardPlan.runs` lists them, K
    pages then V pages), which does not depend on the random replica choice: entry i is the same
    destination bytes on every plan of the request. The sender hashes entry i at its source, the
    receiver at its destination, and the two checksum arrays compare element by element (S7)."""

    src_ranks: np.ndarray     # [entries] int64
    src_offsets: np.ndarray   # [entries] uint64, within the source rank's own buffer
    dst_ranks: np.ndarray     # [entries] int64
    dst_offsets: np.ndarray   # [entries] uint64, within the destination rank's own buffer
    lengths: np.ndarray       # [entries] uint64


@dataclass(frozen=True)
class RankWrites:
    """One layer's entries from one source rank's buffer to one destination rank's buffer, in the
    arrays `TransferEngine.write` takes (PageWrites) (byte offsets within each rank's own buffer), in the
    canonical order (`LayerEntries`) restricted to this pair."""

    src_rank: int
    dst_rank: int
    src_offsets: np.ndarray   # [entries] uint64
    dst_offsets: np.ndarray   # [entries] uint64
    lengths: np.ndarray       # [entries] uint64


@dataclass(frozen=True)
class ShardPlan:
    """One request's plan: `runs` is the write list of every page, layer and side."""

    src: KvShards
    dst: KvShards
    runs: tuple[ShardRun, ...]

    def runs_to(self, dst_rank: int) -> int:
        return sum(1 for w in self.runs if w.dst_rank == dst_rank)

    def expected_writes(self, num_pages: int, context_writes: int = 1,
                        layer_pages: Sequence[int] | None = None) -> ExpectedWrites:
        """What the decode side counts for `num_pages` request pages in every layer (plus the context
        write(s)); `layer_pages`: the pages sent in each layer instead (a hybrid model's sliding
        layers send only their window's)."""
        per_page = tuple(self.runs_to(d) for d in range(self.dst.scheme.tp_size))
        return _expected(per_page, _page_layers(num_pages, self.dst.layout.num_layers, layer_pages), context_writes)

    def layer_entries(self, layer: int, src_pages: np.ndarray, dst_pages: np.ndarray) -> LayerEntries:
        """Every entry of `layer` for request pages held at `src_pages` on every source rank and
        `dst_pages` on every destination rank (equal-length int arrays), in the canonical order."""
        src_pages, dst_pages = np.asarray(src_pages), np.asarray(dst_pages)
        if src_pages.shape != dst_pages.shape or src_pages.ndim != 1:
            raise ValueError(f"source pages {src_pages.shape} and destination pages {dst_pages.shape} must be "
                             f"1-D and of one length")
        n = len(src_pages)
        sr, so, dr, do, ln = [], [], [], [], []
        for w in self.runs:
            sk, sv = self.src.rank_layout(w.src_rank).page_offsets(layer, src_pages)
            dk, dv = self.dst.rank_layout(w.dst_rank).page_offsets(layer, dst_pages)
            so += [sk + np.uint64(w.src_offset), sv + np.uint64(w.src_offset)]
            do += [dk + np.uint64(w.dst_offset), dv + np.uint64(w.dst_offset)]
            sr.append(np.full(2 * n, w.src_rank, dtype=np.int64))
            dr.append(np.full(2 * n, w.dst_rank, dtype=np.int64))
            ln.append(np.full(2 * n, w.length, dtype=np.uint64))
        return LayerEntries(np.concatenate(sr), np.concatenate(so), np.concatenate(dr), np.concatenate(do),
                            np.concatenate(ln))

    def entries(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> LayerEntries:
        """`layer_entries` of every layer, layer 0 first: a whole transfer's KV entries in the canonical
        order (S7: layer, run, K/V, page), which is also the order of its checksums."""
        return self.entries_by_layer([(src_pages, dst_pages)] * self.src.layout.num_layers)

    def entries_by_layer(self, pages: Sequence[tuple[np.ndarray, np.ndarray]]) -> LayerEntries:
        """`entries` where layer l sends `pages[l]` = (source pages, destination pages) (a hybrid
        model: each layer the pages of its attention group)."""
        if len(pages) != self.src.layout.num_layers:
            raise ValueError(f"{len(pages)} page lists for {self.src.layout.num_layers} layers")
        per_layer = [self.layer_entries(layer, np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64))
                     for layer, (s, d) in enumerate(pages)]
        return LayerEntries(*(np.concatenate([getattr(e, f) for e in per_layer])
                              for f in ("src_ranks", "src_offsets", "dst_ranks", "dst_offsets", "lengths")))

    def describe_entry(self, index: int, dst_pages, layer_pages: Sequence[Sequence[int]] | None = None) -> str:
        """Which bytes entry `index` of `entries` is: "layer 3 page 5 (id 812) V", plus the heads and
        ranks when a page travels in more than one run. `layer_pages`: each layer's destination
        pages, as given to `entries_by_layer` (default: `dst_pages` in every layer); the page index
        counts within its layer's list."""
        lists = [list(p) for p in layer_pages] if layer_pages is not None else \
            [list(dst_pages)] * self.src.layout.num_layers
        per_run = 2 * len(self.runs)
        layer, rest = 0, index
        while layer < len(lists) - 1 and rest >= per_run * len(lists[layer]):
            rest -= per_run * len(lists[layer])
            layer += 1
        ids = lists[layer]
        n = len(ids)
        run, rest = divmod(rest, 2 * n)
        side, page = divmod(rest, n)
        what = f"layer {layer} page {page} (id {ids[page]}) {'KV'[side]}"
        if len(self.runs) > 1 or self.src.scheme.tp_size > 1 or self.dst.scheme.tp_size > 1:
            w = self.runs[run]
            what += (f", KV heads {w.heads[0]}..{w.heads[-1]} from prefill rank {w.src_rank} to decode rank "
                     f"{w.dst_rank}")
        return what

    def layer_writes(self, layer: int, src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[RankWrites, ...]:
        """`layer_entries` grouped by (source rank, destination rank): one write_pages call each."""
        e = self.layer_entries(layer, src_pages, dst_pages)
        out = []
        for s, d in dict.fromkeys((w.src_rank, w.dst_rank) for w in self.runs):
            sel = (e.src_ranks == s) & (e.dst_ranks == d)
            out.append(RankWrites(s, d, e.src_offsets[sel], e.dst_offsets[sel], e.lengths[sel]))
        return tuple(out)


def _page_layers(num_pages: int, num_layers: int, layer_pages: Sequence[int] | None) -> int:
    """Pages summed over layers: num_pages in every layer, or `layer_pages` (one count per layer)."""
    if layer_pages is None:
        return num_pages * num_layers
    if len(layer_pages) != num_layers or any(p < 0 for p in layer_pages):
        raise ValueError(f"layer_pages needs one count >= 0 per layer ({num_layers}), got {list(layer_pages)}")
    return sum(layer_pages)


def _expected(per_page: tuple[int, ...], page_layers: int, context_writes: int) -> ExpectedWrites:
    per_rank = [n * page_layers * 2 for n in per_page]
    per_rank[0] += context_writes
    return ExpectedWrites(tuple(per_rank), sum(per_rank))


def check_compatible(src: KvShards, dst: KvShards) -> None:
    """Raise ValueError naming both sides unless pages of `src` can be planned into `dst`."""
    for name in ("num_layers", "page_size", "head_dim", "dtype", "kv_heads"):
        a, b = getattr(src.layout, name), getattr(dst.layout, name)
        if a != b:
            raise ValueError(f"KV layouts differ in {name} ({a!r} vs {b!r}): prefill side ({src.describe()}) cannot "
                             f"write into decode side ({dst.describe()})")


def _segments(src: KvShards, dst: KvShards) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(destination rank, its consecutive heads, the source ranks holding exactly those) for every
    destination rank; segments never depend on a random choice."""
    check_compatible(src, dst)
    holders = src.scheme.replica_sets
    segs = []
    for d, heads in enumerate(dst.scheme.rank_heads):
        start = 0
        for i in range(1, len(heads) + 1):
            if i == len(heads) or holders[heads[i]] != holders[heads[start]]:
                segs.append((d, heads[start:i], holders[heads[start]]))
                start = i
    return segs


def plan_transfer(src: KvShards, dst: KvShards, rng: random.Random) -> ShardPlan:
    """The plan of one request from prefill side `src` into decode side `dst`; `rng` picks the
    source replica of each segment (one draw per segment, in destination-rank order). ValueError
    naming both sides for layouts that cannot be planned, before any write exists."""
    hb = src.layout.head_nbytes
    runs = []
    for d, heads, sources in _segments(src, dst):
        s = sources[0] if len(sources) == 1 else rng.choice(sources)
        runs.append(ShardRun(src_rank=s, src_offset=(heads[0] - src.scheme.rank_heads[s][0]) * hb,
                             dst_rank=d, dst_offset=(heads[0] - dst.scheme.rank_heads[d][0]) * hb,
                             length=len(heads) * hb, heads=heads))
    return ShardPlan(src, dst, tuple(runs))


def expected_page_writes(src: KvShards, dst: KvShards, num_pages: int, context_writes: int = 1,
                         layer_pages: Sequence[int] | None = None) -> ExpectedWrites:
    """`plan_transfer(src, dst, any rng).expected_writes(num_pages, context_writes, layer_pages)`, with no plan."""
    per_page = [0] * dst.scheme.tp_size
    for d, _, _ in _segments(src, dst):
        per_page[d] += 1
    return _expected(tuple(per_page), _page_layers(num_pages, dst.layout.num_layers, layer_pages), context_writes)
