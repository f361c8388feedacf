"""Making room when running requests stall for lack of blocks (E14, E15).

The scheduler reports stalled requests and the blocks each needs; `Preemptor.relieve` picks the
fewest running requests whose blocks cover the shortfall, newest first, never leaving no running
request; their KV goes to the CPU swap pool in one batched copy, and the ones that do not fit
there (all of them when the swap pool is empty) are soft-reset. `Preemptor.restore` brings
offloaded requests back, oldest first, when the pool has room for them and headroom for the
running ones to grow.

Requests that may not move: prefill-only ones (transfers read their pages while they run; they
reserve their whole prompt at admission and never stall) and requests waiting for KV (D3).

Threading: owned by the engine thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.cache.swap import SwapSpace
from pdserve.engine.request import Request
from pdserve.engine.scheduler.output import StalledRequest
from pdserve.engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VictimCandidate:
    """A running request that could be moved out: the blocks moving it would give back, and the
    blocks it is itself stalled on (moving it removes that demand too)."""

    request: Request
    freeable: int
    need: int = 0

    @property
    def value(self) -> int:
        return self.freeable + self.need


def choose_victims(candidates: Sequence[VictimCandidate], demand: int, max_victims: int) -> list[VictimCandidate]:
    """The fewest candidates whose values cover `demand`; among equally few, newer first.

    candidates: newest first. If no set of at most max_victims covers the demand, the newest
    max_victims are returned (everything that may move goes).
    """
    if demand <= 0 or max_victims <= 0 or not candidates:
        return []
    ordered = sorted((c.value for c in candidates), reverse=True)
    k = next((i + 1 for i in range(min(max_victims, len(ordered))) if sum(ordered[: i + 1]) >= demand), None)
    if k is None:
        return list(candidates[:max_victims])
    chosen: list[VictimCandidate] = []
    remaining, slots = demand, k
    for i, c in enumerate(candidates):
        # Take c if the rest of the demand can still be covered by the slots left among older ones.
        after = remaining - c.value
        best_rest = sum(sorted((r.value for r in candidates[i + 1 :]), reverse=True)[: slots - 1])
        if after <= 0 or best_rest >= after:
            chosen.append(c)
            remaining, slots = after, slots - 1
            if remaining <= 0:
                break
    return chosen


@dataclass(frozen=True)
class Relief:
    offloaded: tuple[Request, ...] = ()
    soft_reset: tuple[Request, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.offloaded and not self.soft_reset


class Preemptor:
    def __init__(self, scheduler: Scheduler, cache: KVCacheManager, swap: SwapSpace | None) -> None:
        self.scheduler = scheduler
        self.cache = cache
        self.swap = swap
        self.num_offloads = 0     # requests moved to the swap pool (monotonic)
        self.num_soft_resets = 0  # requests soft-reset (monotonic)
        self.num_restores = 0     # requests brought back from the swap pool (monotonic)

    @property
    def num_offloaded(self) -> int:
        return len(self.scheduler.offloaded)

    def relieve(self, stalled: Sequence[StalledRequest]) -> Relief:
        """Move running requests out until the stalled ones' blocks are covered."""
        demand = sum(s.num_blocks for s in stalled) - self.cache.pool.num_free_blocks
        running = self.scheduler.running
        if demand <= 0 or len(running) < 2:
            return Relief()
        need = {s.request_id: s.num_blocks for s in stalled}
        movable = sorted((r for r in running if not r.prefill_only), key=lambda r: r.arrival_time, reverse=True)
        candidates = [
            VictimCandidate(r, self.cache.num_freeable_blocks(r), need.get(r.request_id, 0)) for r in movable
        ]
        victims = [c.request for c in choose_victims(candidates, demand, len(running) - 1)]
        if not victims:
            return Relief()
        unfit = self.swap.offload(victims) if self.swap is not None else list(victims)
        offloaded = tuple(r for r in victims if r not in unfit)
        for r in offloaded:
            self.scheduler.park(r)
        for r in unfit:
            self.scheduler.soft_reset(r)
        self.num_offloads += len(offloaded)
        self.num_soft_resets += len(unfit)
        logger.info("%d blocks short for %d stalled requests: offloaded %d, soft-reset %d; %d blocks free",
                    demand, len(stalled), len(offloaded), len(unfit), self.cache.pool.num_free_blocks)
        return Relief(offloaded=offloaded, soft_reset=tuple(unfit))

    def restore(self) -> list[Request]:
        """Bring offloaded requests back, oldest first, while each fits with headroom: one free
        block per group for every running request (and itself) after it is back."""
        back: list[Request] = []
        if self.swap is None:
            return back
        groups = len(self.cache.group_names)
        for r in sorted(self.scheduler.offloaded.values(), key=lambda r: r.arrival_time):
            headroom = (len(self.scheduler.running) + 1) * groups
            if self.swap.num_blocks_of(r.request_id) + headroom > self.cache.pool.num_free_blocks:
                break
            if not self.swap.restore(r):
                break
            self.scheduler.unpark(r)
            back.append(r)
        self.num_restores += len(back)
        return back

    def forget(self, request: Request) -> None:
        """A request ends: drop whatever it kept in the swap pool."""
        if self.swap is not None:
            self.swap.drop(request.request_id)
