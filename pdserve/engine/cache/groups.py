"""Attention groups: layers of one attention kind share one block table per request (E8).

A full-attention model has the one group "full". A sliding-window model ("sliding" only) or a
hybrid one ("full" and "sliding", e.g. Gemma-3) gets one `GroupTables` per kind, all drawing
block ids from the same `BlockPool`; a block a group holds is used by that group's layers only.

Tables use logical indexing: entry i covers positions [i*P, (i+1)*P). Full tables hold a real
block at every entry; sliding tables point entries that left the window at the padding block.

`GroupTables` only keeps tables and says what a chunk needs (`plan`); the `KVCacheManager` takes
the blocks from the pool for every group at once, or none (E10).

Threading: owned by the engine thread.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

PADDING_BLOCK = 0  # block id that padded or recycled table entries point at (never handed out)


@dataclass(frozen=True)
class AttentionGroup:
    """name: "full" or "sliding"; sliding_window: W tokens (a query at position p attends to
    positions > p - W), None for full attention."""

    name: str
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.name == "full" and self.sliding_window is not None:
            raise ValueError(f"the full group has no sliding window, got sliding_window={self.sliding_window}")
        if self.name == "sliding" and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"the sliding group needs a window >= 1 token, got {self.sliding_window!r}")
        if self.name not in ("full", "sliding"):
            raise ValueError(f"attention group must be 'full' or 'sliding', got {self.name!r}")


FULL = AttentionGroup("full")


@dataclass(frozen=True)
class GrowthPlan:
    """What one group needs before a chunk runs: new entries at the end of the table, and
    entries that left the window (their blocks go back to the pool first)."""

    num_new: int
    recycle: tuple[int, ...] = ()  # logical indices

    @property
    def net_blocks(self) -> int:
        return self.num_new - len(self.recycle)


class GroupTables(abc.ABC):
    def __init__(self, group: AttentionGroup, page_size: int) -> None:
        self.group = group
        self.page_size = page_size
        self.tables: dict[str, list[int]] = {}

    @property
    def name(self) -> str:
        return self.group.name

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @abc.abstractmethod
    def plan(self, request_id: str, start: int, end: int, keep_all: bool) -> GrowthPlan:
        """What positions [start, end) need (written now, or read by this chunk's queries)."""

    def apply(self, request_id: str, plan: GrowthPlan, new_blocks: list[int]) -> list[int]:
        """Point recycled entries at the padding block and append new blocks; returns the
        recycled block ids (the caller frees them)."""
        if len(new_blocks) != plan.num_new:
            raise ValueError(f"group {self.name}: plan wants {plan.num_new} blocks, got {len(new_blocks)}")
        table = self.tables.setdefault(request_id, [])
        recycled = [table[i] for i in plan.recycle]
        for i in plan.recycle:
            table[i] = PADDING_BLOCK
        table.extend(new_blocks)
        return recycled

    def real_blocks(self, request_id: str) -> list[int]:
        """The request's blocks in table order (padding entries skipped)."""
        return [b for b in self.tables.get(request_id, ()) if b != PADDING_BLOCK]

    def replace(self, request_id: str, table: list[int]) -> None:
        """Install a table (a request coming back from the swap pool)."""
        if request_id in self.tables:
            raise ValueError(f"group {self.name}: request {request_id!r} already has a table")
        self.tables[request_id] = table

    def pop(self, request_id: str) -> list[int]:
        """Forget the request's table; returns its real blocks, head first."""
        table = self.tables.pop(request_id, [])
        return [b for b in table if b != PADDING_BLOCK]


class FullAttentionTables(GroupTables):
    """Every position keeps its page until the request ends."""

    def plan(self, request_id: str, start: int, end: int, keep_all: bool) -> GrowthPlan:
        return GrowthPlan(num_new=max(0, self.pages_for(end) - len(self.table(request_id))))


def group_max_blocks(group: AttentionGroup, page_size: int, num_tokens: int, max_chunk: int) -> int:
    """Blocks one request of num_tokens tokens holds at most in `group`: every page for full
    attention; for a sliding window W, the pages of W - 1 + max_chunk positions (sliding.py)."""
    pages = -(-num_tokens // page_size)
    if group.sliding_window is None:
        return pages
    return min(pages, -(-(group.sliding_window - 1 + max_chunk) // page_size) + 1)


def max_blocks_per_request(groups: tuple[AttentionGroup, ...], page_size: int, num_tokens: int, max_chunk: int) -> int:
    """Blocks one request of num_tokens tokens holds at most, over every group."""
    return sum(group_max_blocks(g, page_size, num_tokens, max_chunk) for g in groups)


def attention_groups(layer_types: tuple[str, ...] | list[str] | None,
                     sliding_window: int | None) -> tuple[AttentionGroup, ...]:
    """The groups a model's layers need, from Hugging Face `layer_types` ("full_attention" /
    "sliding_attention" per layer): ("full",), ("sliding",) or ("full", "sliding")."""
    if not layer_types:
        return (FULL,)
    kinds = set(layer_types)
    unknown = kinds - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unknown layer types {sorted(unknown)}; expected 'full_attention' or 'sliding_attention'")
    groups: list[AttentionGroup] = []
    if "full_attention" in kinds:
        groups.append(FULL)
    if "sliding_attention" in kinds:
        if sliding_window is None:
            raise ValueError("the model has sliding_attention layers but no sliding_window")
        groups.append(AttentionGroup("sliding", sliding_window))
    return tuple(groups)
