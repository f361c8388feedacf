"""One side of the cross-namespace transfer test; run inside `ip netns exec`.

    python netns_peer.py receive NODE SEED PROVIDER   -> prints its descriptor, then digests
    python netns_peer.py send NODE SEED PROVIDER      -> reads the receiver's descriptor on stdin

PROVIDER: "tcp;ofi_rxm" or "ucx" (fabric.open_backend picks the backend).

Lines on stdout are JSON; descriptors travel pickled in base64.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import random
import sys
import threading

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

from fabric import FabricConfig, PageWrites, open_backend  # noqa: E402
from pdserve.engine.cache.hostmem import alloc_buffer  # noqa: E402

POOL = 32 << 20
TAG = 0x5EED


def plan(seed: int) -> list[list[tuple[int, int, int]]]:
    """Batches of (src, dst, length): disjoint destination ranges."""
    rng = random.Random(seed)
    writes, dst = [], 0
    while True:
        size = 4096 * 2 ** rng.randint(0, 6)
        if dst + size > POOL:
            break
        writes.append((rng.randrange(0, POOL - size), dst, size))
        dst += size
    rng.shuffle(writes)
    return [writes[i : i + 16] for i in range(0, len(writes), 16)]


def out(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    role, node, seed, provider = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    config = FabricConfig(provider=provider, node=node, peer_timeout_s=5.0)
    batches = plan(seed)
    with open_backend(config) as engine:
        pool = alloc_buffer(POOL)
        region = engine.register(pool.view)
        if role == "receive":
            fired = threading.Event()
            engine.imm_counter.expect(TAG, len(batches), lambda tag: fired.set())
            out({"descriptor": base64.b64encode(pickle.dumps(region.descriptor)).decode()})
            if not fired.wait(60):
                out({"error": f"only {engine.imm_counter.landed(TAG)} of {len(batches)} batches landed"})
                return 1
            digests = [hashlib.blake2b(pool[d : d + n], digest_size=16).hexdigest() for b in batches for _, d, n in b]
            out({"digests": digests, "writes": len(digests)})
            sys.stdin.readline()  # stay up until the sender is done
            return 0
        rng = random.Random(seed + 1)
        pool[:] = rng.randbytes(POOL)
        desc = pickle.loads(base64.b64decode(json.loads(sys.stdin.readline())["descriptor"]))
        done = threading.Semaphore(0)
        errors: list[str] = []
        for batch in batches:
            s, d, n = zip(*batch, strict=True)
            engine.write(PageWrites(region, s, desc, d, n, TAG),
                         done.release, lambda e: (errors.append(str(e)), done.release()))
        for _ in batches:
            if not done.acquire(timeout=60):
                out({"error": "timed out waiting for completions"})
                return 1
        digests = [hashlib.blake2b(pool[s : s + n], digest_size=16).hexdigest() for b in batches for s, _, n in b]
        out({"digests": digests, "errors": errors, "writes": len(digests)})
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
