"""The engine's batched verification (rejection_sample_batched) against the reference rejection_sample.

Greedy rows: the same tokens, exactly. Sampled rows draw their randomness differently, so they are held to the
same distribution: the emitted tokens' first one follows p_1 exactly (what makes speculation lossless), and the
number of drafts accepted has one distribution under both (chi-square), with q and with one-hot drafts.
"""
import math

import pytest
import torch

from minibatch.sampling.sampler import make_generator
from minibatch.spec_decode.rejection_sampler import rejection_sample, rejection_sample_batched


def dists(B, k, V, seed, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(B, k + 1, V, generator=g) * sharp).softmax(-1)
    q = (torch.randn(B, k, V, generator=g) * sharp).softmax(-1)
    return p, q


def test_greedy_rows_equal_the_reference():
    B, k, V = 12, 4, 16
    p, _ = dists(B, k, V, 0, sharp=3.0)
    best = p.argmax(-1)
    drafts = best[:, :k].clone()
    drafts[::3, 1] = (drafts[::3, 1] + 1) % V             # some rows reject at 1
    drafts[1::4, 0] = (drafts[1::4, 0] + 2) % V           # some at 0
    ks = [k, 3, 0, 2] * 3
    drafts = torch.where(torch.arange(k)[None] < torch.tensor(ks)[:, None], drafts, -1)
    want = rejection_sample(drafts, None, p, num_draft_tokens=ks, greedy=[True] * B)
    got = rejection_sample_batched(drafts, None, p, [None] * B, ks, [True] * B)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def chi2(counts_a, counts_b):
    """Two-sample chi-square homogeneity statistic over the bins either sample fills, and its dof."""
    a, b = counts_a.double(), counts_b.double()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    ea, eb = (a + b) * na / (na + nb), (a + b) * nb / (na + nb)
    return (((a - ea) ** 2 / ea) + ((b - eb) ** 2 / eb)).sum().item(), int(keep.sum()) - 1


def bound(dof):
    return dof + 4.5 * math.sqrt(2 * max(dof, 1)) + 10         # above the 0.999 quantile for these dof


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-q", "one-hot"])
def test_sampled_rows_follow_the_references_distribution(with_q):
    N, k, V = 6000, 3, 8
    p1, q1 = dists(1, k, V, 7)
    p, q = p1.expand(N, -1, -1).contiguous(), q1.expand(N, -1, -1).contiguous() if with_q else None
    g = torch.Generator().manual_seed(3)
    src = q1[0] if with_q else p1[0, :k]                  # drafts drawn from q (or, one-hot, from p itself)
    drafts = torch.stack([torch.multinomial(src[i], N, replacement=True, generator=g) for i in range(k)], 1)
    torch.manual_seed(11)
    want_t, want_n = rejection_sample(drafts, q, p, num_draft_tokens=[k] * N, greedy=[False] * N)
    got_t, got_n = rejection_sample_batched(drafts, q, p, [None] * N, [k] * N, [False] * N)
    stat, dof = chi2(torch.bincount(got_n, minlength=k + 1), torch.bincount(want_n, minlength=k + 1))
    assert stat < bound(dof), ("drafts accepted", stat, dof)
    first = torch.bincount(got_t[:, 0], minlength=V).double()
    exp = p1[0, 0].double() * N                           # lossless: the first token follows p_1
    assert (((first - exp) ** 2) / exp).sum().item() < bound(V - 1)
    assert torch.all((got_t >= 0).sum(1) == got_n + 1), "n accepted drafts, one more token, then -1"


def test_a_wrong_rule_fails_the_same_test():
    """The test has teeth: accepting every draft is not the reference's acceptance."""
    N, k, V = 6000, 3, 8
    p1, q1 = dists(1, k, V, 7)
    p, q = p1.expand(N, -1, -1).contiguous(), q1.expand(N, -1, -1).contiguous()
    g = torch.Generator().manual_seed(3)
    drafts = torch.stack([torch.multinomial(q1[0, i], N, replacement=True, generator=g) for i in range(k)], 1)
    _, want_n = rejection_sample(drafts, q, p, num_draft_tokens=[k] * N, greedy=[False] * N)
    _, got_n = rejection_sample_batched(drafts, q, p, [None] * N, [k] * N, [False] * N)
    stat, dof = chi2(torch.bincount(got_n, minlength=k + 1), torch.bincount(want_n, minlength=k + 1))
    _, lax = rejection_sample_batched(drafts, q, p.clone().fill_(1.0 / V).mul_(V), [None] * N, [k] * N, [False] * N)
    assert stat < bound(dof)
    stat, dof = chi2(torch.bincount(lax, minlength=k + 1), torch.bincount(want_n, minlength=k + 1))
    assert stat > bound(dof)


def test_a_seeded_row_verifies_the_same_alone_and_in_a_batch():
    B, k, V = 6, 3, 8
    p, q = dists(B, k, V, 5)
    drafts = torch.randint(0, V, (B, k), generator=torch.Generator().manual_seed(1))
    alone = rejection_sample_batched(drafts[2:3], q[2:3], p[2:3], [make_generator(9)], [k], [False])
    gens = [None, make_generator(1), make_generator(9), None, make_generator(4), None]
    batch = rejection_sample_batched(drafts, q, p, gens, [k] * B, [False] * B)
    assert torch.equal(batch[0][2], alone[0][0]) and batch[1][2] == alone[1][0]
