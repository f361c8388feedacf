"""The name of a complete block's content (E12): `BlockHash`, the chained hash of its tokens.

    h[0] = H(b"",   tokens[0:P])
    h[i] = H(h[i-1], tokens[i*P:(i+1)*P])

H is SHA-256 over the parent digest and the token ids as little-endian int64: collisions are not a
practical concern, so equal hashes mean equal prefixes up to and including that block, and a hit
can be trusted without comparing tokens.

A leaf: it imports nothing of ours, so the block pool (which indexes blocks by it), the request
(which keeps its blocks' hashes) and the prefix cache (which computes them) all import it without
a cycle. Pure functions; any thread (in practice the engine thread).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NewType

BlockHash = NewType("BlockHash", bytes)


def hash_block(parent: BlockHash | None, tokens: "array[int] | list[int]") -> BlockHash:
    """The chained hash of one complete block of token ids (`parent`: the previous block's, None
    for the first block)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return BlockHash(h.digest())
