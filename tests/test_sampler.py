"""Sampling parameters, top-k / top-p sets, and seeded reproducibility."""
import pytest
import torch

from minibatch.sampling.sampler import Sampler, SamplingParams, apply_top_k_top_p, make_generator, probabilities


def kept(logits, k=-1, p=1.0):
    return set(torch.nonzero(apply_top_k_top_p(torch.tensor(logits), k, p) > float("-inf")).flatten().tolist())


def test_top_k_keeps_exactly_k_and_ties():
    assert kept([0.1, 3.0, 2.0, -1.0, 2.5], k=2) == {1, 4}
    assert kept([1.0, 2.0, 2.0, 0.0], k=2) == {1, 2}
    assert kept([1.0, 2.0, 2.0, 0.0], k=1) == {1, 2}, "a tie at the k-th value keeps all tied tokens"
    assert kept([1.0, 2.0, 3.0], k=-1) == {0, 1, 2}
    assert kept([1.0, 2.0, 3.0], k=10) == {0, 1, 2}


def test_top_p_nucleus_boundary():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert kept(logits, p=0.5) == {0}                   # 0.5 reaches 0.5 exactly: nothing else needed
    assert kept(logits, p=0.51) == {0, 1}               # the token crossing the boundary is kept
    assert kept(logits, p=0.8) == {0, 1}
    assert kept(logits, p=0.81) == {0, 1, 2}
    assert kept(logits, p=1.0) == {0, 1, 2, 3}
    assert kept(logits, p=0.01) == {0}                  # never empty


def test_top_p_ties_at_boundary():
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2]).log().tolist()
    assert kept(logits, p=0.5) == {0, 1, 2, 3}          # tokens tied with the boundary token stay


def test_top_k_then_top_p():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    # top-k 2 renormalises to 4/7, 3/7; nucleus 0.5 then keeps only the first
    assert kept(logits, k=2, p=0.5) == {0}


def test_probabilities_greedy_and_temperature():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert probabilities(logits, SamplingParams(temperature=0)).tolist() == [[0.0, 1.0, 0.0]]
    cold = probabilities(logits, SamplingParams(temperature=0.1))
    hot = probabilities(logits, SamplingParams(temperature=10))
    assert cold[0, 1] > 0.99 and hot.max() < 0.4


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-0.1), "temperature"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"), (dict(n=0), "n must"),
    (dict(stop=[""]), "stop"),
])
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_seeded_sampling_is_independent_of_the_batch():
    torch.manual_seed(0)
    mine = torch.randn(6, 256)                            # one request's logits over 6 steps
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run(batch_size, position):
        sampler, gen, out = Sampler(seed=batch_size), make_generator(42), []
        for t in range(6):
            others = torch.randn(batch_size, 256)
            rows = torch.cat([others[:position], mine[t:t + 1], others[position:]])
            params = [SamplingParams(temperature=1.0)] * batch_size
            params.insert(position, p)
            gens = [None] * batch_size
            gens.insert(position, gen)
            out.append(sampler(rows, params, gens)[position])
        return out

    alone = run(0, 0)
    assert run(3, 0) == alone and run(5, 4) == alone and run(1, 1) == alone


def test_unseeded_requests_do_not_disturb_seeded_ones():
    """Seeded row 1 draws the same token alone or between unseeded rows, whatever the sampler's own seed
    (unseeded rows draw from the sampler's default generator, never from a seeded row's)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 256)
    alone = [Sampler(0)(logits[1:2], [SamplingParams(seed=7)], [make_generator(7)])[0] for _ in range(2)]
    mixed = []
    for sampler_seed in (0, 123, 999):
        params = [SamplingParams(), SamplingParams(seed=7), SamplingParams()]
        mixed.append(Sampler(sampler_seed)(logits, params, [None, make_generator(7), None]))
    assert {m[1] for m in mixed} == {alone[0]} == {alone[1]}
    assert len({(m[0], m[2]) for m in mixed}) > 1, "unseeded rows do follow the sampler's seed"
