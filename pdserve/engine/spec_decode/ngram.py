"""N-gram prompt lookup (E20, vLLM's "ngram" method): draft the tokens that followed an earlier
occurrence of the sequence's own last n tokens.

    proposer = NgramProposer(lookup_min=2, lookup_max=4)
    drafts = proposer.propose(prompt_ids + output_ids, k=4)      # () when nothing matches

The rule, for `token_ids` of length L (prompt and output so far; its last token is the one being
decoded now) and n-gram bounds [lookup_min, lookup_max]:

1. n goes from min(lookup_max, L - 1) down to lookup_min; the first n whose suffix
   `token_ids[L-n:]` also occurs earlier (ending at an index <= L - 2; it may overlap the suffix, as in
   `a a a a`) is the match length. Longer matches predict better, so the longest wins.
2. Tie rule: among the occurrences of that n-gram the EARLIEST (lowest index) wins. vLLM does the same
   (its KMP scan keeps the earliest position), so acceptance numbers compare with vLLM's; and the
   earliest occurrence has the most tokens after it, so it gives the full k most often.
3. The draft is the up to k tokens after the occurrence: `token_ids[e+1 : e+1+k]` for an occurrence
   ending at e. They may run into the suffix itself and stop at the end of `token_ids`, so a match near
   the end gives fewer than k tokens (at least one). No match (or L <= lookup_min) gives ().

Capping k (at max_model_len, max_tokens, the lookahead budget) is the caller's business.

Two implementations with the same answers (tests/unit/test_spec_ngram.py checks both against a brute
force): `NgramProposer.propose`, stateless, a numpy scan (one vectorised comparison of the whole
sequence with its last token, then at most lookup_max - 1 comparisons over the surviving candidate
positions); it takes a numpy integer array without a copy, while a Python list is converted first
(which costs more than the scan itself on long sequences). `NgramIndex`, one per sequence, keeps the
earliest end of every n-gram of the tokens seen so far in a dict: `extend` costs
(lookup_max - lookup_min + 1) dict updates per new token and `propose` as many look-ups, whatever the
length. Neither blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _check_bounds(lookup_min: int, lookup_max: int) -> None:
    for name, v in (("lookup_min", lookup_min), ("lookup_max", lookup_max)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"n-gram {name} must be an integer, got {v!r}")
    if not 1 <= lookup_min <= lookup_max:
        raise ValueError(f"n-gram bounds must satisfy 1 <= lookup_min <= lookup_max, got lookup_min={lookup_min}, "
                         f"lookup_max={lookup_max}")


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"number of draft tokens k must be an integer >= 0, got {k!r}")


class NgramProposer:
    """Stateless prompt lookup; safe to share between sequences and threads."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        _check_bounds(lookup_min, lookup_max)
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the earliest earlier occurrence of the longest suffix n-gram."""
        _check_k(k)
        tokens = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be one sequence (1-D), got shape {tokens.shape}")
        length = tokens.shape[0]
        if k == 0 or length <= self.lookup_min:
            return ()
        max_n = min(self.lookup_max, length - 1)
        # ends: [c] ascending end positions e <= L-2 of matches of length >= 1 (token e == the last token)
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        best, best_n = ends, 1
        for t in range(1, max_n):
            # extend every surviving match by one token to the left: tokens[e - t] == tokens[L-1-t]
            ends = ends[ends >= t]
            ends = ends[tokens[ends - t] == tokens[length - 1 - t]]
            if ends.size == 0:
                break
            best, best_n = ends, t + 1
        if best.size == 0 or best_n < self.lookup_min:
            return ()
        start = int(best[0]) + 1  # the earliest occurrence (filtering keeps the ascending order)
        return tuple(tokens[start : start + k].tolist())


class NgramIndex:
    """Incremental prompt lookup for ONE growing sequence; the same answers as NgramProposer.propose.

    `extend(token_ids)` takes the whole sequence so far (it must begin with what was indexed: tokens
    are only ever appended, since rejected drafts never enter it) and indexes the new tail;
    `propose(k)` answers for everything indexed. Not thread-safe: one per sequence, on the engine thread.
    """

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        _check_bounds(lookup_min, lookup_max)
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._tokens: list[int] = []
        self._first_end: dict[tuple[int, ...], int] = {}  # n-gram -> its earliest end position

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index the tokens of `token_ids` past those already indexed."""
        have = len(self._tokens)
        if len(token_ids) < have:
            raise ValueError(f"sequence shrank: {have} tokens indexed, got {len(token_ids)}")
        if have and token_ids[have - 1] != self._tokens[have - 1]:
            raise ValueError(f"sequence changed: token {have - 1} is {token_ids[have - 1]}, "
                             f"indexed {self._tokens[have - 1]}")
        toks = self._tokens
        first = self._first_end
        for e in range(have, len(token_ids)):
            toks.append(int(token_ids[e]))
            for n in range(self.lookup_min, min(self.lookup_max, e + 1) + 1):
                first.setdefault(tuple(toks[e - n + 1 : e + 1]), e)

    def propose(self, k: int) -> tuple[int, ...]:
        _check_k(k)
        toks = self._tokens
        length = len(toks)
        if k == 0:
            return ()
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            e = self._first_end.get(tuple(toks[length - n :]))
            if e is not None and e <= length - 2:  # the suffix itself ends at L-1: not an earlier occurrence
                return tuple(toks[e + 1 : e + 1 + k])
        return ()
