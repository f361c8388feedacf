"""FIFO (E5) and prefill-first (E6) schedulers over one paged KV cache.

Each step the batch is rebuilt from scratch (E2): running requests first, then waiting ones, under
a token budget (`max_batch_tokens`), a request cap (`max_requests_per_batch`) and the cache
(E4). A prompt larger than the remaining budget is cut into chunks (E3). A new request enters
only if its first chunk's blocks can all be allocated (E10), and only while the free fraction of
the pool is at least the safety margin (E11). At admission the prefix cache is looked up (E12):
the request starts at the first token its cached blocks do not cover. A prefill-only request
takes the blocks of its whole prompt at admission, so it never stalls halfway (its pages are read
by transfers while it runs and cannot be moved).

When a running request cannot get the blocks it needs, it shrinks its chunk to what fits; if
nothing fits it is reported as stalled (`SchedulerOutput.stalled`) and no new request is admitted
in that step. Making room is the engine's decision (offload or soft reset, E14, E15); the
scheduler provides the queue moves: `park` / `unpark` (offloaded requests, which keep priority
over new admissions) and `soft_reset`.

Threading: a scheduler is owned by the engine thread; nothing else may call it.
"""

from __future__ import annotations

import abc
import logging
import time
from collections import deque
from collections.abc import Mapping

from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus, TransferRole
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput, StalledRequest

logger = logging.getLogger(__name__)


class Scheduler(abc.ABC):
    """Queues and the shared admission/allocation logic; subclasses order the work."""

    def __init__(self, config: SchedulerConfig, cache: KVCacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Admitted requests whose KV is being filled from elsewhere (decode nodes, D4).
        self.waiting_for_kv: dict[str, Request] = {}
        # Running requests whose KV sits in the CPU swap pool (E15), in the order they left.
        self.offloaded: dict[str, Request] = {}
        self._kv_waits: list[Request] = []
        self._stalled: list[StalledRequest] = []

    # --- queues -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.PENDING
        self.waiting.append(request)

    def remove_request(self, request: Request) -> None:
        """Take a request out of every queue and free its blocks (finish, abort, error)."""
        self.detach(request)
        self.cache.free(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv) + len(self.offloaded)

    def has_work(self) -> bool:
        """True when a schedule() call can make progress (requests waiting for KV cannot)."""
        return bool(self.waiting or self.running or self.offloaded)

    def detach(self, request: Request) -> None:
        """Take a request out of every queue but keep its blocks (their release comes later)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.waiting_for_kv.pop(request.request_id, None)
        self.offloaded.pop(request.request_id, None)

    def kv_ready(self, request: Request) -> None:
        """The request's prompt KV has landed: it decodes its last prompt token next step (D17)."""
        if self.waiting_for_kv.pop(request.request_id, None) is None:
            raise KeyError(f"request {request.request_id!r} is not waiting for KV")
        request.num_computed_tokens = request.num_prompt_tokens - 1
        request.status = RequestStatus.DECODING
        self.running.append(request)

    def prefill_locally(self, request: Request) -> None:
        """The remote prefill was abandoned safely: compute the prompt here, in the pages already held."""
        if self.waiting_for_kv.pop(request.request_id, None) is None:
            raise KeyError(f"request {request.request_id!r} is not waiting for KV")
        request.num_computed_tokens = 0
        request.role = TransferRole.LOCAL
        request.status = RequestStatus.PREFILLING
        self.running.append(request)

    def park(self, request: Request) -> None:
        """A running request's KV went to the swap pool: it leaves the running set (E15)."""
        if request not in self.running:
            raise KeyError(f"{request!r} is not running, so it cannot be offloaded")
        self.running.remove(request)
        self.offloaded[request.request_id] = request

    def unpark(self, request: Request) -> None:
        """An offloaded request's KV is back in the pool: it runs again, in arrival order."""
        if self.offloaded.pop(request.request_id, None) is None:
            raise KeyError(f"request {request.request_id!r} is not offloaded")
        i = len(self.running)
        while i > 0 and self.running[i - 1].arrival_time > request.arrival_time:
            i -= 1
        self.running.insert(i, request)

    def soft_reset(self, request: Request) -> None:
        """E14: free a running request's blocks and requeue it at the head of the queue.

        Its generated tokens stay: the recompute prefills prompt + output (the output is folded
        into what it prefills) and generation resumes where it stopped.
        """
        if request not in self.running:
            raise KeyError(f"{request!r} is not running, so it cannot be soft-reset")
        self.running.remove(request)
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.num_prefix_hit_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PENDING
        self.waiting.appendleft(request)

    # --- the step ----------------------------------------------------------------------------

    def schedule(self, drafts: Mapping[str, tuple[int, ...]] | None = None) -> SchedulerOutput:
        """This step's chunks. `drafts`: speculative proposals (E20) by request id, for requests
        that decode; each gets what the step has left once everything else is scheduled."""
        budget = _Budget(self.config.max_batch_tokens, self.config.max_requests_per_batch)
        chunks: list[ScheduledChunk] = []
        self._kv_waits = []
        self._stalled = []
        self._order(budget, chunks)
        if drafts and not self._stalled:
            self._grant_lookahead(chunks, drafts, budget)
        chunks.sort(key=lambda c: c.num_tokens != 1)  # decodes first; stable within each group
        return SchedulerOutput(chunks=tuple(chunks), stalled=tuple(self._stalled), kv_waits=tuple(self._kv_waits))

    @abc.abstractmethod
    def _order(self, budget: "_Budget", chunks: list[ScheduledChunk]) -> None:
        """Append this step's chunks in priority order (each concrete scheduler orders the work)."""

    # --- building blocks the orderings share ---------------------------------------------------

    def _schedule_running(self, request: Request, budget: "_Budget", chunks: list[ScheduledChunk]) -> None:
        """Schedule the next chunk of a running request, shrunk to what the cache can hold, or
        report it stalled when not even one token fits."""
        if not budget.has_room():
            return
        n = min(request.num_remaining_tokens, budget.tokens)
        if n < 1:
            return
        if self.cache.allocate_slots(request, n) is None:
            fit = self._tokens_that_fit(request, n)
            if fit < 1 or self.cache.allocate_slots(request, fit) is None:
                self._stalled.append(StalledRequest(request, self.cache.blocks_needed(request, n)))
                return
            n = fit
        chunks.append(self._chunk(request, n))
        budget.take(n)

    def _try_admit(self, budget: "_Budget", chunks: list[ScheduledChunk]) -> bool:
        """Admit the head of the waiting queue if budgets, cache and safety margin allow."""
        if not self.waiting or not budget.has_room() or self.offloaded or self._stalled:
            return False
        margin = self.config.effective_safety_margin
        pool = self.cache.pool
        if margin > 0 and pool.num_free_blocks < margin * pool.num_usable_blocks:
            return False
        request = self.waiting[0]
        if request.remote_prefill and request.num_prompt_tokens > 1:
            return self._admit_remote_prefill(request)
        hit = self.cache.lookup_prefix(request)
        n = min(request.target_computed_tokens - hit.num_tokens, budget.tokens)
        if n < 1:
            return False
        # A prefill-only request reserves its whole prompt (it must never stall halfway).
        reserve = request.target_computed_tokens - hit.num_tokens if request.prefill_only else n
        if self.cache.allocate_slots(request, reserve, hit) is None:  # all or nothing (E10)
            return False
        request.num_computed_tokens = hit.num_tokens
        request.num_prefix_hit_tokens = hit.num_tokens
        if request.num_reused_tokens is None:  # first admission: what usage reports
            request.num_reused_tokens = min(hit.num_tokens, request.num_prompt_tokens)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.PREFILLING
        chunks.append(self._chunk(request, n))
        budget.take(n)
        return True

    def _admit_remote_prefill(self, request: Request) -> bool:
        """Allocate pages for every prompt token but the last (D3); no compute, so no token budget.

        No prefix lookup: its KV arrives from elsewhere, and its blocks reach the prefix cache
        only once that KV has landed (`kv_ready`)."""
        if self.cache.allocate_slots(request, request.num_prompt_tokens - 1) is None:
            return False
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_KV
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.waiting_for_kv[request.request_id] = request
        self._kv_waits.append(request)
        return True

    def _grant_lookahead(self, chunks: list[ScheduledChunk], drafts: Mapping[str, tuple[int, ...]],
                         budget: "_Budget") -> None:
        """Extend decode chunks by their drafts (verification: 1 + k query tokens, E20) with the
        token budget and the blocks the step left over, in chunk order. Speculation takes only
        what is spare: it never delays an admission, never stalls or preempts a request (a pool
        with a stalled request gets none), and a draft that does not fit is cut or dropped (the
        sequence decodes plainly). Blocks it takes past the accepted tokens are freed after the
        pass (KVCacheManager.truncate)."""
        for i, c in enumerate(chunks):
            if budget.tokens < 1:
                return
            draft = drafts.get(c.request_id)
            if not draft or c.num_tokens != 1 or not c.samples:
                continue
            draft = draft[:budget.tokens]
            r = c.request
            if self.cache.allocate_slots(r, 1 + len(draft)) is None:
                fit = self._tokens_that_fit(r, 1 + len(draft))
                if fit < 2 or self.cache.allocate_slots(r, fit) is None:
                    continue
                draft = draft[:fit - 1]
            chunks[i] = ScheduledChunk(request=r, start=c.start, num_tokens=1 + len(draft), samples=True,
                                       draft_token_ids=draft)
            budget.tokens -= len(draft)

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        samples = (start + n == request.target_computed_tokens) and not request.prefill_only
        return ScheduledChunk(request=request, start=start, num_tokens=n, samples=samples)

    def _tokens_that_fit(self, request: Request, n: int) -> int:
        """The largest m <= n whose blocks the pool can supply now (0 if none)."""
        free = self.cache.pool.num_free_blocks
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cache.blocks_needed(request, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo


class FifoScheduler(Scheduler):
    """E5: running decodes, then running prefills, then waiting requests by arrival."""

    def _order(self, budget: "_Budget", chunks: list[ScheduledChunk]) -> None:
        for r in [r for r in self.running if not r.is_prefilling]:
            self._schedule_running(r, budget, chunks)
        for r in [r for r in self.running if r.is_prefilling]:
            self._schedule_running(r, budget, chunks)
        while self._try_admit(budget, chunks):
            pass


class PrefillFirstScheduler(Scheduler):
    """E6: finish chunked prefills (running, then new) before resuming decodes."""

    def _order(self, budget: "_Budget", chunks: list[ScheduledChunk]) -> None:
        for r in [r for r in self.running if r.is_prefilling]:
            self._schedule_running(r, budget, chunks)
        while self._try_admit(budget, chunks):
            pass
        for r in [r for r in self.running if not r.is_prefilling]:
            self._schedule_running(r, budget, chunks)


class _Budget:
    """Tokens and request slots left in the pass being built."""

    def __init__(self, tokens: int, requests: int) -> None:
        self.tokens = tokens
        self.requests = requests

    def has_room(self) -> bool:
        return self.tokens > 0 and self.requests > 0

    def take(self, n: int) -> None:
        self.tokens -= n
        self.requests -= 1


def make_scheduler(config: SchedulerConfig, cache: KVCacheManager) -> Scheduler:
    if config.scheduler_type == "fifo":
        return FifoScheduler(config, cache)
    return PrefillFirstScheduler(config, cache)
