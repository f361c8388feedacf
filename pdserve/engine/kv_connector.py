"""The seam between the engine and a KV transfer, split by role (DESIGN §2, D3-D7, D12).

The engine owns its KV memory and knows nothing of how KV moves between nodes. A node that moves
KV hands the engine one connector when it builds it:

    engine = LLMEngine(config, kv_connector=sender)     # a PrefillConnector (prefill nodes)
    engine = LLMEngine(config, kv_connector=receiver)   # a DecodeConnector (decode nodes)

and the engine calls it at fixed points of its life and of each `step()`:

    register_kv_cache(KvCacheSpec)   once, in the engine's constructor, as soon as the pool exists
                                     (the connector registers the memory with its transport and
                                     may refuse a cache it cannot move by raising ValueError: the
                                     engine is then not built)
    PrefillConnector
      on_schedule(SchedulerOutput, block_ids)
                                     before each forward pass runs: which chunks it computes,
                                     and the pages each of their requests holds in every
                                     attention group (E8: a hybrid model's sliding layers keep
                                     their KV in a table of their own)
      on_layer_done(layer)           after each layer's attention output projection (D7)
      on_prefill_done(PrefillDone)   after the pass that completes a prefill-only request, with
                                     the hidden state and logits of its last position (D12)
    DecodeConnector
      on_kv_wait(KvWait)             a remote-prefill request got its pages and now waits for
                                     its KV (D3); the engine schedules it only after its KvLanded
    both
      kv_events() -> Iterator[KvEvent]
                                     at the start of every step and at every idle tick of the
                                     engine thread: the transfer's completions since the last
                                     call, in order. The engine applies each event before it
                                     takes the next, so a connector may read the engine between
                                     them (e.g. `quarantined_blocks`)

The way back is typed events, never calls into the engine: a connector gives the engine
    KvLanded      every write of a request's KV landed: it decodes next (its first step may verify
                  drafts from the prefill node's hidden state); one that ended meanwhile has its
                  held pages freed
    KvFailed      its remote prefill failed and no write can land in its pages: it is admitted
                  again into fresh pages (RETRY), computed here (PREFILL_LOCALLY) or ended with the
                  error (END); pages it no longer needs are freed
    KvQuarantined its remote prefill failed and writes may still land: its pages move into a
                  quarantine under the connector's hold id (owned by nobody), and it goes on in
                  fresh pages (RETRY) or ends (END)
    KvReleased    no transfer touches these pages any more: a held request's (a prefill node's
                  source pages once its transfer ended) or a quarantine's; freed
An event naming a request the engine no longer has is applied to what is left of it (its held
pages) and is otherwise a no-op, so a connector never needs to know the engine's state exactly.
The engine keeps those pages in its cache manager's holds (pdserve.engine.cache.holds).

Threads: every method runs on the thread that drives the engine (the caller of `LLMEngine.step`,
which is `EngineThread`'s thread in servers), except `register_kv_cache`, which runs on the thread
that constructs the engine. They must not block: they record, notify another thread and return.
Whatever they start on other threads comes back as events, queued by the connector and handed over
by `kv_events` (the connector's owner wakes an idle engine thread: `EngineThread.wake`).

The KV-head split (`shard_kv_heads`, written once in pdserve/model/tp.py) is part of this seam: the
spec carries this engine's split (`KvShardPool.kv_heads`), and a connector applies the same rule to
a peer's tensor-parallel size, which this engine never sees (kv_messenger's shard plan: a transfer
between nodes of different TP sizes, docs/tp-shard-mismatch.md). It is re-exported here because the
layering lets a connector import the engine, not the model. A pure function: any thread.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from pdserve.engine.cache.kv_cache import KVCacheShape
from pdserve.engine.scheduler.output import SchedulerOutput
from pdserve.model.tp import shard_kv_heads

__all__ = [
    "AttentionGroupSpec",
    "DecodeConnector",
    "KvCacheSpec",
    "KvConnector",
    "KvEvent",
    "KvFailed",
    "KvFailure",
    "KvLanded",
    "KvQuarantined",
    "KvReleased",
    "KvShardPool",
    "KvWait",
    "PrefillConnector",
    "PrefillDone",
    "shard_kv_heads",
]


@dataclass(frozen=True)
class AttentionGroupSpec:
    """One block table of the cache (E8): the layers that share it and their window."""

    name: str                       # "full" or "sliding"
    layers: tuple[int, ...]         # decoder layers whose KV lives in this group's pages
    sliding_window: int | None      # tokens each layer attends back; None: the whole context


@dataclass(frozen=True)
class KvShardPool:
    """One tensor-parallel rank's KV pool, mapped in the leader's address space (D15)."""

    rank: int
    # buffer: [num_layers, 2, num_pages, len(kv_heads), page_size, head_dim]  (HND pages of this rank's heads)
    buffer: torch.Tensor
    kv_heads: tuple[int, ...]       # the global KV heads this rank holds: shard_kv_heads(total, tp)[rank]


@dataclass(frozen=True)
class KvCacheSpec:
    """The engine's KV pool as a connector sees it, given once the pool exists. Under tensor
    parallelism `buffer` / `shape` are rank 0's pool (its KV heads only) and `shards` lists every
    rank's pool, rank 0's first; at TP 1 `shards` is empty."""

    # buffer: [num_layers, 2, num_pages, kv_heads, page_size, head_dim]  (2 = K, V; HND pages)
    buffer: torch.Tensor
    shape: KVCacheShape
    dtype: torch.dtype
    groups: tuple[AttentionGroupSpec, ...]
    hidden_size: int                # width of the hidden state a prefill hands over (D12)
    model_name: str
    shards: tuple[KvShardPool, ...] = ()   # every TP rank's pool, in rank order; () at TP 1
    # hidden states of the positions before the handed-over one that a prefill also hands over
    # (a decode node's draft head writes its history from them, E20); EngineConfig.context_history_rows
    context_history_rows: int = 0

    @property
    def tp_size(self) -> int:
        return max(1, len(self.shards))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclass(frozen=True)
class PrefillDone:
    """A prefill-only request's last computed position (D12, D17)."""

    request_id: str
    block_ids: tuple[int, ...]      # its pages in the "full" group, in token order
    # hidden: [hidden_size], the final norm's output at that position; or [n + 1, hidden_size] with
    # the n positions before it first (KvCacheSpec.context_history_rows, n fewer for a short prompt)
    hidden: torch.Tensor
    logits: torch.Tensor            # logits: [vocab]


@dataclass(frozen=True)
class KvWait:
    """A remote-prefill request whose pages are allocated (non-evictable until it ends, D3)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]      # its pages in the "full" group, in token order
    # every attention group's table (KvCacheSpec.groups order, the "full" one included), token order
    tables: tuple[tuple[int, ...], ...] = ()


class KvFailure(enum.Enum):
    """What becomes of a request waiting for its KV whose remote prefill failed."""

    RETRY = "retry"                        # admitted again into fresh pages: a new KvWait, a new attempt
    PREFILL_LOCALLY = "prefill_locally"    # its prompt is computed here, in the pages it holds (S3)
    END = "end"                            # it ends with the error (FinishReason.ERROR)


@dataclass(frozen=True)
class KvLanded:
    """Every write of the request's KV landed (and was verified, S7): schedule its first decode;
    its complete prompt blocks join the prefix cache. If it ended meanwhile, its held pages go."""

    request_id: str
    # context_hidden: [hidden], the prefill node's final-norm state of the position before the last
    # prompt token (D12/D17); a draft head starts from it. None: not shipped or not wanted.
    context_hidden: torch.Tensor | None = None
    # context_history: [n, hidden], the states of the n positions before that one (E20)
    context_history: torch.Tensor | None = None


@dataclass(frozen=True)
class KvFailed:
    """The request's remote prefill failed and no write can land in its pages any more."""

    request_id: str
    then: KvFailure
    error: str


@dataclass(frozen=True)
class KvQuarantined:
    """The request's remote prefill failed while writes may still land in its pages: they move
    into quarantine `hold_id` (until a KvReleased names it), and the request goes on in fresh
    pages (RETRY) or ends (END). A request that holds no pages any more makes no quarantine."""

    request_id: str
    hold_id: str
    then: KvFailure
    error: str

    def __post_init__(self) -> None:
        if self.then is KvFailure.PREFILL_LOCALLY:
            raise ValueError(f"request {self.request_id}: a quarantined attempt cannot prefill locally in "
                             f"its pages (writes may still land there): RETRY or END")


@dataclass(frozen=True)
class KvReleased:
    """No transfer reads or writes these pages any more: free them. Exactly one of `request_id`
    (a finished request's held pages; a PREFILL request still running is not held when it ends)
    or `hold_id` (a quarantine)."""

    request_id: str | None = None
    hold_id: str | None = None

    def __post_init__(self) -> None:
        if (self.request_id is None) == (self.hold_id is None):
            raise ValueError(f"KvReleased names exactly one of request_id or hold_id, got "
                             f"request_id={self.request_id!r}, hold_id={self.hold_id!r}")


KvEvent = KvLanded | KvFailed | KvQuarantined | KvReleased


class KvConnector(abc.ABC):
    """What both roles share: the engine hands over its KV pool once, and takes the transfer's
    completions as events at every step."""

    @abc.abstractmethod
    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        """Constructing thread, once: the pool exists; register it, or raise ValueError naming why
        this cache cannot be moved (the engine's construction then fails with it)."""

    def kv_events(self) -> Iterator[KvEvent]:
        """Engine thread, at the start of every step and at every idle tick: the completions queued
        since the last call, in order (the engine applies each before taking the next). None by
        default."""
        return iter(())


class PrefillConnector(KvConnector):
    """Prefill side: sees every pass before it runs, each finished layer, each finished prefill."""

    @abc.abstractmethod
    def on_schedule(self, sched: SchedulerOutput, block_ids: Mapping[str, tuple[tuple[int, ...], ...]]) -> None:
        """Engine thread, before the forward pass of `sched` runs (D6). block_ids: the pages of
        every request with a chunk in the pass, by request id: one table per attention group
        (KvCacheSpec.groups order; a full-attention model has the one), each in token order."""

    @abc.abstractmethod
    def on_layer_done(self, layer: int) -> None:
        """Engine thread, during the pass: layer `layer` (0-based) has written its KV (D7)."""

    @abc.abstractmethod
    def on_prefill_done(self, done: PrefillDone) -> None:
        """Engine thread, after the pass that computed a prefill-only request's last chunk (D12);
        the request finishes (PREFILLED) right after, its pages held until a KvReleased names it."""


class DecodeConnector(KvConnector):
    """Decode side: learns which requests wait for KV and where it must land."""

    @abc.abstractmethod
    def on_kv_wait(self, wait: KvWait) -> None:
        """Engine thread, in the step that admitted the request (D3). Its KvLanded (or KvFailed,
        KvQuarantined) comes back through `kv_events`."""
