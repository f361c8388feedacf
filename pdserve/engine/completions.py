"""The engine side of a KV transfer's way back: the connector's events (pdserve.engine.kv_connector:
KvLanded, KvFailed, KvQuarantined, KvReleased) applied to the scheduler and the cache manager's
holds (pdserve.engine.cache.holds), and which requests' pages are held when they end.

Each event is applied against the engine's state at that moment, so a connector never needs to
know it exactly: an event for a request that no longer waits for its KV acts on what is left of it
(its held pages) and is otherwise a no-op; a PREFILL request released while it still runs is not
held when it ends.

Threading: the engine thread (LLMEngine.apply_kv_events, at every step and idle tick).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.kv_connector import KvEvent, KvFailed, KvFailure, KvLanded, KvQuarantined, KvReleased
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec_decode.decoder import Handoff, SpeculativeDecoder
from pdserve.engine.tracked import TrackedRequest

logger = logging.getLogger(__name__)


class KvCompletions:
    """Applies one engine's connector events; `fail(tracked, error)` ends a request with an error
    (the engine's own finish, which frees or holds its pages by `holds_at_finish`)."""

    def __init__(self, scheduler: Scheduler, cache: KVCacheManager,
                 fail: Callable[[TrackedRequest, str], RequestOutput]) -> None:
        self.scheduler = scheduler
        self.cache = cache
        self._fail = fail
        # PREFILL requests (with a prefill connector) whose pages are held when they end, until the
        # connector's KvReleased: a transfer may still read them (D11)
        self.hold_on_finish: set[str] = set()

    def holds_at_finish(self, r: Request) -> bool:
        """Whether a request that ends now keeps its pages held: a PREFILL request its transfer may
        still read, or one waiting for its KV, into which writes may still land (S5)."""
        hold = r.request_id in self.hold_on_finish or r.status is RequestStatus.WAITING_FOR_KV
        self.hold_on_finish.discard(r.request_id)
        return hold and self.cache.has(r.request_id)

    def apply(self, event: KvEvent, tracked: TrackedRequest | None,
              speculator: SpeculativeDecoder | None) -> RequestOutput | None:
        """Apply one event; the output of the request it ended, if any."""
        holds = self.cache.holds
        if isinstance(event, KvReleased):
            if event.hold_id is not None:
                holds.release(event.hold_id)
            elif holds.free_request(event.request_id) is None:
                self.hold_on_finish.discard(event.request_id)   # still running: not held when it ends
            return None
        r = tracked.request if tracked is not None else None
        if r is None or r.status is not RequestStatus.WAITING_FOR_KV:
            if isinstance(event, KvQuarantined):   # ended while its KV was landing: its held pages
                holds.quarantine_held(event.request_id, event.hold_id)
            else:                                  # nothing can land in them any more
                holds.free_request(event.request_id)
            return None
        if isinstance(event, KvLanded):
            self.scheduler.kv_ready(r)
            self.cache.commit(r)   # its complete prompt blocks join the prefix cache
            if event.context_hidden is not None and speculator is not None and speculator.uses_hidden:
                # a draft head starts from the prefill node's hidden state (D17) and history (E20)
                speculator.handoff(Handoff(r, r.num_computed_tokens - 1, event.context_hidden, event.context_history))
            return None
        assert tracked is not None
        return self._failed(event, tracked)

    def _failed(self, event: KvFailed | KvQuarantined, tracked: TrackedRequest) -> RequestOutput | None:
        """A waiting request's remote prefill failed: its pages quarantined (writes may land) or
        freed, then it is admitted again, computed here, or ended."""
        r = tracked.request
        if isinstance(event, KvQuarantined):
            self.cache.quarantine(r, event.hold_id)   # it goes on without pages
        elif event.then is KvFailure.END:   # nothing can land: its pages go now, not held
            self.scheduler.detach(r)
            self.cache.free(r)
        if event.then is KvFailure.END:
            return self._fail(tracked, event.error)
        if event.then is KvFailure.PREFILL_LOCALLY:
            logger.warning("request %s: remote prefill abandoned (%s); prefilling locally", r.request_id, event.error)
            self.scheduler.prefill_locally(r)
            return None
        self.scheduler.detach(r)   # RETRY: to the head of the queue, admitted again into fresh pages
        self.cache.free(r)         # (none if quarantined; never committed: no prefix-cache entry)
        r.num_computed_tokens = 0
        r.status = RequestStatus.PENDING
        self.scheduler.waiting.appendleft(r)
        return None
