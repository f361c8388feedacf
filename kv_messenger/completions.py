"""The way back from a transfer to the engine: work posted from any thread that the engine thread
runs when it takes its connector's events (pdserve.engine.kv_connector: `kv_events`), ending in
typed events (KvLanded, KvFailed, KvQuarantined, KvReleased) that the engine applies.

A piece of work is a generator: it reads and updates the transfer's own state (the receiver's
tags and slots, a quarantine), yields the engine's events, and goes on after the engine applied
each (so it may read the engine's result: `LLMEngine.quarantined_blocks`). The engine thread
therefore sees the transfer's state and its own change together, in the order the work was
posted, as the calls it replaces did (EngineThread.submit).

    inbox.post(functools.partial(transfers.landed, request_id, tag))   # any thread; wakes the engine
    ...
    for event in inbox.drain():     # the connector's kv_events, on the engine thread
        engine._apply(event)

Threads: `post` from any thread (a deque append, then EngineThread.wake); `drain` on the engine
thread only. `applied` awaits, on a loop, the end of one posted piece of work.

Blocking waits: `applied` waits for the engine thread to drain the work: one step at most while it
serves (only a hung step holds it), checked every ENGINE_POLL_S for a dead engine thread, which ends
the wait with EngineDeadError (its work is never run then).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Iterable, Iterator

from pdserve.engine.engine_thread import EngineDeadError, EngineThread
from pdserve.engine.kv_connector import KvEvent

logger = logging.getLogger(__name__)

Work = Callable[[], Iterable[KvEvent]]

ENGINE_POLL_S = 0.5   # how often `applied` checks that the engine thread still serves


class EngineInbox:
    """Work for the engine thread that ends in its connector's events (one per connector)."""

    def __init__(self) -> None:
        self._work: collections.deque[Work] = collections.deque()
        self._engine: EngineThread | None = None

    def bind(self, engine: EngineThread) -> None:
        """The engine thread that drains this inbox (servers: before any work is posted). Unbound,
        the work waits for the engine's next step or apply_kv_events (a driver that steps the
        engine itself, as tests do)."""
        self._engine = engine

    def post(self, work: Work) -> None:
        """Any thread: queue `work` and wake the engine thread; EngineDeadError if it no longer
        serves (the work is not queued then)."""
        if self._engine is not None and not self._engine.is_running:
            raise EngineDeadError("the engine thread is not running: the transfer's completion was not queued")
        self._work.append(work)
        if self._engine is not None:
            self._engine.wake()

    def drain(self) -> Iterator[KvEvent]:
        """Engine thread: run the queued work in order, yielding its events."""
        while self._work:
            yield from self._work.popleft()()

    @property
    def num_pending(self) -> int:
        return len(self._work)

    async def applied(self, work: Work) -> None:
        """On a loop: post `work` and return once the engine thread ran it (its events applied).
        EngineDeadError if the engine thread stops first."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def run() -> Iterator[KvEvent]:
            try:
                yield from work()
            finally:
                try:
                    loop.call_soon_threadsafe(_resolve, done)
                except RuntimeError:   # the waiter's loop is closed: nobody waits any more
                    logger.debug("a transfer completion was applied after its waiter's loop closed")

        if self._engine is None:
            raise RuntimeError("EngineInbox.applied needs an engine thread (bind): nothing would run the work")
        self.post(run)
        while not done.done():
            await asyncio.wait({done}, timeout=ENGINE_POLL_S)
            if not done.done() and self._engine is not None and not self._engine.is_running:
                raise EngineDeadError("the engine thread stopped before it applied the transfer's completion")


def _resolve(fut: asyncio.Future) -> None:
    """On the waiter's loop."""
    if not fut.done():
        fut.set_result(None)
