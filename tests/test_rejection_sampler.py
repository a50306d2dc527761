"""The rejection sampler: exact greedy schedules, losslessness in distribution, seeded reproducibility.

Losslessness is the whole point of speculative sampling (Leviathan et al. 2023, Appendix A.1): whatever
the draft distribution q, every emitted token must be distributed as the target's p. The statistical
tests sample many rows in one call (each row is an independent trial) and compare the empirical
distribution of an output position with p: total-variation distance that shrinks like 1/sqrt(N), far
below the distance to unrelated distributions, and a chi-square goodness-of-fit test that does not
reject. Everything runs at fixed seeds, so the tests are deterministic.
"""
import numpy as np
import pytest
import torch

from minibatch.spec_decode.rejection_sampler import rejection_sample

V = 8
N = 100_000                     # rows (independent trials) per statistical call; ~4 s each on a laptop CPU
CHI2_CRIT_0001 = {7: 24.322}    # chi-square 0.999 quantile for V - 1 = 7 degrees of freedom (from tables)


# -- helpers --------------------------------------------------------------------------------------------------

def dirichlet(seed, *shape):
    """Random distributions over V tokens, [*shape, V], float64 (signed differences p - q are then generic)."""
    return torch.from_numpy(np.random.default_rng(seed).dirichlet(np.ones(V), size=shape))


def one_hot_rows(argmaxes, soft=True):
    """[len, V] distributions whose argmax is each given id; soft = not one-hot (greedy must use argmax)."""
    rows = torch.full((len(argmaxes), V), 0.5 / (V - 1), dtype=torch.float64) if soft else \
        torch.zeros(len(argmaxes), V, dtype=torch.float64)
    for i, a in enumerate(argmaxes):
        rows[i, a] = 0.5 if soft else 1.0
    return rows


def run_many(p, q, n=N, seed=0, onehot=False, draft_dist=None):
    """N independent rows with the same p [k+1, V] and q [k, V]; drafts drawn from q (or from draft_dist)."""
    k = p.shape[0] - 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        src = q if draft_dist is None else draft_dist                        # [k, V]
        drafts = torch.multinomial(src, n, replacement=True).T.contiguous()  # [n, k]
        P = p.expand(n, k + 1, V)
        Q = None if onehot else q.expand(n, k, V)
        return rejection_sample(drafts, Q, P)


def empirical(tokens):
    return np.bincount(np.asarray(tokens), minlength=V) / len(tokens)


def tv(a, b):
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def assert_distributed_as(tokens, p, what):
    """tokens (1-D) look like samples of p: TV shrinks with N, small vs sqrt(V/N), far from random, chi-square."""
    tokens, p = np.asarray(tokens), np.asarray(p)
    n = len(tokens)
    assert n >= 2000, f"{what}: too few samples ({n}) for the test to mean anything"
    tv_small, tv_full = tv(empirical(tokens[:n // 100]), p), tv(empirical(tokens), p)   # 1e3 -> 1e5 rows
    # E[TV] <= 0.4 sqrt(V / n) for a correct sampler; a wrong residual or bonus is off by ~0.05-0.3.
    assert tv_full < np.sqrt(V / n), f"{what}: TV {tv_full:.4f} to p is too large for n = {n}"
    assert tv_full < tv_small, f"{what}: TV did not shrink with more samples ({tv_small:.4f} -> {tv_full:.4f})"
    others = [tv(empirical(tokens), r) for r in dirichlet(12345, 10).numpy()]
    assert tv_full < 0.2 * min(others), f"{what}: as close to random distributions as to p"
    expected = n * p
    assert expected.min() >= 5, "chi-square needs >= 5 expected counts per cell"
    chi2 = float((((np.bincount(tokens, minlength=V) - expected) ** 2) / expected).sum())
    assert chi2 < CHI2_CRIT_0001[V - 1], f"{what}: chi-square {chi2:.1f} rejects p at the 0.001 level"


# -- greedy: exact schedules -------------------------------------------------------------------------------------

# (drafts, target argmax at positions 1..k+1, expected row, expected num_accepted)
GREEDY_CASES = {
    "all accepted, bonus added": ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),
    "first rejected": ([5, 2, 3], [1, 2, 3, 4], [1, -1, -1, -1], 0),
    "mismatch in the middle": ([1, 5, 3], [1, 2, 3, 4], [1, 2, -1, -1], 1),
    "last rejected": ([1, 2, 0], [1, 2, 3, 4], [1, 2, 3, -1], 2),
    "k = 0": ([], [6], [6], 0),
}


@pytest.mark.parametrize("soft", [True, False], ids=["soft-target", "one-hot-target"])
@pytest.mark.parametrize("case", GREEDY_CASES, ids=list(GREEDY_CASES))
def test_greedy_cases(case, soft):
    drafts, argmax, want, want_n = GREEDY_CASES[case]
    ids = torch.tensor([drafts], dtype=torch.int64).view(1, len(drafts))
    target = one_hot_rows(argmax, soft)[None]
    q = dirichlet(1, 1, len(drafts))             # greedy rows must ignore q
    g = torch.Generator().manual_seed(3)
    g_state, default_state = g.get_state(), torch.get_rng_state()
    out, n = rejection_sample(ids, q, target, [g], greedy=[True])
    assert out.tolist() == [want] and n.tolist() == [want_n]
    assert torch.equal(g.get_state(), g_state), "greedy rows must draw nothing"
    assert torch.equal(torch.get_rng_state(), default_state), "greedy rows must draw nothing"


def test_greedy_mixed_k_in_one_batch():
    # k = 3; rows have k_b = 3, 1, 0, 2; padding is -1 and must never be used as an index.
    ids = torch.tensor([[1, 2, 3], [7, -1, -1], [-1, -1, -1], [4, 0, -1]])
    argmax = [[1, 2, 3, 4], [7, 5, 0, 0], [2, 3, 3, 3], [4, 1, 6, 6]]
    target = torch.stack([one_hot_rows(a) for a in argmax])
    out, n = rejection_sample(ids, None, target, num_draft_tokens=[3, 1, 0, 2], greedy=[True] * 4)
    assert out.tolist() == [[1, 2, 3, 4], [7, 5, -1, -1], [2, -1, -1, -1], [4, 1, -1, -1]]
    assert n.tolist() == [3, 1, 0, 1]


# -- sampled rows: lossless in distribution ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_first_token_is_distributed_as_p(seed):
    p, q = dirichlet(100 + seed, 2), dirichlet(200 + seed, 1)        # p_1, p_2 (bonus); q_1
    out, n = run_many(p, q, seed=seed)
    assert_distributed_as(out[:, 0].numpy(), p[0].numpy(), "first token")
    accept_rate = float(n.double().mean())
    alpha = float(torch.minimum(p[0], q[0]).sum())                   # P(accept) = sum_x min(p(x), q(x))
    assert abs(accept_rate - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / N)


def test_later_positions_are_distributed_as_their_p():
    # k = 2: given the first token was accepted the second is p_2; given both were, the bonus is p_3.
    p, q = dirichlet(7, 3), dirichlet(8, 2)
    out, n = run_many(p, q, seed=5)
    assert_distributed_as(out[n >= 1, 1].numpy(), p[1].numpy(), "second token | first accepted")
    assert_distributed_as(out[n == 2, 2].numpy(), p[2].numpy(), "bonus token | all accepted")
    pos = torch.arange(3)[None, :]
    assert bool((out[pos <= n[:, None]] >= 0).all()) and bool((out[pos > n[:, None]] == -1).all())


def test_one_hot_drafts_are_lossless():
    # No q (n-gram proposer): any way of choosing drafts is fine; draw them from an unrelated distribution.
    p, r = dirichlet(21, 2), dirichlet(22, 1)
    out, n = run_many(p, None, seed=9, onehot=True, draft_dist=r)
    assert_distributed_as(out[:, 0].numpy(), p[0].numpy(), "first token, one-hot q")


def test_p_equal_q_accepts_everything():
    k, rows = 3, 20_000
    p = dirichlet(31, k + 1)
    out, n = run_many(p, p[:k], n=rows, seed=2)
    assert n.tolist() == [k] * rows
    with torch.random.fork_rng():                                      # the drafts run_many drew
        torch.manual_seed(2)
        drafts = torch.multinomial(p[:k], rows, replacement=True).T
    assert torch.equal(out[:, :k], drafts)
    assert_distributed_as(out[:, k].numpy(), p[k].numpy(), "bonus token, p = q")


def test_k0_rows_sample_p1_and_ignore_unused_positions():
    # num_draft_tokens = 0 everywhere: the one output token comes from p_1; q and p past it may be garbage.
    k, rows = 2, 4000
    p = dirichlet(41, 1)
    P = torch.full((rows, k + 1, V), float("nan"), dtype=torch.float64)
    P[:, 0] = p[0]
    Q = torch.full((rows, k, V), float("nan"), dtype=torch.float64)
    ids = torch.full((rows, k), -1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out, n = rejection_sample(ids, Q, P, num_draft_tokens=[0] * rows)
    assert n.tolist() == [0] * rows and bool((out[:, 1:] == -1).all())
    assert tv(empirical(out[:, 0].numpy()), p[0].numpy()) < np.sqrt(V / rows)


# -- reproducibility ---------------------------------------------------------------------------------------------

def seeded_rows(seeds, k=4):
    """Row i has its own p, q and drafts (a function of seeds[i] only)."""
    ps = torch.stack([dirichlet(1000 + s, k + 1)[:, :] for s in seeds])
    qs = torch.stack([dirichlet(2000 + s, k) for s in seeds])
    drafts = torch.stack([torch.multinomial(q, 1, generator=torch.Generator().manual_seed(s))[:, 0]
                          for q, s in zip(qs, seeds)])
    return drafts, qs, ps


def test_seeded_rows_do_not_depend_on_the_batch():
    seeds = [3, 17, 29, 40, 51, 62]
    drafts, qs, ps = seeded_rows(seeds)
    alone = [rejection_sample(drafts[i:i + 1], qs[i:i + 1], ps[i:i + 1], [torch.Generator().manual_seed(s)])[0][0]
             for i, s in enumerate(seeds)]
    order = [4, 0, 5, 2, 1, 3]                                          # another order, plus unseeded strangers
    d2, q2, p2 = seeded_rows([99, 98])
    batch_ids = torch.cat([drafts[order], d2])
    gens = [torch.Generator().manual_seed(seeds[i]) for i in order] + [None, None]
    default_state = torch.get_rng_state()
    out, _ = rejection_sample(batch_ids, torch.cat([qs[order], q2]), torch.cat([ps[order], p2]), gens)
    for row, i in enumerate(order):
        assert torch.equal(out[row], alone[i]), f"seeded row {seeds[i]} changed with its batch"
    assert not torch.equal(torch.get_rng_state(), default_state), "unseeded rows use the default generator"


def test_seeded_rows_draw_only_from_their_generator():
    seeds = list(range(20))
    drafts, qs, ps = seeded_rows(seeds)
    default_state = torch.get_rng_state()
    a, _ = rejection_sample(drafts, qs, ps, [torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(torch.get_rng_state(), default_state), "a seeded row drew from the default generator"
    b, _ = rejection_sample(drafts, qs, ps, [torch.Generator().manual_seed(s + 500) for s in seeds])
    assert not torch.equal(a, b), "other seeds should change some of 20 sampled rows"


def test_mixed_k_batch_equals_each_row_alone():
    seeds, k = [5, 6, 7, 8], 4
    drafts, qs, ps = seeded_rows(seeds, k)
    ks = [4, 0, 2, 1]
    ids = drafts.clone()
    for b, kb in enumerate(ks):
        ids[b, kb:] = -1
    out, n = rejection_sample(ids, qs, ps, [torch.Generator().manual_seed(s) for s in seeds], num_draft_tokens=ks)
    for b, (kb, s) in enumerate(zip(ks, seeds)):
        P = torch.cat([ps[b, :kb], ps[b, kb:kb + 1]])[None]           # the row as if its k were k_b
        o, m = rejection_sample(drafts[b:b + 1, :kb], qs[b:b + 1, :kb], P, [torch.Generator().manual_seed(s)])
        assert out[b, :kb + 1].tolist() == o[0].tolist() and int(n[b]) == int(m[0])
        assert out[b, kb + 1:].tolist() == [-1] * (k - kb)


# -- bad input: one clear error, nothing drawn ---------------------------------------------------------------------

def _good():
    return torch.tensor([[1, 2]]), dirichlet(1, 1, 2), dirichlet(2, 1, 3)


@pytest.mark.parametrize("mutate,match", [
    (lambda d, q, p: (d[0], q, p), "2-D"),
    (lambda d, q, p: (d.int(), q, p), "int64"),
    (lambda d, q, p: (d, q, p[:, :2]), "target_probs"),
    (lambda d, q, p: (d, q[..., :4], p), "draft_probs"),
    (lambda d, q, p: (d, q.to("meta"), p), "on meta"),
    (lambda d, q, p: (torch.tensor([[1, 8]]), q, p), "vocabulary"),
    (lambda d, q, p: (d, q, p * 2), "sum to 1"),
    (lambda d, q, p: (d, -q, p), "non-negative"),
])
def test_bad_inputs_raise(mutate, match):
    d, q, p = mutate(*_good())
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    with pytest.raises(ValueError, match=match):
        rejection_sample(d, q, p, [g])
    assert torch.equal(g.get_state(), state)


@pytest.mark.parametrize("kw,match", [
    (dict(num_draft_tokens=[3]), "num_draft_tokens"),
    (dict(num_draft_tokens=[-1]), "num_draft_tokens"),
    (dict(num_draft_tokens=[1, 1]), "num_draft_tokens has 2"),
    (dict(greedy=[True, False]), "greedy has 2"),
    (dict(generators=[None, None]), "generators has 2"),
])
def test_bad_per_row_lists_raise(kw, match):
    d, q, p = _good()
    with pytest.raises(ValueError, match=match):
        rejection_sample(d, q, p, **kw)
