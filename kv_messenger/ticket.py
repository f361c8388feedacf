"""One request's transfer ticket: where its KV goes, and how it travels in the Prefill call.

The decode side makes a `TransferTicket` when a request's pages are allocated (KvReceiver.prepare)
and sends it to a prefill node inside a PrefillRequest (`to_pb`); the prefill node reads it back
(`TransferTicket.from_pb`) and hands it to its KvSender. Fabric descriptors travel as explicit
JSON (no pickle: a node never unpickles bytes from the network); malformed bytes raise ValueError
naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fabric import IMM_TAG_MAX, PeerDescriptor, RemoteDescriptor
from kv_messenger.plan import DTYPE_SIZES, KvLayout, ShardingScheme
from kv_messenger.shard_plan import KvShards, TpScheme
from pdserve_api.v1 import common_pb2, prefill_pb2


@dataclass(frozen=True)
class TransferKey:
    """What a prefill node keys one transfer by (D20): the decode node's fabric engine id, the
    decode node's request id, and the attempt (0, then +1 on every retry of the request)."""

    decode_engine_id: str
    request_id: str
    attempt: int

    def __post_init__(self) -> None:
        if not self.decode_engine_id or not self.request_id:
            raise ValueError(f"a transfer key needs a decode engine id and a request id, got {self!r}")
        if not 0 <= self.attempt < 1 << 32:
            raise ValueError(f"request {self.request_id}: attempt={self.attempt} outside 0..2**32-1")

    @property
    def engine_request_id(self) -> str:
        """The prefill engine's (and its KvSender's) id for this transfer: unique per key."""
        return f"{self.request_id}#{self.attempt}@{self.decode_engine_id}"


@dataclass(frozen=True)
class GroupTarget:
    """A hybrid model's non-"full" attention group in a transfer (E8): its layers' KV lives in its
    own pages; request pages first_page, first_page + 1, ... go to `dst_pages` (a sliding group
    sends only the pages the decode side's first step reads: plan.window_first_page)."""

    name: str
    layers: tuple[int, ...]
    sliding_window: int | None
    first_page: int
    dst_pages: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.name != "sliding" or self.sliding_window is None or self.sliding_window < 1:
            raise ValueError(f"attention group {self.name!r} (window {self.sliding_window!r}): only a 'sliding' "
                             "group with a window >= 1 travels beside the 'full' one")
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.first_page < 0:
            raise ValueError(f"group {self.name!r}: layers {self.layers} must be ascending and distinct, "
                             f"first_page {self.first_page} >= 0")


@dataclass(frozen=True)
class TransferTicket:
    """Everything a prefill node needs to push one request's KV into a decode node's pages."""

    request_id: str
    kv: RemoteDescriptor           # the decode node's registered KV buffer (rank 0's under TP)
    layout: KvLayout               # its geometry; kv_heads is the model's total (each rank holds its share)
    dst_pages: tuple[int, ...]     # destination page ids, in token order
    context: RemoteDescriptor      # the decode node's context buffer
    context_offset: int            # byte offset of this request's slot in it
    imm_tag: int                   # names the request in every write's immediate data
    expected_writes: int           # immediate-data units the decode side counts (plan.expected_writes)
    num_prefill_tokens: int        # prompt tokens minus the last (D17)
    sharding: ShardingScheme = ShardingScheme()
    attempt: int = 0               # which attempt at the request (D20: part of the prefill side's key)
    kv_checksum: bool = False      # S7: the sender hashes every run it writes (PrefillResponse.kv_checksums)
    # Under decode TP (sharding.tp_size > 1): every decode rank's registered KV pool, in rank order
    # (kv_ranks[0] == kv); each holds its ranks' heads (`decode_shards.rank_layout(r)`). () at TP 1.
    # Each names its own endpoint (RemoteDescriptor.peer): the rail of its rank's NIC (D16,
    # kv_messenger.pool), the same engine as `kv`'s; one NIC: all the same endpoint, as before rails.
    kv_ranks: tuple[RemoteDescriptor, ...] = ()
    # A hybrid model's other attention groups; `dst_pages` are then the "full" group's, written in
    # the layers no group here lists. () for a model whose layers are all full attention.
    groups: tuple[GroupTarget, ...] = ()

    def __post_init__(self) -> None:
        n = self.sharding.tp_size
        if n > 1 and (len(self.kv_ranks) != n or self.kv_ranks[0] != self.kv):
            raise ValueError(f"request {self.request_id}: decode tp_size {n} needs {n} KV descriptors, rank 0's "
                             f"first; got {len(self.kv_ranks)}")
        if n == 1 and len(self.kv_ranks) > 1:
            raise ValueError(f"request {self.request_id}: {len(self.kv_ranks)} KV descriptors for decode tp_size 1")

    @property
    def decode_shards(self) -> KvShards:
        """The decode side of the transfer: its split of `layout` over its ranks (ValueError if none exists)."""
        return KvShards.of(self.layout, self.sharding.tp_size)

    def layer_pages(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per layer: (first request page sent, destination pages from there): the full group's
        pages from 0, or its group's window."""
        out: list[tuple[int, tuple[int, ...]]] = [(0, self.dst_pages)] * self.layout.num_layers
        for g in self.groups:
            for layer in g.layers:
                out[layer] = (g.first_page, g.dst_pages)
        return tuple(out)

    def rank_kv(self, rank: int) -> RemoteDescriptor:
        """Decode rank `rank`'s KV descriptor."""
        return self.kv_ranks[rank] if self.kv_ranks else self.kv

    def check_fits(self, layout: KvLayout) -> None:
        """Raise ValueError naming the value if a node with `layout` cannot write this ticket's pages."""
        self.layout.compatible_with(layout)
        rid, n = self.request_id, self.num_prefill_tokens
        pages = -(-n // layout.page_size)
        if len(self.dst_pages) != pages:
            raise ValueError(f"request {rid}: {len(self.dst_pages)} destination pages for {n} tokens "
                             f"(page size {layout.page_size} needs {pages})")
        out = [p for p in self.dst_pages if not 0 <= p < self.layout.num_pages]
        if out:
            raise ValueError(f"request {rid}: destination page ids outside [0, {self.layout.num_pages}): {out[:5]}")
        seen: set[int] = set()
        for g in self.groups:
            if g.first_page + len(g.dst_pages) != pages:
                raise ValueError(f"request {rid}: group {g.name!r} sends pages {g.first_page}.. "
                                 f"({len(g.dst_pages)} of them) of {pages}")
            bad = [p for p in g.dst_pages if not 0 <= p < self.layout.num_pages]
            if bad:
                raise ValueError(f"request {rid}: group {g.name!r} page ids outside [0, {self.layout.num_pages}): "
                                 f"{bad[:5]}")
            wrong = [la for la in g.layers if not 0 <= la < self.layout.num_layers or la in seen]
            if wrong:
                raise ValueError(f"request {rid}: group {g.name!r} layers {wrong[:5]} outside 0..."
                                 f"{self.layout.num_layers - 1} or listed twice")
            seen.update(g.layers)
        if not 0 <= self.imm_tag <= IMM_TAG_MAX:
            raise ValueError(f"request {rid}: imm_tag={self.imm_tag} outside 0..{IMM_TAG_MAX} (a tag has 24 "
                             f"bits: the low 8 bits of the immediate data count the pages a write holds)")

    def to_pb(self, token_ids: list[int], peer: PeerDescriptor, model: str = "",
              deadline_s: float | None = None) -> prefill_pb2.PrefillRequest:
        """The Prefill call for this ticket (token_ids: the prompt minus its last token; peer: the
        decode node's fabric endpoint)."""
        if self.expected_writes < 1:
            raise ValueError(f"request {self.request_id}: the ticket is not addressed to a prefill node yet "
                             "(KvReceiver.address sets its expected write count)")
        shards = self.decode_shards
        n = shards.scheme.tp_size
        req = prefill_pb2.PrefillRequest(
            request_id=self.request_id,
            token_ids=token_ids,
            peer=prefill_pb2.FabricPeer(provider=peer.provider, descriptor=peer_to_bytes(peer)),
            kv_memory=[prefill_pb2.KvMemory(tp_rank=r, descriptor=remote_to_bytes(self.rank_kv(r)),
                                            layout=layout_to_pb(shards.rank_layout(r))) for r in range(n)],
            page_ids=list(self.dst_pages),
            context=prefill_pb2.ContextSlot(descriptor=remote_to_bytes(self.context), offset=self.context_offset,
                                            capacity=0, logits_top_k=0),
            sharding=common_pb2.ShardingScheme(tp_size=n,
                                               kv_heads_per_rank=len(shards.scheme.rank_heads[0]),
                                               total_kv_heads=self.layout.kv_heads),
            imm_tag=self.imm_tag,
            expected_writes=self.expected_writes,
            model=model,
            attempt=self.attempt,
            kv_checksum=self.kv_checksum,
            group_pages=[prefill_pb2.GroupPages(name=g.name, layers=list(g.layers), sliding_window=g.sliding_window,
                                                first_page=g.first_page, page_ids=list(g.dst_pages))
                         for g in self.groups],
        )
        if deadline_s is not None:
            req.deadline_s = deadline_s
        return req

    @classmethod
    def from_pb(cls, req: prefill_pb2.PrefillRequest) -> TransferTicket:
        """The ticket inside a Prefill call; malformed input raises ValueError.

        Under decode TP, `kv_memory` holds one entry per decode rank (tp_rank 0 .. tp_size - 1, each
        once) whose layout holds exactly the heads the engine's rule gives that rank of
        `sharding.total_kv_heads` (a split off that head boundary is refused, naming the rank)."""
        rid = req.request_id
        if not req.token_ids:
            raise ValueError(f"request {rid}: no tokens to prefill")
        tp = (req.sharding.tp_size or 1) if req.HasField("sharding") else 1
        if not 1 <= tp <= 1024:
            raise ValueError(f"request {rid}: decode tp_size {tp} outside 1..1024")
        ranks = sorted(m.tp_rank for m in req.kv_memory)
        if ranks != list(range(tp)):
            raise ValueError(f"request {rid}: decode tp_size {tp} needs one KV memory descriptor per rank "
                             f"0..{tp - 1}, got ranks {ranks[:8]}")
        mems = sorted(req.kv_memory, key=lambda m: m.tp_rank)
        rank_layouts = [layout_from_pb(m.layout) for m in mems]
        if tp == 1:
            layout = rank_layouts[0]
        else:
            total = req.sharding.total_kv_heads
            if total < 1:
                raise ValueError(f"request {rid}: decode tp_size {tp} without total_kv_heads")
            layout = KvShards.from_rank_layouts(TpScheme.split(total, tp), rank_layouts).layout
        descriptors = tuple(remote_from_bytes(m.descriptor) for m in mems)
        return cls(
            request_id=rid,
            kv=descriptors[0],
            layout=layout,
            dst_pages=tuple(req.page_ids),
            context=remote_from_bytes(req.context.descriptor),
            context_offset=req.context.offset,
            imm_tag=req.imm_tag,
            expected_writes=req.expected_writes,
            num_prefill_tokens=len(req.token_ids),
            sharding=ShardingScheme(tp_size=tp),
            attempt=req.attempt,
            kv_checksum=req.kv_checksum,
            kv_ranks=descriptors if tp > 1 else (),
            groups=tuple(GroupTarget(g.name, tuple(g.layers), g.sliding_window or None, g.first_page,
                                     tuple(g.page_ids)) for g in req.group_pages),
        )


# --- fabric descriptors and the KV layout on the wire -------------------------------------------

def peer_to_bytes(peer: PeerDescriptor) -> bytes:
    return json.dumps({
        "provider": peer.provider, "address": peer.address.hex(), "engine_id": peer.engine_id,
        "host_id": peer.host_id, "pid": peer.pid, "start_time": peer.start_time,
    }).encode()


def peer_from_bytes(raw: bytes) -> PeerDescriptor:
    try:
        d = json.loads(raw)
        return PeerDescriptor(provider=str(d["provider"]), address=bytes.fromhex(d["address"]),
                              engine_id=str(d["engine_id"]), host_id=str(d["host_id"]),
                              pid=int(d["pid"]), start_time=int(d["start_time"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"malformed fabric peer descriptor: {e}") from e


def remote_to_bytes(desc: RemoteDescriptor) -> bytes:
    return json.dumps({
        "peer": peer_to_bytes(desc.peer).decode(), "region_id": desc.region_id, "base": desc.base,
        "key": desc.key, "length": desc.length,
    }).encode()


def remote_from_bytes(raw: bytes) -> RemoteDescriptor:
    try:
        d = json.loads(raw)
        return RemoteDescriptor(peer=peer_from_bytes(d["peer"].encode()), region_id=int(d["region_id"]),
                                base=int(d["base"]), key=int(d["key"]), length=int(d["length"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"malformed fabric memory descriptor: {e}") from e


def layout_to_pb(layout: KvLayout) -> prefill_pb2.KvLayout:
    elem = DTYPE_SIZES[layout.dtype]
    token = layout.head_dim * elem
    head = layout.page_size * token
    page = layout.kv_heads * head
    kv = layout.num_pages * page
    return prefill_pb2.KvLayout(
        num_layers=layout.num_layers, num_pages=layout.num_pages, kv_heads=layout.kv_heads,
        page_size=layout.page_size, head_dim=layout.head_dim, dtype=layout.dtype, element_size=elem,
        base_offset=0, layer_stride=2 * kv, kv_stride=kv, page_stride=page, head_stride=head, token_stride=token,
    )


def layout_from_pb(m: prefill_pb2.KvLayout) -> KvLayout:
    layout = KvLayout(m.num_layers, m.num_pages, m.kv_heads, m.page_size, m.head_dim, m.dtype)
    if layout_to_pb(layout) != m:
        raise ValueError("KV layout strides are not the HND layout this node writes "
                         f"(got page_stride={m.page_stride}, expected {layout.page_nbytes})")
    return layout
