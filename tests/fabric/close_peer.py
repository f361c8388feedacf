"""The writer of test_connection_close.py, run inside the far namespace (`ip netns exec`):
a prefill-like endpoint whose writes are caught in flight by a partition.

    python close_peer.py NODE     (stdin: JSON lines {"descriptor": ...}, then commands)

Commands (one JSON line each, answered by one JSON line on stdout):
    {"warm": N}   write N bytes to the target's offset 0 and wait for it: grows the socket's send
                  buffer, so a later burst leaves bytes in it          -> {"warm": true}
    {"burst": N}  post N bytes at offset WARM_MAX.. without waiting    -> {"posted": writes}
    {"drop": 1}   disconnect the target (FI_AV_REMOVE_CLEANUP: rxm closes the socket; what its
                  kernel still buffers is flushed by the orphaned socket) -> {"dropped": true}
    {"wait": S}   wait up to S s for the burst's completions -> {"done": ok, "failed": n, "pending": n}
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
import threading

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

from fabric import FabricConfig, PageWrites, TransferEngine  # noqa: E402
from pdserve.engine.cache.hostmem import alloc_buffer  # noqa: E402

POOL = 24 << 20
WARM_MAX = 8 << 20      # the warm-up write's bytes start at 0, the burst's here
PIECE = 1 << 20         # one burst write
PATTERN = 0xAB          # every byte this writer sends
WARM_TAG, BURST_TAG = 0x1111, 0x2222


def out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    node = sys.argv[1]
    with TransferEngine(FabricConfig(provider="tcp;ofi_rxm", node=node, peer_timeout_s=60.0)) as engine:
        pool = alloc_buffer(POOL)
        pool[:] = bytes([PATTERN]) * POOL
        region = engine.register(pool.view)
        msg = json.loads(sys.stdin.readline())
        target = pickle.loads(base64.b64decode(msg["descriptor"]))
        out({"peer": base64.b64encode(pickle.dumps(engine.peer_descriptor)).decode()})
        lock = threading.Lock()
        counts = {"done": 0, "failed": 0}
        changed = threading.Condition(lock)

        def settle(key: str) -> None:
            with changed:
                counts[key] += 1
                changed.notify_all()

        posted = 0
        for line in sys.stdin:
            cmd = json.loads(line)
            if "warm" in cmd:
                engine.write_sync(PageWrites(region, [0], target, [0], [int(cmd["warm"])], WARM_TAG), timeout=30)
                out({"warm": True})
            elif "burst" in cmd:
                n = int(cmd["burst"]) // PIECE
                for i in range(n):
                    off = WARM_MAX + i * PIECE
                    engine.write(PageWrites(region, [off], target, [off], [PIECE], BURST_TAG),
                                 lambda: settle("done"), lambda _e: settle("failed"))
                posted += n
                out({"posted": n})
            elif "drop" in cmd:
                engine.disconnect(target.peer)
                out({"dropped": True})
            elif "wait" in cmd:
                with changed:
                    changed.wait_for(lambda want=posted: counts["done"] + counts["failed"] >= want,
                                     timeout=float(cmd["wait"]))
                    out({"done": counts["done"], "failed": counts["failed"],
                         "pending": posted - counts["done"] - counts["failed"]})
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
