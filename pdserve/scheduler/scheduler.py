"""FIFO (E5) and prefill-first (E6) schedulers over one paged KV cache.

Each step the batch is rebuilt from scratch (E2): running requests first, then waiting ones, under
a token budget (`max_batch_tokens`), a request cap (`max_requests_per_batch`) and the cache
(E4). A prompt larger than the remaining budget is cut into chunks (E3). A new request enters
only if its first chunk's blocks can all be allocated (E10), and only while the free fraction of
the pool is at least the safety margin (E11).

When a running request cannot get the block it needs, the newest running request is preempted by
soft reset (E14): its blocks are freed and it goes back to the head of the queue with
num_computed_tokens = 0; its generated tokens stay, so the recompute prefills prompt + output
and generation resumes where it stopped.

Threading: a scheduler is owned by the engine thread; nothing else may call it.
"""

from __future__ import annotations

import abc
import logging
from collections import deque

from pdserve.cache.manager import KVCacheManager
from pdserve.config import SchedulerConfig
from pdserve.request import Request, RequestStatus
from pdserve.scheduler.output import ScheduledChunk, SchedulerOutput

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
        self._kv_waits: list[Request] = []

    # --- queues -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.PENDING
        self.waiting.append(request)

    def remove_request(self, request: Request) -> None:
        """Take a request out of every queue and free its blocks (finish, abort, error)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.waiting_for_kv.pop(request.request_id, None)
        self.cache.free(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    def has_work(self) -> bool:
        """True when a schedule() call can make progress (requests waiting for KV cannot)."""
        return bool(self.waiting or self.running)

    def detach(self, request: Request) -> None:
        """Take a request out of every queue but keep its blocks (their release comes later)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.waiting_for_kv.pop(request.request_id, None)

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
        request.remote_prefill = False
        request.status = RequestStatus.PREFILLING
        self.running.append(request)

    # --- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = _Budget(self.config.max_batch_tokens, self.config.max_requests_per_batch)
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        self._kv_waits: list[Request] = []
        self._order(budget, chunks, preempted)
        chunks.sort(key=lambda c: c.num_tokens != 1)  # decodes first; stable within each group
        return SchedulerOutput(chunks=tuple(chunks), preempted=tuple(preempted), kv_waits=tuple(self._kv_waits))

    @abc.abstractmethod
    def _order(self, budget: "_Budget", chunks: list[ScheduledChunk], preempted: list[Request]) -> None:
        """Append this step's chunks in priority order (each concrete scheduler orders the work)."""

    # --- building blocks the orderings share ---------------------------------------------------

    def _schedule_running(
        self, request: Request, budget: "_Budget", chunks: list[ScheduledChunk], preempted: list[Request]
    ) -> None:
        """Schedule the next chunk of a running request, preempting newer requests if the cache is full."""
        if request not in self.running or not budget.has_room():
            return
        n = min(request.num_remaining_tokens, budget.tokens)
        while True:
            if self.cache.allocate_slots(request, n) is not None:
                chunks.append(self._chunk(request, n))
                budget.take(n)
                return
            # Shrink the chunk to what fits in the blocks already held plus the free ones.
            fit = self._tokens_that_fit(request)
            if 0 < fit < n:
                n = fit
                continue
            victim = self._preemption_victim(request, chunks)
            if victim is None:
                return  # nothing newer to preempt: the request stalls this step
            self._preempt(victim, chunks, budget)
            preempted.append(victim)
            if victim is request:
                return

    def _try_admit(self, budget: "_Budget", chunks: list[ScheduledChunk]) -> bool:
        """Admit the head of the waiting queue if budgets, cache and safety margin allow."""
        if not self.waiting or not budget.has_room():
            return False
        margin = self.config.effective_safety_margin
        pool = self.cache.pool
        if margin > 0 and pool.num_free_blocks < margin * pool.num_usable_blocks:
            return False
        request = self.waiting[0]
        if request.remote_prefill and request.num_prompt_tokens > 1:
            return self._admit_remote_prefill(request)
        n = min(request.num_remaining_tokens, budget.tokens)
        if n < 1:
            return False
        if self.cache.allocate_slots(request, n) is None:  # all or nothing (E10)
            return False
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.PREFILLING
        chunks.append(self._chunk(request, n))
        budget.take(n)
        return True

    def _admit_remote_prefill(self, request: Request) -> bool:
        """Allocate pages for every prompt token but the last (D3); no compute, so no token budget."""
        if self.cache.allocate_slots(request, request.num_prompt_tokens - 1) is None:
            return False
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_KV
        self.waiting_for_kv[request.request_id] = request
        self._kv_waits.append(request)
        return True

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        samples = (start + n == request.target_computed_tokens) and not request.prefill_only
        return ScheduledChunk(request=request, start=start, num_tokens=n, samples=samples)

    def _tokens_that_fit(self, request: Request) -> int:
        page = self.cache.page_size
        held = len(self.cache.block_table(request.request_id))
        capacity = (held + self.cache.pool.num_free_blocks) * page
        return min(request.num_remaining_tokens, capacity - request.num_computed_tokens)

    def _preemption_victim(self, request: Request, chunks: list[ScheduledChunk]) -> Request | None:
        """The newest running request other than `request`; `request` itself if it is alone but others wait."""
        for candidate in reversed(self.running):
            if candidate is not request:
                return candidate
        return None

    def _preempt(self, victim: Request, chunks: list[ScheduledChunk], budget: "_Budget") -> None:
        """Soft reset (E14): free the victim's blocks and requeue it at the head of the queue."""
        for i, c in enumerate(chunks):
            if c.request is victim:  # already scheduled this step: give its budget back
                budget.give_back(c.num_tokens)
                del chunks[i]
                break
        self.running.remove(victim)
        self.cache.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PENDING
        self.waiting.appendleft(victim)
        logger.info("preempted %s (soft reset), %d free blocks", victim.request_id, self.cache.pool.num_free_blocks)


class FifoScheduler(Scheduler):
    """E5: running decodes, then running prefills, then waiting requests by arrival."""

    def _order(self, budget: "_Budget", chunks: list[ScheduledChunk], preempted: list[Request]) -> None:
        for r in [r for r in self.running if not r.is_prefilling]:
            self._schedule_running(r, budget, chunks, preempted)
        for r in [r for r in self.running if r.is_prefilling]:
            self._schedule_running(r, budget, chunks, preempted)
        while self._try_admit(budget, chunks):
            pass


class PrefillFirstScheduler(Scheduler):
    """E6: finish chunked prefills (running, then new) before resuming decodes."""

    def _order(self, budget: "_Budget", chunks: list[ScheduledChunk], preempted: list[Request]) -> None:
        for r in [r for r in self.running if r.is_prefilling]:
            self._schedule_running(r, budget, chunks, preempted)
        while self._try_admit(budget, chunks):
            pass
        for r in [r for r in self.running if not r.is_prefilling]:
            self._schedule_running(r, budget, chunks, preempted)


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

    def give_back(self, n: int) -> None:
        self.tokens += n
        self.requests += 1


def make_scheduler(config: SchedulerConfig, cache: KVCacheManager) -> Scheduler:
    if config.scheduler_type == "fifo":
        return FifoScheduler(config, cache)
    return PrefillFirstScheduler(config, cache)
