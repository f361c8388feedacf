"""The side jobs of a prefill engine and a decode engine sharing one process over real fabric
(tests/integration/test_kv_messenger.py, test_staging_full.py): a landed transfer makes its decode
request ready, a released one frees the prefill engine's held blocks. Test thread only; `pump` is
bounded by its `timeout`."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from pdserve.engine.kv_connector import KvLanded


def pump(prefill, sender, decode, receiver, jobs: queue.SimpleQueue, want_ready: set[str], timeout: float = 30, *,
         each: Callable[[set[str]], None] | None = None,
         on_ready: Callable[[str], None] | None = None) -> set[str]:
    """Run the jobs ("ready", rid) and ("release", rid) from `jobs` (as the connectors' events: a
    KvLanded through the receiver's QueueEvents, a KvReleased through the sender) until `want_ready` landed and no
    prefill block is held, or `timeout` s passed; the ids that landed. `each(ready)` runs before
    every wait for a job, `on_ready(rid)` when rid landed, before the receiver lets it go."""
    ready: set[str] = set()
    deadline = time.monotonic() + timeout
    while (not want_ready <= ready or prefill.num_held_requests) and time.monotonic() < deadline:
        if each is not None:
            each(ready)
        try:
            kind, rid = jobs.get(timeout=0.1)
        except queue.Empty:
            continue
        if kind == "ready":
            ready.add(rid)
            if on_ready is not None:
                on_ready(rid)
            receiver.finish(rid)
            receiver.events.apply(decode, KvLanded(rid))   # the connector's event (tests.support.kv_events)
        else:
            sender.post_release(rid)
            prefill.apply_kv_events()
    return ready
