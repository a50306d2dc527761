"""Exercise 3, graded: top-k and top-p filtering (exercises/ex3_top_k_top_p.py).

Hand-worked rows probe the edges (ties at the k-th logit, the token that crosses
the nucleus boundary, ties with it, top-p on the distribution top-k left);
random rows are checked against a plain-Python oracle, with
top_p placed halfway between two cumulative masses so rounding cannot matter.
"""
import math
import random

import pytest
import torch

import exercises

pytestmark = pytest.mark.ex3
NEG_INF = float("-inf")


def run(logits, top_k, top_p):
    logits = torch.tensor(logits, dtype=torch.float32) if not isinstance(logits, torch.Tensor) else logits
    before = logits.clone()
    got = exercises.get("top_k_top_p")(logits, top_k, top_p)
    assert isinstance(got, torch.Tensor) and got.shape == logits.shape, "must return logits of the same shape [V]"
    assert torch.equal(logits, before), "the caller's logits changed: filter a copy (masked_fill), not in place"
    return before, got


def kept_set(x):
    return {i for i, v in enumerate(x.tolist()) if v != NEG_INF}


def check_keeps(logits, top_k, top_p, want):
    """Exactly the tokens in ``want`` survive, with their logits unchanged; the rest are -inf."""
    before, got = run(logits, top_k, top_p)
    assert kept_set(got) == set(want), f"top_k={top_k} top_p={top_p}: kept {sorted(kept_set(got))}, want {sorted(want)}"
    idx = torch.tensor(sorted(want))
    assert torch.equal(got[idx], before[idx]), "kept logits must keep their values"


def logits_of(probs):
    return [math.log(p) for p in probs]


def test_top_k_keeps_the_k_largest():
    check_keeps([0.5, -1.0, 2.0, 0.1, 1.5, -0.3], 3, 1.0, want={2, 4, 0})


def test_top_k_keeps_ties_with_the_kth():
    # the 2nd largest logit is 3.0, shared by three tokens: all three stay
    check_keeps([1.0, 3.0, 3.0, 3.0, 0.0], 2, 1.0, want={1, 2, 3})


def test_switched_off_is_the_identity():
    # in the second row the first token's probability rounds to 1 and the others' to almost or exactly 0, so
    # the running mass reaches 1.0 before them: top_p = 1 must keep them all the same
    for row in ([0.3, -2.0, 1.1, 0.0, -0.7, -3.0], [20.0, 0.0, -150.0, 1.0, -1.0, 2.0]):
        for top_k, top_p in ((-1, 1.0), (0, 1.0), (6, 1.0), (9, 1.0)):
            before, got = run(row, top_k, top_p)
            assert torch.equal(got, before), f"{row}: top_k={top_k}, top_p={top_p} must change nothing"


@pytest.mark.parametrize("top_p,want", [(0.45, {2}), (0.6, {2, 0}), (0.9, {2, 0, 4})])
def test_top_p_keeps_the_token_that_crosses_the_boundary(top_p, want):
    # probabilities 0.3 (token 0), 0.5 (token 2), 0.2 (token 4); tokens 1 and 3 are far below
    check_keeps(logits_of([0.3, 1e-4, 0.5, 1e-4, 0.2 - 2e-4]), -1, top_p, want)


def test_top_p_tiny_keeps_at_least_the_most_probable():
    check_keeps(logits_of([0.1, 0.6, 0.3]), -1, 1e-6, want={1})


def test_top_p_keeps_ties_with_the_last_token_kept():
    # 0.4 alone does not reach 0.5; the next token (0.3) crosses, and the other 0.3 is tied with it
    check_keeps(logits_of([0.3, 0.4, 0.3]), -1, 0.5, want={0, 1, 2})
    check_keeps([0.7] * 5, -1, 0.3, want=set(range(5)))


def test_top_p_uses_the_distribution_after_top_k():
    # top-k=2 leaves 0.4 and 0.3, renormalised to 4/7 and 3/7: 4/7 alone already reaches 0.5
    check_keeps(logits_of([0.1, 0.3, 0.2, 0.4]), 2, 0.5, want={3})


def test_the_callers_logits_are_not_changed():
    # the engine reuses its logits (e.g. to log them, or for the next request in the batch): both filters
    # active, and the input must come back exactly as it went in
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.5, -2.0, 1.0])
    before = logits.clone()
    got = exercises.get("top_k_top_p")(logits, 4, 0.7)
    assert torch.equal(logits, before), f"the input logits changed: {logits.tolist()}, were {before.tolist()}"
    assert got.data_ptr() != logits.data_ptr(), "something was filtered: return a new tensor"
    assert kept_set(got) == {3, 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("top_p,want", [(0.5, {1}), (0.75, {1, 3})])
def test_top_p_reached_exactly_keeps_no_more(dtype, top_p, want):
    # probabilities 0.125, 0.5, 0.125, 0.25: dyadic, so softmax gives the two largest exactly and the running
    # mass hits 0.5 and 0.75 exactly. The smallest set whose mass reaches top_p is complete there: the next
    # token (mass before it == top_p, not below) stays out.
    logits = torch.tensor([0.125, 0.5, 0.125, 0.25], dtype=torch.float64).log().to(dtype)
    assert logits.softmax(-1)[[1, 3]].tolist() == [0.5, 0.25], "test setup: softmax is not exact here"
    check_keeps(logits, -1, top_p, want)


@pytest.mark.parametrize("top_k", [0, -1, 5, 8])
def test_top_k_off_values_leave_only_the_nucleus(top_k):
    # top_k <= 0 or >= V (5 tokens here; 8 is beyond the vocabulary) filters nothing, and top-p still applies
    check_keeps(logits_of([0.3, 1e-4, 0.5, 1e-4, 0.2 - 2e-4]), top_k, 0.6, want={2, 0})


def oracle(logits, top_k, top_p):
    """Plain Python: the top-k threshold, then the nucleus over the renormalised survivors."""
    x = [float(v) for v in logits]
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else NEG_INF for v in x]
    if top_p < 1:
        m = max(x)
        e = [math.exp(v - m) for v in x]
        p = [ei / sum(e) for ei in e]
        mass, last = 0.0, None
        for pi in sorted(p, reverse=True):
            if mass >= top_p:
                break
            mass, last = mass + pi, pi
        x = [v if pi >= last else NEG_INF for v, pi in zip(x, p)]
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_rows_match_the_oracle(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(4):
        V = rng.choice([7, 32, 50])
        logits = torch.randn(V, generator=g) * rng.choice([0.5, 2.0])
        top_k = rng.choice([-1, 1, 3, V // 2, V])
        # top_p halfway between the masses of the i and i+1 most probable survivors of top-k
        surv = torch.tensor(oracle(logits.tolist(), top_k, 1.0)).double().softmax(-1).sort(descending=True).values
        cum = surv.cumsum(0).tolist()
        i = rng.randrange(0, max(1, int((surv > 1e-3).sum()) - 1))
        top_p = min(0.999, (cum[i] + (cum[i - 1] if i else 0.0)) / 2)
        before, got = run(logits, top_k, top_p)
        want = torch.tensor(oracle(before.tolist(), top_k, top_p))
        assert torch.equal(got, want), f"V={V} top_k={top_k} top_p={top_p:.4f}: kept {sorted(kept_set(got))}, " \
                                       f"want {sorted(kept_set(want))}"


@pytest.mark.parametrize("seed", [0, 1])
def test_random_rows_with_tied_logits_match_the_oracle(seed):
    # logits on a coarse grid, so many tokens tie, at the k-th logit and at the nucleus boundary alike
    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(100 + seed)
    for _ in range(6):
        V = rng.choice([6, 12, 40])
        logits = torch.randint(-3, 4, (V,), generator=g).float() / 2
        top_k = rng.choice([1, 2, 3, V // 2])
        surv = torch.tensor(oracle(logits.tolist(), top_k, 1.0)).double().softmax(-1).sort(descending=True).values
        cum = surv.cumsum(0).tolist()
        i = rng.randrange(0, max(1, int((surv > 0).sum()) - 1))
        top_p = rng.choice([1.0, min(0.999, (cum[i] + (cum[i - 1] if i else 0.0)) / 2)])
        before, got = run(logits, top_k, top_p)
        want = torch.tensor(oracle(before.tolist(), top_k, top_p))
        assert torch.equal(got, want), f"logits {before.tolist()} top_k={top_k} top_p={top_p:.4f}: " \
                                       f"kept {sorted(kept_set(got))}, want {sorted(kept_set(want))}"
