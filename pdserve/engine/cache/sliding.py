"""The sliding-window allocator (E8): a sliding layer keeps only the pages its window needs.

With window W and page size P, a chunk of positions [start, end) writes K/V at those positions,
and its earliest query (position start) reads positions > start - W. So before the chunk runs the
request needs real pages for logical indices

    lo = max(0, start - W + 1) // P   ...   ceil(end / P) - 1

and every real page below lo can go back to the pool: later chunks start later and never read
it again. Recycled entries point at the padding block, so the table keeps logical indexing.
One request holds at most ceil((W - 1 + chunk) / P) + 1 pages in this group, whatever its length.

Sliding blocks are never shared (no prefix cache, E12): their content is dropped as they leave
the window. A request whose pages a transfer may still read (prefill-only, `keep_all`) recycles
nothing until it ends.
"""

from __future__ import annotations

from pdserve.engine.cache.groups import PADDING_BLOCK, AttentionGroup, GroupTables, GrowthPlan


class SlidingWindowTables(GroupTables):
    def __init__(self, group: AttentionGroup, page_size: int) -> None:
        if group.sliding_window is None:
            raise ValueError(f"group {group.name!r} has no sliding window")
        super().__init__(group, page_size)
        self.window = group.sliding_window
        self._first_real: dict[str, int] = {}  # entries below it all point at the padding block

    def first_needed_page(self, start: int) -> int:
        """The lowest logical page the queries of a chunk starting at `start` read."""
        return max(0, start - self.window + 1) // self.page_size

    def plan(self, request_id: str, start: int, end: int, keep_all: bool) -> GrowthPlan:
        table = self.table(request_id)
        num_new = max(0, self.pages_for(end) - len(table))
        if keep_all:
            return GrowthPlan(num_new=num_new)
        first = self._first_real.get(request_id, 0)
        lo = min(self.first_needed_page(start), len(table))
        return GrowthPlan(num_new=num_new, recycle=tuple(range(first, lo)) if lo > first else ())

    def apply(self, request_id: str, plan: GrowthPlan, new_blocks: list[int]) -> list[int]:
        recycled = super().apply(request_id, plan, new_blocks)
        if plan.recycle:
            self._first_real[request_id] = plan.recycle[-1] + 1
        return recycled

    def replace(self, request_id: str, table: list[int]) -> None:
        super().replace(request_id, table)
        first = next((i for i, b in enumerate(table) if b != PADDING_BLOCK), len(table))
        self._first_real[request_id] = first

    def pop(self, request_id: str) -> list[int]:
        self._first_real.pop(request_id, None)
        return super().pop(request_id)
