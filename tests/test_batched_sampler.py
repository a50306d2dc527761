"""The batched sampler (one filter, one draw per step) against the slow reference (``probabilities``).

* ``top_k_top_p_batched`` keeps exactly the reference's sets, row by row, with every row's own k and p;
* the exponential race draws from the reference's distribution: a chi-square test over many draws;
* a seeded request draws the same tokens alone and inside different batches, wherever it sits;
* a patched top-k/top-p (exercise 3, a student's) is what the sampler calls.
"""
import math

import pytest
import torch

import minibatch.sampling.sampler as sampler_mod
from minibatch.sampling.sampler import Sampler, SamplingParams, apply_top_k_top_p, make_generator, probabilities
from minibatch.sampling.sampler import top_k_top_p_batched


def test_batched_filter_keeps_the_references_sets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 256, generator=g) * 3
    logits[3, :5] = 4.0                                     # ties at the k-th value
    ks = [(-1, 0, 1, 5, 40, 256, 300)[i % 7] for i in range(64)]
    ps = [(1.0, 0.9, 0.5, 0.05, 0.999, 0.3)[i % 6] for i in range(64)]
    got = top_k_top_p_batched(logits, torch.tensor(ks), torch.tensor(ps))
    for i in range(64):
        want = apply_top_k_top_p(logits[i], ks[i], ps[i])
        assert torch.equal(got[i] == float("-inf"), want == float("-inf")), (i, ks[i], ps[i])
        assert torch.equal(got[i][want > float("-inf")], want[want > float("-inf")])


def chi_square(counts, probs, n):
    """Pearson's statistic and its degrees of freedom: one bin per token expected >= 5 times, the rarer
    tokens (with any probability) pooled into one more bin."""
    exp = probs * n
    keep = exp >= 5
    obs, want = counts[keep], exp[keep]
    if exp[~keep].sum() > 0:
        obs, want = torch.cat([obs, counts[~keep].sum()[None]]), torch.cat([want, exp[~keep].sum()[None]])
    return (((obs - want) ** 2) / want).sum().item(), len(obs) - 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=12),
                                    SamplingParams(temperature=1.3, top_p=0.8),
                                    SamplingParams(temperature=0.9, top_k=30, top_p=0.6)],
                         ids=["plain", "top-k", "top-p", "both"])
def test_the_draw_follows_the_reference_distribution(params):
    g = torch.Generator().manual_seed(1)
    row = torch.randn(64, generator=g) * 2                  # one distribution over 64 tokens
    n = 20000
    toks = Sampler(seed=3)(row.expand(n, 64).clone(), [params] * n, [None] * n)   # n rows in one batch: one draw
    counts = torch.bincount(torch.tensor(toks), minlength=64).double()
    probs = probabilities(row[None], params)[0].double()
    assert counts[probs == 0].sum() == 0, "a filtered-out token was drawn"
    stat, dof = chi_square(counts, probs, n)
    # the 0.999 quantile of chi-square(dof) is below dof + 4.5 sqrt(2 dof) + 10 for these dof
    assert stat < dof + 4.5 * math.sqrt(2 * dof) + 10, (stat, dof)


def test_a_wrong_distribution_fails_the_same_test():
    """The test has teeth: draws at temperature 1.3 judged against temperature 1."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(64, generator=g) * 2
    n = 20000
    toks = Sampler(seed=3)(row.expand(n, 64).clone(), [SamplingParams(temperature=1.3)] * n, [None] * n)
    counts = torch.bincount(torch.tensor(toks), minlength=64).double()
    stat, dof = chi_square(counts, probabilities(row[None], SamplingParams(temperature=1.0))[0].double(), n)
    assert stat > dof + 4.5 * math.sqrt(2 * dof) + 10


def test_a_seeded_request_draws_the_same_alone_and_in_any_batch():
    torch.manual_seed(0)
    mine = torch.randn(8, 256)
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=11)

    def run(others, position, sampler_seed):
        sampler, gen, out = Sampler(sampler_seed), make_generator(11), []
        for t in range(8):
            rows = torch.randn(others, 256)
            rows = torch.cat([rows[:position], mine[t:t + 1], rows[position:]])
            params = [SamplingParams(temperature=1.2, top_p=0.5)] * others
            gens = [make_generator(100 + j) if j % 2 else None for j in range(others)]
            params.insert(position, p)
            gens.insert(position, gen)
            out.append(sampler(rows, params, gens)[position])
        return out

    alone = run(0, 0, 0)
    assert run(3, 1, 5) == alone and run(16, 16, 9) == alone and run(7, 0, 0) == alone
    assert len(set(alone)) > 1


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    torch.manual_seed(2)
    logits = torch.randn(5, 256)
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0),
              SamplingParams(top_k=1), SamplingParams(temperature=0)]
    out = Sampler(0)(logits, params, [None] * 5)
    top = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 3, 4)] == [top[i] for i in (0, 2, 3, 4)]


def test_a_sampler_built_with_a_row_filter_calls_it_row_by_row_and_the_default_never_does(monkeypatch):
    """The engine chooses its filter when it is built (a student's, exercise 3): Sampler(seed, top_k_top_p=f) calls f
    row by row; the default Sampler is the batched reference and reads no module global on its way."""
    calls = []

    def student(logits, top_k, top_p):
        calls.append((top_k, top_p))
        return apply_top_k_top_p(logits, top_k, top_p)
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams()]
    logits = torch.randn(3, 256)
    Sampler(0, top_k_top_p=student)(logits, params, [None] * 3)
    assert calls == [(5, 1.0), (-1, 0.5), (-1, 1.0)]
    calls.clear()
    monkeypatch.setattr(sampler_mod, "apply_top_k_top_p", student)
    Sampler(0)(logits, params, [None] * 3)
    assert calls == []
