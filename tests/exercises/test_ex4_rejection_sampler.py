"""Exercise 4, graded: the rejection sampler (exercises/ex4_rejection_sampler.py).

Greedy rows and rows whose acceptance has probability 0 or 1 have one right
answer, checked table by table. Random rows are
checked by what the method promises: the first emitted token is distributed as
p (Leviathan et al., Appendix A.1), the bonus token as p_{k+1}, and a seeded row
samples the same tokens alone or in any batch.
"""
import pytest
import torch

import exercises

pytestmark = pytest.mark.ex4
V = 6


def peaked(argmaxes, V=V):
    """[n, V]: 0.5 at each argmax, 0.1 elsewhere, so a non-argmax token is still possible."""
    p = torch.full((len(argmaxes), V), 0.5 / (V - 1), dtype=torch.float64)
    p[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.5
    return p


def one_hot(tokens, V=V):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).double()


def sample(*args, **kw):
    out = exercises.get("rejection_sampler")(*args, **kw)
    assert isinstance(out, tuple) and len(out) == 2, "return (tokens, num_accepted)"
    tokens, n = out
    B, k = args[0].shape
    assert tokens.dtype == torch.int64 and tuple(tokens.shape) == (B, k + 1), \
        f"tokens must be int64 [B, k+1] = [{B}, {k + 1}], got {tokens.dtype} {tuple(tokens.shape)}"
    assert n.dtype == torch.int64 and tuple(n.shape) == (B,), f"num_accepted must be int64 [{B}]"
    return tokens.tolist(), n.tolist()


def random_q(B, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, k, V, generator=g, dtype=torch.float64).add(0.05).softmax(-1)


GREEDY = {  # name: (drafts, argmax of p_1..p_{k+1}, want tokens, want num_accepted)
    "all_accepted_plus_bonus": ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),
    "first_rejected": ([0, 2, 3], [1, 2, 3, 4], [1, -1, -1, -1], 0),
    "middle_mismatch": ([1, 5, 3], [1, 2, 3, 4], [1, 2, -1, -1], 1),
    "last_mismatch": ([1, 2, 0], [1, 2, 3, 4], [1, 2, 3, -1], 2),
    "no_drafts_k0": ([], [4], [4], 0),
}


@pytest.mark.parametrize("with_q", [False, True], ids=["ngram", "draft_model"])
@pytest.mark.parametrize("case", list(GREEDY))
def test_greedy_table(case, with_q):
    drafts, argmaxes, want, want_n = GREEDY[case]
    k = len(drafts)
    ids = torch.tensor([drafts], dtype=torch.int64).view(1, k)
    p = peaked(argmaxes)[None]                              # [1, k+1, V]
    q = random_q(1, k, seed=7) if with_q else None          # greedy ignores q
    args = (ids, q, p, [torch.Generator().manual_seed(0)])
    assert sample(*args, greedy=[True]) == ([want], [want_n])


def test_greedy_mixed_k_reads_only_the_first_k_b_drafts():
    # row 1 is padded with real tokens that *would* be accepted (5, 0 are the argmaxes there): k_b = 1 says stop
    ids = torch.tensor([[1, 2, 3], [2, 5, 0], [-1, -1, -1], [4, 0, -1]])
    argmaxes = [[1, 2, 3, 4], [2, 5, 0, 1], [3, 0, 1, 2], [4, 1, 2, 3]]
    p = torch.stack([peaked(a) for a in argmaxes])          # [4, 4, V]
    kw = dict(num_draft_tokens=[3, 1, 0, 2], greedy=[True] * 4)
    want = ([[1, 2, 3, 4], [2, 5, -1, -1], [3, -1, -1, -1], [4, 1, -1, -1]], [3, 1, 0, 1])
    assert sample(ids, None, p, **kw) == want


@pytest.mark.parametrize("with_q", [False, True], ids=["ngram", "draft_model"])
def test_certain_acceptance_then_bonus(with_q):
    # p == q at every draft (n-gram: p one-hot at the draft): accepted with probability 1; the bonus is certain too
    drafts = [[3, 0, 2], [1, 1, 4]]
    ids = torch.tensor(drafts)
    q = random_q(2, 3, seed=1) if with_q else None
    p = torch.cat([q if with_q else one_hot(drafts), one_hot([[5], [0]])], dim=1)   # [2, 4, V]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    want = ([[3, 0, 2, 5], [1, 1, 4, 0]], [3, 3])
    assert sample(ids, q, p, gens) == want


@pytest.mark.parametrize("with_q", [False, True], ids=["ngram", "draft_model"])
def test_certain_rejection_draws_from_the_residual(with_q):
    # position 0: p == q (accepted); position 1: p(x) = 0, so x is rejected and the residual is one-hot at 3
    ids = torch.tensor([[2, 1, 0]])
    q = torch.full((1, 3, V), 1.0 / V, dtype=torch.float64) if with_q else None
    p0 = q[:, 0] if with_q else one_hot([2])
    p = torch.stack([p0[0], one_hot([3])[0], one_hot([4])[0], one_hot([5])[0]])[None]
    want = ([[2, 3, -1, -1]], [1])
    assert sample(ids, q, p, [torch.Generator().manual_seed(0)]) == want


P = torch.tensor([0.5, 0.25, 0.15, 0.10], dtype=torch.float64)      # the target at the first position
P_BONUS = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)   # the target after it
Q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)         # the draft model (far from P on purpose)


def first_token_frequencies(fn, with_q, N=3000):
    """Frequencies of the first emitted token over N rows, and of the bonus token over the rows that got one."""
    g = torch.Generator().manual_seed(0)
    if with_q:
        drafts = torch.multinomial(Q, N, replacement=True, generator=g)[:, None]   # x ~ q, as the theorem assumes
        q = Q.expand(N, 1, 4).clone()
    else:
        drafts = (torch.arange(N) % 4)[:, None]                                     # any x: q is one-hot at it
        q = None
    p = torch.stack([P, P_BONUS]).expand(N, 2, 4).clone()
    torch.manual_seed(1234)                                  # generators=None: the global generator
    tokens, n = fn(drafts, q, p)
    tokens, n = torch.as_tensor(tokens), torch.as_tensor(n)
    return tokens[:, 0], tokens[n == 1, 1]


def assert_distributed_as(samples, want, what):
    """Each token's frequency within 5 standard errors of its probability (a correct sampler fails ~1e-6)."""
    n = max(1, samples.numel())
    freq = torch.bincount(samples.clamp(min=0), minlength=4)[:4].double() / n
    tol = 5 * (want * (1 - want) / n).sqrt() + 0.005
    assert samples.numel() > 100 and bool(((freq - want).abs() <= tol).all()), \
        f"{what}: frequencies {[round(f, 3) for f in freq.tolist()]} over {samples.numel()} draws, " \
        f"want {want.tolist()}"


@pytest.mark.parametrize("with_q", [False, True], ids=["ngram", "draft_model"])
def test_first_token_is_distributed_as_the_target(with_q):
    fn = exercises.get("rejection_sampler")
    first, bonus = first_token_frequencies(fn, with_q)
    assert_distributed_as(first, P, "the first emitted token")
    assert_distributed_as(bonus, P_BONUS, "the bonus token (rows with every draft accepted)")


def test_seeded_rows_sample_the_same_alone_or_in_a_batch():
    g = torch.Generator().manual_seed(5)
    B, k = 5, 3
    p = torch.rand(B, k + 1, V, generator=g, dtype=torch.float64).mul(3).softmax(-1)
    q = random_q(B, k, seed=6)
    ids = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
    seeds = [11, 12, 13, 14, 15]
    fn = exercises.get("rejection_sampler")
    batch = sample(ids, q, p, [torch.Generator().manual_seed(s) for s in seeds])
    for b in range(B):
        alone = sample(ids[b:b + 1], q[b:b + 1], p[b:b + 1], [torch.Generator().manual_seed(seeds[b])])
        assert alone == ([batch[0][b]], [batch[1][b]]), f"row {b} differs alone and in the batch"
    rev = fn(ids.flip(0), q.flip(0), p.flip(0), [torch.Generator().manual_seed(s) for s in seeds[::-1]])
    assert rev[0].flip(0).tolist() == batch[0], "the batch order changed a seeded row's tokens"


@pytest.mark.parametrize("with_q", [False, True], ids=["ngram", "draft_model"])
def test_sampled_rows_with_fewer_drafts_than_k(with_q):
    # sampled (not greedy) rows with k_b = 3, 1, 0, 2 of k = 3 drafts. Every draft a row owns is accepted
    # for sure (p == q there; n-gram: p one-hot at it) and every bonus distribution, at index k_b, is
    # one-hot, so there is one right answer. Past k_b the drafts are real tokens that p would accept and
    # the draft probabilities are NaN: a row must not read them.
    drafts = [[3, 0, 2], [2, 5, 0], [-1, -1, -1], [1, 1, 3]]
    ks = [3, 1, 0, 2]
    bonus = [5, 4, 4, 3]
    g = torch.Generator().manual_seed(3)
    q = torch.full((4, 3, V), float("nan"), dtype=torch.float64) if with_q else None
    p = torch.zeros(4, 4, V, dtype=torch.float64)
    for b in range(4):
        for i in range(4):
            if i < ks[b]:                                        # the row's own drafts: certain acceptance
                dist = torch.rand(V, generator=g, dtype=torch.float64).add(0.1)
                dist = dist / dist.sum() if with_q else one_hot([drafts[b][i]])[0]
                p[b, i] = dist
                if with_q:
                    q[b, i] = dist
            elif i == ks[b]:                                     # its bonus distribution
                p[b, i] = one_hot([bonus[b]])[0]
            else:                                                # past it: would accept the padding draft
                p[b, i] = one_hot([drafts[b][i] if i < 3 and drafts[b][i] >= 0 else 0])[0]
    ids = torch.tensor(drafts)
    want = ([[3, 0, 2, 5], [2, 4, -1, -1], [4, -1, -1, -1], [1, 1, 3, -1]], [3, 1, 0, 2])
    gens = [torch.Generator().manual_seed(10 + b) for b in range(4)]
    assert sample(ids, q, p, gens, num_draft_tokens=ks, greedy=[False] * 4) == want


@pytest.mark.parametrize("with_q", [False, True], ids=["ngram", "draft_model"])
def test_first_and_bonus_token_with_one_draft_of_three(with_q):
    # k = 3 but every row owns one draft: the first token ~ p_1, and the bonus (rows that accepted it) ~ p_2;
    # the positions past it hold a different law (one-hot at token 3), which nothing may draw from
    N = 3000
    g = torch.Generator().manual_seed(0)
    if with_q:
        first = torch.multinomial(Q, N, replacement=True, generator=g)[:, None]
        q = torch.cat([Q.expand(N, 1, 4), torch.full((N, 2, 4), 0.25, dtype=torch.float64)], dim=1)
    else:
        first, q = (torch.arange(N) % 4)[:, None], None
    drafts = torch.cat([first, torch.full((N, 2), 3)], dim=1)
    p = torch.stack([P, P_BONUS, one_hot([3], 4)[0], one_hot([3], 4)[0]]).expand(N, 4, 4).clone()
    fn = exercises.get("rejection_sampler")
    torch.manual_seed(99)
    tokens, n = fn(drafts, q, p, None, [1] * N)
    tokens, n = torch.as_tensor(tokens), torch.as_tensor(n)
    assert int(n.max()) <= 1, "a row accepted more drafts than the one it owns"
    assert_distributed_as(tokens[:, 0], P, "the first emitted token")
    assert_distributed_as(tokens[n == 1, 1], P_BONUS, "the bonus token (index k_b = 1)")


# Three positions of a draft model far from the target, and the target's bonus distribution: per position
# the acceptance rate is beta_i = sum_x min(p_i(x), q_i(x)) = 0.55, 0.65, 0.6.
PS = torch.tensor([[0.5, 0.25, 0.15, 0.10], [0.1, 0.6, 0.2, 0.1], [0.3, 0.1, 0.1, 0.5], [0.7, 0.1, 0.1, 0.1]],
                  dtype=torch.float64)
QS = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)


def test_accepted_count_and_later_tokens_follow_the_target():
    # k = 3, drafts x_i ~ q_i independently. Each position is a fresh trial, so the number accepted has the law
    #   P(n = j) = beta_1 ... beta_j (1 - beta_{j+1}),  P(n = 3) = beta_1 beta_2 beta_3,
    # and the token emitted at position i (by the rows that got there) is distributed as p_i, the bonus as p_4.
    # One uniform reused along a row, or counting drafts accepted after a rejection, changes this law while
    # the first position still looks right.
    N = 6000
    beta = torch.minimum(PS[:3], QS).sum(-1).tolist()
    law = torch.tensor([1 - beta[0], beta[0] * (1 - beta[1]), beta[0] * beta[1] * (1 - beta[2]),
                        beta[0] * beta[1] * beta[2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(QS[i], N, replacement=True, generator=g) for i in range(3)], dim=1)
    fn = exercises.get("rejection_sampler")
    torch.manual_seed(4321)
    tokens, n = fn(drafts, QS.expand(N, 3, 4).clone(), PS.expand(N, 4, 4).clone())
    tokens, n = torch.as_tensor(tokens), torch.as_tensor(n)
    assert_distributed_as(n, law, "the number of drafts accepted (0..3)")
    for i in range(1, 4):
        assert_distributed_as(tokens[n >= i, i], PS[i], f"the token emitted at position {i}")


def test_seeded_rows_leave_the_global_generator_alone():
    # every row has its own generator (or is greedy): nothing may be drawn from torch's global generator, and the
    # tokens are the same whatever state the global generator is in
    g = torch.Generator().manual_seed(8)
    B, k = 4, 3
    p = torch.rand(B, k + 1, V, generator=g, dtype=torch.float64).mul(3).softmax(-1)
    q = random_q(B, k, seed=9)
    ids = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, k)
    greedy = [False, False, True, False]
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        runs.append(sample(ids, q, p, [torch.Generator().manual_seed(s) for s in (21, 22, 23, 24)], greedy=greedy))
        assert torch.equal(torch.get_rng_state(), state), "a seeded row drew from the global generator"
    assert runs[0] == runs[1], "the global generator's state changed a seeded row's tokens"
    state = torch.get_rng_state()
    sample(ids, q, p, None, greedy=[True] * B)
    assert torch.equal(torch.get_rng_state(), state), "greedy rows must use no randomness at all"
