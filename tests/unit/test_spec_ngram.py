"""N-gram prompt lookup (E20, pdserve/engine/spec_decode/ngram.py): exact small cases, then both
implementations against a brute force over random short sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.engine.spec_decode.ngram import NgramIndex, NgramProposer


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> tuple[int, ...]:
    """The rule of the module docstring, spelled out: longest n, then the earliest earlier occurrence."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = tokens[length - n :]
        for start in range(0, length - n):  # occurrences ending at <= L-2
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + k])
    return ()


def both(tokens: list[int], lo: int, hi: int, k: int) -> tuple[int, ...]:
    """The answer of both implementations, asserted equal."""
    a = NgramProposer(lo, hi).propose(tokens, k)
    index = NgramIndex(lo, hi)
    index.extend(tokens)
    assert index.propose(k) == a, (tokens, lo, hi, k)
    return a


def test_exact_small_cases():
    # vLLM's docstring example: [4,2,3] finds nothing, [2,3] matches at 1 and the draft runs to the end
    assert both([1, 2, 3, 4, 2, 3], 2, 3, 4) == (4, 2, 3)
    # plain repetition: the earliest occurrence of the longest suffix wins
    assert both([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 1, 4, 3) == (7, 8, 5)
    # no earlier occurrence of any suffix n-gram
    assert both([1, 2, 3, 4, 5], 1, 3, 4) == ()
    # the only occurrence ends right before the suffix: one token, the last one
    assert both([9, 9], 1, 2, 5) == (9,)
    assert both([3, 4, 3], 1, 2, 5) == (4, 3)
    # overlapping occurrence inside a run (a a a a): n=3 matches at 0..2, the draft is the last token
    assert both([7, 7, 7, 7], 1, 3, 4) == (7,)
    # k larger than what follows the match
    assert both([1, 2, 1], 1, 1, 10) == (2, 1)
    # k = 0 and sequences too short
    assert both([1, 2, 1, 2], 1, 2, 0) == ()
    assert both([1], 1, 1, 3) == ()
    assert both([], 1, 1, 3) == ()
    assert both([1, 1], 2, 2, 3) == ()  # L == lookup_min: no room for an earlier 2-gram


def test_bounds_decide_the_match():
    tokens = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    assert both(tokens, 1, 3, 2) == (9, 2)      # [1,2,3] earliest at 0..2 -> 9
    # the 3-gram and the 2-gram have different earliest occurrences: lookup_max decides
    tokens = [2, 3, 5, 1, 2, 3, 9, 1, 2, 3]
    assert both(tokens, 1, 3, 2) == (9, 1)      # [1,2,3] at 3..5 -> 9
    assert both(tokens, 1, 2, 2) == (5, 1)      # [2,3] earliest at 0..1 -> 5
    assert both(tokens, 3, 3, 2) == (9, 1)
    # min above the longest match: nothing, even though shorter n-grams match
    assert both([4, 5, 6, 0, 5, 6], 3, 4, 3) == ()
    assert both([4, 5, 6, 0, 5, 6], 2, 4, 3) == (0, 5, 6)


def test_bad_bounds_and_k_name_the_values():
    for lo, hi in ((0, 2), (3, 2), (-1, -1)):
        with pytest.raises(ValueError, match=f"lookup_min={lo}, lookup_max={hi}"):
            NgramProposer(lo, hi)
        with pytest.raises(ValueError, match=f"lookup_min={lo}, lookup_max={hi}"):
            NgramIndex(lo, hi)
    with pytest.raises(ValueError, match="lookup_max must be an integer"):
        NgramProposer(1, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be an integer >= 0, got -1"):
        NgramProposer(1, 2).propose([1, 2], -1)
    with pytest.raises(ValueError, match="1-D"):
        NgramProposer(1, 2).propose(np.zeros((2, 2), dtype=np.int64), 1)


def test_index_refuses_a_changed_sequence():
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3])
    with pytest.raises(ValueError, match="shrank: 3 tokens indexed, got 2"):
        index.extend([1, 2])
    with pytest.raises(ValueError, match="token 2 is 4, indexed 3"):
        index.extend([1, 2, 4, 5])


def test_random_sequences_against_brute_force():
    rng = random.Random(1234)
    for trial in range(1500):
        vocab = rng.choice((2, 3, 5, 20))
        length = rng.randrange(0, 40)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(0, 8)
        expected = brute_force(tokens, lo, hi, k)
        assert NgramProposer(lo, hi).propose(tokens, k) == expected, (trial, tokens, lo, hi, k)
        assert NgramProposer(lo, hi).propose(np.asarray(tokens, dtype=np.int32), k) == expected
    # the index grown token by token answers like a fresh scan at every length
    for _ in range(40):
        lo = rng.randrange(1, 3)
        hi = rng.randrange(lo, 5)
        tokens = [rng.randrange(4) for _ in range(60)]
        index = NgramIndex(lo, hi)
        for length in range(len(tokens) + 1):
            index.extend(tokens[:length])
            assert index.propose(3) == brute_force(tokens[:length], lo, hi, 3), (tokens[:length], lo, hi)
