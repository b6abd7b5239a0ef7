"""The n-gram drafter alone: longest suffix first, most recent occurrence, k cap, no match."""

import random

import pytest

from swaserve.speculative.ngram import NgramDrafter


def test_longest_suffix_and_most_recent_occurrence():
    d = NgramDrafter(1, 3)
    # suffix [7, 8] appears twice before; the most recent is followed by 9, 1
    toks = [7, 8, 5, 5, 7, 8, 9, 1, 2, 7, 8]
    assert d.propose(toks, 2) == [9, 1]
    assert d.propose(toks, 5) == [9, 1, 2, 7, 8]  # to the end of the tokens
    assert d.propose(toks, 7) == [5, 5, 7, 8, 9, 1, 2]  # the occurrence with 7 after it
    assert d.propose(toks, 10) == [5, 5, 7, 8, 9, 1, 2, 7, 8]  # none has 10: the earliest
    # a run of repeats: not the occurrence right before the suffix (one token after it)
    assert NgramDrafter(2, 2).propose([4] * 8, 3) == [4, 4, 4]
    # the 3-gram [1, 2, 3] wins over the more recent 1-gram [3]
    toks = [1, 2, 3, 4, 5, 3, 6, 1, 2, 3]
    assert d.propose(toks, 2) == [4, 5]
    assert NgramDrafter(1, 1).propose(toks, 2) == [6, 1]


def test_no_match_and_edges():
    d = NgramDrafter(2, 4)
    assert d.propose([1, 2, 3, 4], 3) == []  # no earlier bigram [3, 4]
    assert d.propose([5], 3) == [] and d.propose([], 3) == []
    assert d.propose([1, 1, 1], 0) == []
    assert d.propose([1, 1, 1], 2) == [1]  # [1, 1] at 0 is followed by one token
    with pytest.raises(ValueError, match="n-gram"):
        NgramDrafter(3, 2)


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, plainly: longest suffix first; the most recent earlier occurrence with
    k tokens after it, else the earliest."""
    L = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        starts = [i for i in range(L - n) if tokens[i : i + n] == suffix]
        if starts:
            whole = [i for i in starts if i + n + k <= L]
            i = whole[-1] if whole else starts[0]
            return tokens[i + n : i + n + k]
    return []


def test_matches_the_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(0, 6)
        assert NgramDrafter(lo, hi).propose(tokens, k) == _brute_force(tokens, k, lo, hi), (
            tokens, k, lo, hi)
