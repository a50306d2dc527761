"""Exercise 5, graded: prompt lookup decoding (exercises/ex5_ngram.py).

Hand-worked token lists probe the rules one at a time (the earliest match,
longer n-grams first, the trailing n-gram not matching itself, an overlapping
earlier match, the context running out); random repetitive lists are checked
against an oracle written the other way round (collect every match, then pick
the longest and earliest).
"""
import random

import pytest

import exercises

pytestmark = pytest.mark.ex5


def propose(tokens, k, n_max=3, n_min=1):
    arg = list(tokens)
    got = exercises.get("ngram")(arg, k, n_max, n_min)
    assert arg == list(tokens), "the caller's token list changed: it is the sequence itself, read it only"
    assert isinstance(got, list) and all(isinstance(t, int) for t in got), f"must return a list of ints, got {got!r}"
    return got


CASES = {  # name: (tokens, k, n_max, n_min, want)
    "trigram_match": ([1, 2, 3, 4, 1, 2, 3], 2, 3, 1, [4, 1]),
    "earliest_match_wins": ([1, 2, 5, 1, 2, 6, 1, 2], 1, 2, 1, [5]),
    "earliest_match_has_more_after_it": ([3, 3, 3, 3, 3], 3, 2, 1, [3, 3, 3]),
    "longest_ngram_first": ([2, 3, 7, 9, 4, 2, 3, 8, 4, 2, 3], 2, 3, 1, [8, 4]),
    "falls_back_to_shorter": ([5, 1, 2, 8, 6, 2], 3, 3, 1, [8, 6, 2]),
    "context_ends_before_k": ([5, 6, 5], 3, 3, 1, [6, 5]),
    "overlapping_earlier_match": ([1, 1, 1, 1], 2, 3, 1, [1]),
    "no_match": ([1, 2, 3, 4], 3, 3, 1, []),
    "n_min_forbids_unigrams": ([1, 2, 3, 1], 3, 3, 2, []),
    "n_max_1_unigram": ([7, 8, 9, 7, 3, 7], 2, 1, 1, [8, 9]),
    "k_zero": ([1, 2, 1, 2], 0, 3, 1, []),
    "too_short": ([4], 3, 3, 1, []),
    # ids are bytes (0..255), not digits: "1, 2" is not inside "11, 2", and 12 is one token
    "multi_digit_ids": ([2, 9, 11, 2, 7, 3, 1, 2], 2, 3, 1, [9, 11]),
    "bytes_of_hello_he": ([104, 101, 108, 108, 111, 32, 104, 101], 3, 3, 1, [108, 108, 111]),
    "two_digit_false_match": ([12, 1, 5, 21, 2, 6, 1, 2], 2, 2, 2, []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hand_worked(case):
    tokens, k, n_max, n_min, want = CASES[case]
    assert propose(tokens, k, n_max, n_min) == want


def oracle(tokens, k, n_max, n_min):
    """Every (n, start) whose n-gram equals the trailing one, start before it; the longest, then earliest, wins."""
    L = len(tokens)
    if k == 0:
        return []
    hits = [(n, s) for n in range(n_min, min(n_max, L - 1) + 1) for s in range(0, L - n)
            if tokens[s:s + n] == tokens[L - n:]]
    if not hits:
        return []
    n, s = max(hits, key=lambda h: (h[0], -h[1]))
    return tokens[s + n:s + n + k]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_repetitive_contexts(seed):
    rng = random.Random(seed)
    for _ in range(60):
        vocab = rng.choice([2, 3, 5])                         # a small vocabulary repeats a lot
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        k, n_min = rng.randrange(0, 6), rng.randrange(1, 3)
        n_max = n_min + rng.randrange(0, 4)
        want = oracle(tokens, k, n_max, n_min)
        assert propose(tokens, k, n_max, n_min) == want, f"tokens {tokens} k={k} n_max={n_max} n_min={n_min}"


@pytest.mark.parametrize("seed", [0, 1])
def test_random_contexts_with_multi_digit_ids(seed):
    # ids whose decimal digits overlap (1, 11, 12, 21, 112, ...): a search over the ids written as a string
    # finds n-grams that are not there
    rng = random.Random(50 + seed)
    for _ in range(60):
        vocab = rng.choice([[1, 11, 2], [1, 12, 21, 2], [1, 11, 111, 112, 12, 2, 121, 211]])
        tokens = [rng.choice(vocab) for _ in range(rng.randrange(1, 30))]
        k, n_min = rng.randrange(1, 6), rng.randrange(1, 3)
        n_max = n_min + rng.randrange(0, 4)
        want = oracle(tokens, k, n_max, n_min)
        assert propose(tokens, k, n_max, n_min) == want, f"tokens {tokens} k={k} n_max={n_max} n_min={n_min}"
