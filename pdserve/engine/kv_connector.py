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
                                     its KV (D3); the engine schedules it only after `kv_ready`

Threads: every method runs on the thread that drives the engine (the caller of `LLMEngine.step`,
which is `EngineThread`'s thread in servers), except `register_kv_cache`, which runs on the thread
that constructs the engine. They must not block: they record, notify another thread and return.
Whatever they start on other threads reports back through the engine's own calls (`kv_ready`,
`kv_abandoned`, `release_blocks`), which the connector's owner runs on the engine thread.

The KV-head split (`shard_kv_heads`, written once in pdserve/model/tp.py) is part of this seam: the
spec carries this engine's split (`KvShardPool.kv_heads`), and a connector applies the same rule to
a peer's tensor-parallel size, which this engine never sees (kv_messenger's shard plan: a transfer
between nodes of different TP sizes, docs/tp-shard-mismatch.md). It is re-exported here because the
layering lets a connector import the engine, not the model. A pure function: any thread.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
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


class KvConnector(abc.ABC):
    """What both roles share: the engine hands over its KV pool once."""

    @abc.abstractmethod
    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        """Constructing thread, once: the pool exists; register it, or raise ValueError naming why
        this cache cannot be moved (the engine's construction then fails with it)."""


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
        the request finishes (PREFILLED) right after, its blocks held if it asked for that."""


class DecodeConnector(KvConnector):
    """Decode side: learns which requests wait for KV and where it must land."""

    @abc.abstractmethod
    def on_kv_wait(self, wait: KvWait) -> None:
        """Engine thread, in the step that admitted the request (D3)."""
