"""The tree rejection sampler: lossless on every tree shape, for both of its rules, and known-wrong variants caught.

A synthetic target over V = 5 tokens gives each prefix its own distribution p(. | prefix) (seeded by the
prefix, so the same prefix always gets the same p). A tree of drafts is built under the prefix; the target's
probabilities at its nodes are p at each node's path, as the real verify forward computes them. The sampler
walks the tree and emits its path plus one token; the test continues with plain sampling to two tokens in all
(what the engine's next step would do), and compares the empirical joint law of (t1, t2) with the exact one,
p(t1) p(t2 | t1), by Pearson's chi-square at the 0.001 level (cells expected >= 5 times, the rest lumped).

Rule 1: the children are the drafter's top-k (deterministic). Rule 2: each node's children are drawn i.i.d.
from the drafter's q there (SpecInfer). Greedy, exact schedules, and bad input are checked by hand.
"""
import functools
import zlib

import numpy as np
import pytest
import torch

from minibatch.kv import tree
from minibatch.spec_decode.rejection_sampler import tree_rejection_sample
from test_spec_methods import chi_square

V = 5
N = 12_000
SHAPES = {
    "single node (no drafts)": [-1],
    "chain": [-1, 0, 1],
    "wide": [-1, 0, 0, 0],
    "deep and wide": [-1, 0, 0, 1, 1, 2, 3],
    "every token a child": [-1, 0, 0, 0, 0, 0, 1],
}


@functools.lru_cache(maxsize=None)
def dist(prefix, salt):
    """A fixed random distribution for each prefix (Dirichlet(2): no cell is vanishingly rare)."""
    seed = zlib.crc32(bytes([salt, *prefix, 255]))
    return torch.from_numpy(np.random.default_rng(seed).dirichlet(2 * np.ones(V)))


def target(prefix):
    return dist(prefix, 1)


def drafter(prefix):
    return dist(prefix, 2)


def build(parents, rule, rng):
    """Node tokens, the target's p at each node [N+1, V] and (rule 2) the q each node's children came from."""
    kids, toks, paths = tree.children(parents), [0], [()]
    for i in range(1, len(parents)):
        pp, rank = paths[parents[i]], kids[parents[i]].index(i)
        if rule == "top-k":                      # the drafter's rank-th most likely token
            t = int(torch.argsort(drafter(pp), descending=True)[rank])
        else:                                    # an independent draw from the drafter's q
            t = int(rng.choice(V, p=drafter(pp).numpy()))
        toks.append(t)
        paths.append(pp + (t,))
    p = torch.stack([target(pp) for pp in paths])
    q = None if rule == "top-k" else torch.stack([drafter(pp) for pp in paths])
    return toks, p, q


def exact_joint():
    return {(a, b): float(target(())[a] * target((a,))[b]) for a in range(V) for b in range(V)}


def sample_pairs(sampler, parents, rule, n=N, seed=0):
    """n trials: the sampler's emitted tokens, continued by plain sampling to two tokens; [n, 2]."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    fixed = build(parents, rule, rng) if rule == "top-k" else None     # top-k: the same tree every time
    out = np.empty((n, 2), dtype=np.int64)
    for i in range(n):
        toks, p, q = fixed or build(parents, rule, rng)
        _, emitted = sampler(parents, toks, p, q, generator=g)
        while len(emitted) < 2:
            emitted.append(int(rng.choice(V, p=target(tuple(emitted)).numpy())))
        out[i] = emitted[:2]
    return out


def check(sampler, parents, rule, seed=0):
    chi2, crit = chi_square(sample_pairs(sampler, parents, rule, seed=seed), exact_joint())
    return chi2, crit


@pytest.mark.parametrize("shape,rule", [(s, r) for r in ("top-k", "sampled from q") for s in SHAPES
                                        if r == "top-k" or len(SHAPES[s]) > 1])
def test_emitted_tokens_follow_the_target(shape, rule):
    parents = SHAPES[shape]
    chi2, crit = check(tree_rejection_sample, parents, rule)
    assert chi2 < crit, f"{shape}, {rule}: chi-square {chi2:.1f} rejects the target's law at 0.001 ({crit:.1f})"


def test_each_child_is_taken_as_often_as_the_target_would_emit_it():
    """A child's token can only be emitted by accepting that child (a correction excludes every child), so the
    rate at which each of the root's children is taken is exactly p(its token): the first (its plain
    chance) and the second (reached only after the first was rejected, and renormalised)."""
    parents = SHAPES["deep and wide"]
    toks, p, _ = build(parents, "top-k", None)
    g, n = torch.Generator().manual_seed(0), 4000
    firsts = [tree_rejection_sample(parents, toks, p, generator=g)[0][1:2] for _ in range(n)]
    for child in (1, 2):
        want = float(p[0, toks[child]])
        got = sum(f == [child] for f in firsts) / n
        assert abs(got - want) < 4 * (want * (1 - want) / n) ** 0.5, (child, got, want)


# -- known-wrong variants: the same check must reject each ----------------------------------------------------------

def no_renormalise(parents, toks, p, q=None, generator=None):
    """Accepts child x with its original p(x), not p(x) over the mass left after earlier rejections."""
    kids, path = tree.children(parents), [0]
    while True:
        left, nxt = p[path[-1]].clone(), None
        for c in kids[path[-1]]:
            if float(torch.rand((), dtype=torch.float64, generator=generator)) < float(p[path[-1]][toks[c]]):
                nxt = c
                break
            left[toks[c]] = 0
        if nxt is None:
            return path, [toks[i] for i in path[1:]] + [int(torch.multinomial(left, 1, generator=generator))]
        path.append(nxt)


def correction_from_p(parents, toks, p, q=None, generator=None):
    """Right acceptances, but the correction token is drawn from the full p (the rejected children too)."""
    path, emitted = tree_rejection_sample(parents, toks, p, q, generator=generator)
    if tree.children(parents)[path[-1]]:
        emitted[-1] = int(torch.multinomial(p[path[-1]], 1, generator=generator))
    return path, emitted


def residual_is_p(parents, toks, p, q=None, generator=None):
    """SpecInfer's rule without the residual: after a rejection the next child is checked against p, not
    norm(max(0, p - q))."""
    kids, path = tree.children(parents), [0]
    while True:
        node, nxt = path[-1], None
        for c in kids[node]:
            if float(torch.rand((), dtype=torch.float64, generator=generator)) * float(q[node][toks[c]]) \
                    < float(p[node][toks[c]]):
                nxt = c
                break
        if nxt is None:
            r = (p[node] - q[node]).clamp(min=0) if kids[node] else p[node]
            return path, [toks[i] for i in path[1:]] + [int(torch.multinomial(r, 1, generator=generator))]
        path.append(nxt)


@pytest.mark.parametrize("mutant,rule", [(no_renormalise, "top-k"), (correction_from_p, "top-k"),
                                         (residual_is_p, "sampled from q")])
def test_a_wrong_sampler_fails_the_check(mutant, rule):
    chi2, crit = check(mutant, SHAPES["wide"], rule)
    assert chi2 > crit, f"{mutant.__name__}: chi-square {chi2:.1f} did not reject it ({crit:.1f}): the check is blind"


# -- by hand ----------------------------------------------------------------------------------------------------------

def one_hot(*ids):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).double()


def test_a_certain_target_walks_its_own_path():
    """p one-hot at every node: the path follows exactly the children that match, past a rejected sibling."""
    parents = [-1, 0, 0, 1, 2, 2]
    toks = [9, 1, 2, 3, 4, 0]          # root's children 1 ("1"), 2 ("2"); node 2's children 4 ("4"), 5 ("0")
    p = one_hot(2, 3, 0, 1, 4, 1)      # root -> 2 (the second child); node 2 -> 0 (its second child); then 1
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert tree_rejection_sample(parents, toks, p, generator=g) == ([0, 2, 5], [2, 0, 1])


def test_all_children_rejected_gives_a_correction_outside_them():
    parents, toks = [-1, 0, 0], [0, 1, 2]
    p = torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.5]] + [[0.2] * 5] * 2, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        path, emitted = tree_rejection_sample(parents, toks, p, generator=g)
        assert path == [0] and emitted[0] in (3, 4)


def test_seeded_runs_repeat():
    parents = SHAPES["deep and wide"]
    toks, p, _ = build(parents, "top-k", None)
    a = [tree_rejection_sample(parents, toks, p, generator=torch.Generator().manual_seed(s)) for s in range(30)]
    b = [tree_rejection_sample(parents, toks, p, generator=torch.Generator().manual_seed(s)) for s in range(30)]
    assert a == b and len(set(map(str, a))) > 3


@pytest.mark.parametrize("kw,match", [
    (dict(parents=[0, 0]), "parents\\[0\\] must be -1"),
    (dict(parents=[-1, 1]), "forward reference"),
    (dict(tokens=[0, 1]), "tokens has 2 entries"),
    (dict(tokens=[0, 1, 7]), "vocabulary"),
    (dict(target_probs=torch.full((3, V), 0.5, dtype=torch.float64)), "distribution"),
    (dict(target_probs=torch.full((2, V), 0.2, dtype=torch.float64)), "target_probs must be"),
    (dict(draft_probs=torch.full((3, 4), 0.25, dtype=torch.float64)), "draft_probs must be"),
    (dict(draft_probs=torch.full((3, V), float("nan"), dtype=torch.float64)), "draft_probs"),
])
def test_bad_input_is_refused(kw, match):
    args = dict(parents=[-1, 0, 0], tokens=[0, 1, 2], target_probs=torch.full((3, V), 0.2, dtype=torch.float64),
                draft_probs=None)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        tree_rejection_sample(args["parents"], args["tokens"], args["target_probs"], args["draft_probs"])
