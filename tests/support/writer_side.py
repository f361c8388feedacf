"""The far-namespace writer scripts' common part (tests/fabric/close_peer.py and
test_fence_reconnect.py run as a script under `ip netns exec`): the writer's endpoint with its
pool of pattern bytes, the one-line handshake on stdin/stdout, and the completion counts of the
writes it posts. The counts are bumped on the fabric progress thread and read on the script's
command thread; `WriteCounts.wait_for` is bounded by its caller's timeout."""

from __future__ import annotations

import base64
import json
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fabric import FabricConfig, MemoryRegion, TransferEngine
from pdserve.engine.cache.hostmem import alloc_buffer


def reply(obj: dict) -> None:
    """One JSON line on stdout: the answer to one command."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


@contextmanager
def writer_endpoint(node: str, pool_bytes: int, pattern: int) -> Iterator[tuple[TransferEngine, MemoryRegion, dict]]:
    """A tcp;ofi_rxm endpoint bound to `node` with a registered pool of `pool_bytes` bytes, each
    `pattern`; yields it, the region and the handshake: the first stdin line's JSON, answered with
    this endpoint's peer descriptor."""
    with TransferEngine(FabricConfig(provider="tcp;ofi_rxm", node=node, peer_timeout_s=60.0)) as engine:
        pool = alloc_buffer(pool_bytes)
        pool[:] = bytes([pattern]) * pool_bytes
        region = engine.register(pool.view)
        hello = json.loads(sys.stdin.readline())
        reply({"peer": base64.b64encode(pickle.dumps(engine.peer_descriptor)).decode()})
        yield engine, region, hello


class WriteCounts:
    """Completions of posted writes, by kind (`settle(kind)` from a write's callback)."""

    def __init__(self, *kinds: str) -> None:
        self.counts = dict.fromkeys(kinds, 0)
        self.changed = threading.Condition()

    def settle(self, kind: str) -> None:
        with self.changed:
            self.counts[kind] += 1
            self.changed.notify_all()

    def snapshot(self) -> dict[str, int]:
        with self.changed:
            return dict(self.counts)

    def wait_for(self, done: Callable[[dict[str, int]], bool], timeout: float) -> dict[str, int]:
        """The counts once `done(counts)` holds, or after `timeout` s."""
        with self.changed:
            self.changed.wait_for(lambda: done(self.counts), timeout=timeout)
            return dict(self.counts)
