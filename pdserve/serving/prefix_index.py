"""Prefix affinity for choosing a node (R3): which node most likely holds a request's prefix in its cache.

A prompt is cut into fixed-size blocks, and block i is named by a hash chained over blocks 0..i, so
two prompts share a block hash exactly when they share everything up to the end of that block (the
engine's prefix cache names its KV blocks the same way, E12). A `PrefixIndex` remembers which nodes
were sent which block hashes; `choose` takes the node with the deepest match among the nodes whose
load is under a cap, and the least loaded node when none matches.

    index = PrefixIndex(capacity=65536)
    hashes = chain_hashes(token_blocks(ids, block_tokens=16, max_blocks=128))
    choice = choose([Candidate("a", load=100), Candidate("b", load=40)], index.matches(hashes),
                    LoadCap(slack_tokens=1024, ratio=0.5))
    index.record(hashes, choice.key)

The index is what a sender remembers, not what a node holds: a node may have evicted a block since,
and a node that restarts has lost everything (its owner calls `forget`). Entries are kept in least
recently recorded order and the oldest are dropped beyond `capacity` block hashes.

Not thread-safe: one owner (the router's event loop, or a decode node's).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

_SEED = b"pdserve-prefix-v1"


def token_blocks(token_ids: Sequence[int], block_tokens: int, max_blocks: int) -> list[bytes]:
    """The leading complete blocks of `block_tokens` token ids (a partial last block is left out)."""
    if block_tokens < 1 or max_blocks < 0:
        raise ValueError(f"block_tokens must be >= 1 and max_blocks >= 0, got {block_tokens}, {max_blocks}")
    n = min(len(token_ids) // block_tokens, max_blocks)
    return [array("q", token_ids[i * block_tokens:(i + 1) * block_tokens]).tobytes() for i in range(n)]


def text_blocks(text: str, block_chars: int, max_blocks: int) -> list[bytes]:
    """The leading complete blocks of `block_chars` characters (a partial last block is left out)."""
    if block_chars < 1 or max_blocks < 0:
        raise ValueError(f"block_chars must be >= 1 and max_blocks >= 0, got {block_chars}, {max_blocks}")
    n = min(len(text) // block_chars, max_blocks)
    return [text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass") for i in range(n)]


def chain_hashes(blocks: Iterable[bytes]) -> tuple[int, ...]:
    """Hash i covers blocks 0..i (each hash folds in its predecessor's); deterministic across processes."""
    out: list[int] = []
    prev = _SEED
    for block in blocks:
        h = hashlib.blake2b(block, digest_size=8, key=prev[:64]).digest()
        out.append(int.from_bytes(h, "little"))
        prev = h
    return tuple(out)


class PrefixIndex:
    """Block hash -> the nodes (keys) it was sent to, bounded to `capacity` hashes (LRU by record)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block hash, got {capacity}")
        self.capacity = capacity
        self._nodes: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def record(self, hashes: Sequence[int], key: str) -> None:
        """`key` was sent a request whose prompt starts with these blocks."""
        for h in hashes:
            holders = self._nodes.get(h)
            if holders is None:
                self._nodes[h] = {key}
            else:
                holders.add(key)
                self._nodes.move_to_end(h)
        while len(self._nodes) > self.capacity:
            self._nodes.popitem(last=False)

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """Key -> how many leading blocks of `hashes` it was sent (its deepest recorded block + 1)."""
        depth: dict[str, int] = {}
        for i in range(len(hashes) - 1, -1, -1):
            for key in self._nodes.get(hashes[i], ()):
                depth.setdefault(key, i + 1)
        return depth

    def forget(self, key: str) -> int:
        """Drop everything recorded for `key` (it restarted or left); returns the hashes it lost."""
        lost = 0
        for h in list(self._nodes):
            holders = self._nodes[h]
            if key in holders:
                lost += 1
                holders.discard(key)
                if not holders:
                    del self._nodes[h]
        return lost


@dataclass(frozen=True)
class LoadCap:
    """A node may take a request for its prefix only while its load is at most
    least + max(slack_tokens, ratio * least), where least is the lowest load among the candidates."""

    slack_tokens: int = 1024
    ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.slack_tokens < 0 or not self.ratio >= 0:
            raise ValueError(f"load cap needs slack_tokens >= 0 and ratio >= 0, got {self.slack_tokens}, {self.ratio}")

    def limit(self, least: int) -> float:
        return least + max(self.slack_tokens, self.ratio * least)


@dataclass(frozen=True)
class Candidate:
    """A node that may take the request: its key, outstanding work, and a tie-break rank (lower first)."""

    key: str
    load: int
    rank: int = 0


# Why a node was chosen.
REASON_LEAST_LOADED = "least_loaded"  # no candidate was sent any block of this prompt
REASON_PREFIX = "prefix"              # the deepest match among the candidates
REASON_LOAD_CAP = "load_cap"          # a deeper match was over the load cap; the best one under it


@dataclass(frozen=True)
class Choice:
    key: str
    reason: str
    matched_blocks: int


def choose(candidates: Sequence[Candidate], matches: Mapping[str, int], cap: LoadCap) -> Choice:
    """The candidate under the load cap with the deepest match (then least load, then rank); with no
    match under the cap, the least loaded candidate (then rank). Raises ValueError when empty."""
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    limit = cap.limit(min(c.load for c in candidates))
    under = [c for c in candidates if c.load <= limit]
    best = min(under, key=lambda c: (-matches.get(c.key, 0), c.load, c.rank))
    depth = matches.get(best.key, 0)
    deepest = max(matches.get(c.key, 0) for c in candidates)
    if deepest > depth:
        return Choice(best.key, REASON_LOAD_CAP, depth)
    return Choice(best.key, REASON_PREFIX if depth else REASON_LEAST_LOADED, depth)
