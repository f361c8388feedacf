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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]   # tests/, the repository

from support.writer_side import WriteCounts, reply, writer_endpoint  # noqa: E402

from fabric import PageWrites  # noqa: E402

POOL = 24 << 20
WARM_MAX = 8 << 20      # the warm-up write's bytes start at 0, the burst's here
PIECE = 1 << 20         # one burst write
PATTERN = 0xAB          # every byte this writer sends
WARM_TAG, BURST_TAG = 0x1111, 0x2222


def main() -> int:
    with writer_endpoint(sys.argv[1], POOL, PATTERN) as (engine, region, hello):
        target = pickle.loads(base64.b64decode(hello["descriptor"]))
        counts = WriteCounts("done", "failed")
        posted = 0
        for line in sys.stdin:
            cmd = json.loads(line)
            if "warm" in cmd:
                engine.write_sync(PageWrites(region, [0], target, [0], [int(cmd["warm"])], WARM_TAG), timeout=30)
                reply({"warm": True})
            elif "burst" in cmd:
                n = int(cmd["burst"]) // PIECE
                for i in range(n):
                    off = WARM_MAX + i * PIECE
                    engine.write(PageWrites(region, [off], target, [off], [PIECE], BURST_TAG),
                                 lambda: counts.settle("done"), lambda _e: counts.settle("failed"))
                posted += n
                reply({"posted": n})
            elif "drop" in cmd:
                engine.disconnect(target.peer)
                reply({"dropped": True})
            elif "wait" in cmd:
                c = counts.wait_for(lambda c, want=posted: c["done"] + c["failed"] >= want, float(cmd["wait"]))
                reply({"done": c["done"], "failed": c["failed"], "pending": posted - c["done"] - c["failed"]})
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
