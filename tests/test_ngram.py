"""The rest of speculative.py: prompt lookup (ngram_propose), the expected-speedup formulas, SpecStats."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from minibatch.spec_decode.ngram import ngram_propose
from minibatch.spec_decode.rejection_sampler import rejection_sample
from minibatch.spec_decode.stats import SpecStats, expected_speedup, expected_tokens_per_step

# -- ngram_propose: exact expectations ---------------------------------------------------------------------------

# (tokens, k, n_max, n_min, expected proposal)
NGRAM_CASES = {
    "earliest match wins": ([1, 2, 9, 1, 2, 7, 5, 1, 2], 2, 2, 1, [9, 1]),
    "earliest match: k tokens even in a run": ([0, 0, 0, 0, 0, 0], 4, 3, 1, [0, 0, 0]),
    "longest n first": ([1, 2, 6, 0, 4, 1, 2, 8, 9, 4, 1, 2], 2, 3, 1, [8, 9]),
    "falls back to shorter n": ([3, 1, 7, 5, 1], 2, 3, 1, [7, 5]),
    "no match": ([1, 2, 3, 4], 3, 3, 1, []),
    "truncated at k": ([1, 2, 3, 4, 5, 1], 3, 2, 1, [2, 3, 4]),
    "truncated at the end of the context": ([7, 8, 9, 7], 5, 1, 1, [8, 9, 7]),
    "trailing n-gram itself not matched": ([3, 1, 2], 2, 2, 1, []),
    "overlapping repeat": ([1, 1, 1], 4, 2, 1, [1]),
    "n_min excludes short matches": ([3, 1, 7, 5, 1], 2, 3, 2, []),
    "k = 0": ([1, 2, 1, 2], 0, 2, 1, []),
    "empty context": ([], 3, 3, 1, []),
    "one token": ([5], 3, 3, 1, []),
}


@pytest.mark.parametrize("case", NGRAM_CASES, ids=list(NGRAM_CASES))
def test_ngram_cases(case):
    tokens, k, n_max, n_min, want = NGRAM_CASES[case]
    before = list(tokens)
    assert ngram_propose(tokens, k, n_max, n_min) == want
    assert tokens == before, "the context must not be modified"


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=30), k=st.integers(0, 5), n_max=st.integers(1, 4))
def test_ngram_proposal_follows_the_earliest_longest_match(tokens, k, n_max):
    got = ngram_propose(tokens, k, n_max, 1)
    L = len(tokens)
    matches = [(n, s) for n in range(1, min(n_max, L - 1) + 1) for s in range(L - n)
               if tokens[s:s + n] == tokens[L - n:]]
    if not matches or k == 0:
        assert got == []
        return
    n, s = max(matches, key=lambda m: (m[0], -m[1]))     # the longest n, then the earliest start
    assert got == tokens[s + n:s + n + k]
    assert 1 <= len(got) <= k


@pytest.mark.parametrize("args,match", [((-1, 3, 1), "k must be"), ((2, 0, 1), "n_min"), ((2, 2, 3), "n_min"),
                                        ((2, 3, 0), "n_min")])
def test_ngram_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        ngram_propose([1, 2, 1], *args)


# -- the formulas ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_expected_tokens_matches_the_closed_form(alpha, k):
    assert expected_tokens_per_step(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_expected_tokens_limits():
    assert expected_tokens_per_step(1.0, 5) == 6                # every draft accepted, plus the bonus
    assert expected_tokens_per_step(0.0, 5) == 1                # only the replacement token
    assert expected_tokens_per_step(1 - 1e-12, 3) == pytest.approx(4)
    vals = [expected_tokens_per_step(0.7, k) for k in range(8)]
    assert all(a < b for a, b in zip(vals, vals[1:])) and vals[-1] < 1 / (1 - 0.7)   # bounded by 1/(1-alpha)


def test_expected_tokens_agrees_with_the_sampler():
    # Acceptance probability exactly alpha at every position: V = 2, p = [alpha, 1 - alpha], q one-hot at 0.
    alpha, k, rows = 0.6, 3, 6000
    p = torch.tensor([alpha, 1 - alpha], dtype=torch.float64).expand(rows, k + 1, 2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        _, n = rejection_sample(torch.zeros(rows, k, dtype=torch.int64), None, p)
    tokens = (n + 1).double()
    want = expected_tokens_per_step(alpha, k)
    assert abs(float(tokens.mean()) - want) < 4 * float(tokens.std()) / math.sqrt(rows)


def test_expected_speedup():
    assert expected_speedup(0.5, 1, 0.0) == pytest.approx(1.5)                  # free draft: tokens per step
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.4))
    assert expected_speedup(0.0, 3, 0.2) < 1                                   # useless drafts cost time
    assert expected_speedup(0.9, 0, 0.5) == 1                                  # k = 0 is plain decoding
    ks = range(1, 30)
    best = max(ks, key=lambda k: expected_speedup(0.8, k, 0.05))
    assert 1 < best < 29, "an optimal k exists: more drafts cost more than they return"


@pytest.mark.parametrize("fn,args,match", [
    (expected_tokens_per_step, (1.2, 3), "alpha"), (expected_tokens_per_step, (-0.1, 3), "alpha"),
    (expected_tokens_per_step, (0.5, -1), "k must"), (expected_speedup, (0.5, 2, -1.0), "cost ratio"),
])
def test_formula_bad_arguments(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


# -- SpecStats -----------------------------------------------------------------------------------------------------

def test_spec_stats_counts_and_merges():
    a = SpecStats().add(4, 3, 4).add(4, 0, 1)
    assert (a.proposed, a.accepted, a.num_steps, a.emitted) == (8, 3, 2, 5)
    assert a.acceptance_rate == 3 / 8 and a.mean_tokens_per_step == 2.5
    b = SpecStats().add(2, 2, 3)
    total = SpecStats().merge(a).merge(b)
    # the formula at alpha = 1/2, averaged over the steps' own k: two steps of k = 4, one of k = 2
    formula = (2 * (1 + 1 / 2 + 1 / 4 + 1 / 8 + 1 / 16) + (1 + 1 / 2 + 1 / 4)) / 3
    d = total.to_dict()
    # by draft position: reached [3, 2, 1, 1] times (4/4, then 1 of 4 rejected at once, then 2/2), accepted [2, 2, 1, 0]
    assert d.pop("acceptance_by_position") == pytest.approx([2 / 3, 1.0, 1.0, 0.0])
    assert (total.reached_at, total.accepted_at) == ([3, 2, 1, 1], [2, 2, 1])
    assert d == pytest.approx({"proposed": 10, "accepted": 5, "num_steps": 3, "emitted": 8,
                               "acceptance_rate": 0.5, "mean_tokens_per_step": 8 / 3,
                               "expected_tokens_per_step": formula})
    assert total.steps_by_k == {4: 2, 2: 1}
    assert (a.proposed, b.proposed) == (8, 2), "merge leaves its argument alone"
    assert SpecStats().acceptance_rate == 0.0 and SpecStats().mean_tokens_per_step == 0.0
    assert SpecStats().expected_tokens_per_step == 0.0


def test_spec_stats_counts_a_tree_by_depth():
    # 8-node trees: a path of 2 that stopped at a node with children (3 depths judged), a path of 1 that reached a
    # leaf (1 judged: nothing below it to reject), nothing accepted (the root's children judged: 1)
    t = SpecStats().add(8, 2, 3, judged=3).add(8, 1, 2, judged=1).add(8, 0, 1, judged=1)
    assert (t.reached_at, t.accepted_at) == ([3, 1, 1], [2, 1])
    assert t.acceptance_by_position == pytest.approx([2 / 3, 1.0, 0.0])
    assert t.acceptance_rate == 3 / 24 and t.mean_tokens_per_step == 2.0 and t.tree_steps == 3
    assert t.expected_tokens_per_step is None, "a chain's formula says nothing about a tree"
    assert SpecStats().merge(t).tree_steps == 3 and not t.steps_by_k
    for judged in (0, 4):
        with pytest.raises(ValueError, match="judges"):
            SpecStats().add(8, 2, 3, judged=judged)


def test_spec_stats_formula_matches_a_simulation_of_independent_acceptances():
    """Steps whose drafts are accepted i.i.d. with probability alpha: measured tokens/step approach the formula."""
    rng, alpha, k = np.random.default_rng(0), 0.7, 5
    s = SpecStats()
    for _ in range(20000):
        accepted = int(np.argmin(np.append(rng.random(k) < alpha, False)))   # leading run of acceptances
        s.add(k, accepted, accepted + 1)
    assert abs(s.acceptance_rate - 0.7) > 0.01     # alpha measured per draft is not the per-step acceptance chance
    assert s.mean_tokens_per_step == pytest.approx(expected_tokens_per_step(alpha, k), rel=0.02)


def test_spec_stats_rejects_impossible_counts():
    s = SpecStats().add(2, 1, 2)
    for args in [(2, 3, 1), (2, -1, 1), (1, 1, -1)]:
        with pytest.raises(ValueError):
            s.add(*args)
    assert s.to_dict()["proposed"] == 2 and s.num_steps == 1, "a failed add changes nothing"
    with pytest.raises(TypeError):
        s.merge({"proposed": 1})
    assert np.isclose(s.acceptance_rate, 0.5)
