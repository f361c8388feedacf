"""Pages no running request owns that a KV transfer may still read or write (D11, S5).

Two kinds, each with its own tables (one per attention group, padding entries kept, as the
request held them), taken out of the groups' request tables so that nothing allocates into them,
schedules them or counts them as a request's:

- a **held request**: a finished request whose pages a transfer may still touch: a prefill node's
  PREFILL request, read by the sender until the transfer ends (D11), or a decode node's request
  that ended while its KV was still arriving. Freed by `free_request`.
- a **quarantine**: the pages of a transfer attempt that was given up while its prefill node may
  still write into them (S5), under the connector's hold id: owned by nobody and reused by nobody
  until `release` (the decode side proves no write can land any more, docs/transfer-safety.md).
  Taken from a request waiting for its KV (which goes on in fresh pages or ends) or from a held one.

The pool's reference counts include these pages, so `KVCacheManager.check_integrity` counts their
tables beside the requests' (`table_blocks`). Freeing goes head first, like `KVCacheManager.free`.

Threading: owned by the engine thread (the cache manager's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.groups import PADDING_BLOCK, GroupTables


@dataclass(frozen=True)
class HeldTables:
    """Pages kept out of every request: one table per attention group (groups' order)."""

    tables: tuple[tuple[int, ...], ...]

    @property
    def num_blocks(self) -> int:
        return sum(1 for t in self.tables for b in t if b != PADDING_BLOCK)

    def blocks(self) -> Iterator[int]:
        return (b for t in self.tables for b in t if b != PADDING_BLOCK)


class PageHolds:
    """The held requests and the quarantines of one cache (a component of KVCacheManager)."""

    def __init__(self, pool: BlockPool, groups: tuple[GroupTables, ...]) -> None:
        self._pool = pool
        self._groups = groups
        self._requests: dict[str, HeldTables] = {}      # request id -> its pages, held
        self._quarantines: dict[str, HeldTables] = {}   # hold id -> an attempt's pages, quarantined
        self.num_quarantined_blocks = 0

    # --- moves (the engine applies its connector's events through these) --------------------------

    def _take(self, request_id: str) -> HeldTables:
        return HeldTables(tuple(tuple(g.tables.pop(request_id, ())) for g in self._groups))

    def hold_request(self, request_id: str) -> int:
        """Move a finished request's tables here; returns how many blocks it held."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds pages")
        held = self._take(request_id)
        self._requests[request_id] = held
        return held.num_blocks

    def quarantine(self, request_id: str, hold_id: str) -> int:
        """Move a live request's tables (it waits for its KV and goes on without pages) into
        quarantine `hold_id`; returns how many blocks moved."""
        self._check_free_id(hold_id)
        return self._quarantine(hold_id, self._take(request_id))

    def quarantine_held(self, request_id: str, hold_id: str) -> int | None:
        """Move a held request's pages into quarantine `hold_id`; returns how many blocks moved,
        or None (no quarantine made) if it holds none."""
        self._check_free_id(hold_id)
        held = self._requests.pop(request_id, None)
        return None if held is None else self._quarantine(hold_id, held)

    def _check_free_id(self, hold_id: str) -> None:
        if hold_id in self._quarantines:
            raise ValueError(f"quarantine id {hold_id!r} is in use")

    def _quarantine(self, hold_id: str, held: HeldTables) -> int:
        self._quarantines[hold_id] = held
        self.num_quarantined_blocks += held.num_blocks
        return held.num_blocks

    def free_request(self, request_id: str) -> int | None:
        """Free a held request's pages; returns how many, or None if it holds none."""
        held = self._requests.pop(request_id, None)
        if held is None:
            return None
        self._free(held)
        return held.num_blocks

    def release(self, hold_id: str) -> int | None:
        """No write can land in quarantine `hold_id` any more: free its pages; returns how many,
        or None if there is no such quarantine."""
        held = self._quarantines.pop(hold_id, None)
        if held is None:
            return None
        self.num_quarantined_blocks -= held.num_blocks
        self._free(held)
        return held.num_blocks

    def _free(self, held: HeldTables) -> None:
        for table in held.tables:
            self._pool.free([b for b in table if b != PADDING_BLOCK])

    # --- queries --------------------------------------------------------------------------------

    def holds_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def held_table(self, request_id: str, group_index: int) -> list[int] | None:
        """A held request's table in one group (groups' order), None if it holds none."""
        held = self._requests.get(request_id)
        return None if held is None else list(held.tables[group_index])

    def quarantined_blocks(self, hold_id: str) -> int | None:
        """Blocks in quarantine `hold_id`; None if there is none (never made, or released)."""
        held = self._quarantines.get(hold_id)
        return None if held is None else held.num_blocks

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_quarantines(self) -> int:
        return len(self._quarantines)

    @property
    def empty(self) -> bool:
        return not self._requests and not self._quarantines

    def table_blocks(self) -> Iterator[int]:
        """Every real block entry of every held table (for the reference-count check)."""
        for held in (*self._requests.values(), *self._quarantines.values()):
            yield from held.blocks()
