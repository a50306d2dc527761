"""Medusa's static tree (Cai et al. 2024, §2.1.2 and §3.3.2): which top-k combinations of the heads to verify.

Head d - 1 guesses the token d places after the root. A chain verifies each head's top-1 only; a tree also
tries the runner-up guesses. Its nodes are **choices**: the choice (r_0, ..., r_{d-1}) is the node at depth
d whose token is head (d - 1)'s rank-r_{d-1} guess, under the node (r_0, ..., r_{d-2}). All top-k
combinations (the Cartesian product) would be far too many, so Medusa keeps a sparse set chosen from the
heads' measured accuracy. This module chooses it and loads it; ``bench/medusa_tree.py`` measures the ranks
and writes the shipped file.

**Choosing, by simulation on held-out code.** Let the target decode greedily from held-out prompts. At each
position t (the row whose hidden state the heads read; the root is the token at t + 1), write down

    rank_d(t) = the rank of the target's own token at t + 1 + d in head (d - 1)'s distribution at t.

Greedy verification accepts node c = (r_0, ..., r_{d-1}) exactly when (rank_1(t), ..., rank_d(t)) = c:
the accepted path is the longest prefix of the rank vector that is a node of the tree. So a tree T accepts,
at t, as many drafts as it has nodes that are prefixes of the rank vector, and on average

    tau(T) = 1 + sum over c in T of f(c),     f(c) = the fraction of positions whose rank vector starts with c.

No independence between heads is assumed: f is counted, not multiplied. Since f(child) <= f(parent), the
best tree of N nodes is simply the N most frequent prefixes (ties to the shallower one, so a node's parent
always comes first), which is what ``choose`` returns. Medusa's paper builds its tree the same way from
products of per-head accuracies (its §3.3.2); counting the joint is exact for this data and no harder.

The shipped trees (``minibatch/model/checkpoints/medusa_tree.json``: 8, 16 and 32 nodes) were chosen on half of
the generated positions and their tau is reported on the other half, beside the chain's. Rebuild them with

    python -m minibatch.bench.medusa_tree                   # ~2 min on one CPU core

They are greedy's trees; at temperature 1 the same trees are verified by the lossless tree rule
(``rejection_sampler.tree_rejection_sample``), with lower acceptance.
"""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import torch

from minibatch.model.weights import WEIGHTS_DIR

TREE_FILE = WEIGHTS_DIR / "medusa_tree.json"                  # the GPT target's heads'


def tree_file(model: str = "target"):
    """The static trees chosen from ``model``'s own Medusa heads: the GPT's ``medusa_tree.json``, the Llama's
    ``llama_medusa_tree.json`` (the heads' names, ``weights.head_preset``)."""
    return TREE_FILE if model == "target" else WEIGHTS_DIR / f"{model}_medusa_tree.json"
SIZES = (8, 16, 32)             # draft nodes (the root not counted) of the shipped trees
DEFAULT_SIZE = 16               # {"tree": "static"} without num_draft_tokens
MAX_RANK = 8                    # ranks considered per head (top-8): deeper runners-up are almost never right


def load_tree(num_draft_tokens=None, model: str = "target") -> list:
    """The shipped static tree of ``num_draft_tokens`` nodes (default 16) for ``model``'s heads, as choices."""
    n = DEFAULT_SIZE if num_draft_tokens is None else num_draft_tokens
    path = tree_file(model)
    if not path.exists():
        raise FileNotFoundError(f"no shipped Medusa tree at {path}; make it with "
                                f"python -m minibatch.bench.medusa_tree --model {model}")
    trees = json.loads(path.read_text())["trees"]
    if str(n) not in trees:
        raise ValueError(f"the shipped Medusa static trees have {sorted(map(int, trees))} nodes, not {n!r}; "
                         f"choose one of them, or give your own tree as a list of choices")
    return [tuple(c) for c in trees[str(n)]["choices"]]


# -- choosing --------------------------------------------------------------------------------------------------------

def prefix_counts(ranks: np.ndarray) -> Counter:
    """ranks [P, K] (rank_1(t) .. rank_K(t) per position, MAX_RANK = "not in the top-k") -> how many positions'
    rank vectors start with each choice c (ranks < MAX_RANK only)."""
    counts = Counter()
    for row in ranks.tolist():
        for d in range(1, len(row) + 1):
            if row[d - 1] >= MAX_RANK:
                break
            counts[tuple(row[:d])] += 1
    return counts


def choose(counts: Counter, n: int) -> list:
    """The n most frequent prefixes (ties: shallower, then lower ranks): the tree of n nodes with the highest
    expected acceptance on the data counted. Prefix-closed because f(child) <= f(parent)."""
    if n > len(counts):
        raise ValueError(f"only {len(counts)} distinct prefixes were seen; cannot choose {n} nodes")
    return sorted(counts, key=lambda c: (-counts[c], len(c), c))[:n]


def tau(choices, ranks: np.ndarray) -> float:
    """Mean tokens per verify step of a tree over positions ranks [P, K]: 1 + mean accepted drafts."""
    counts, P = prefix_counts(ranks), len(ranks)
    return 1.0 + sum(counts.get(tuple(c), 0) for c in choices) / P


@torch.no_grad()
def ranks_of(target, heads, x: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """x [b, S] token ids (any device) -> ranks [b, P, K] on the target's device: for each window position past
    the prompt, the rank of the target's greedy token under each head. Every tensor follows the model's device
    (load_model puts it on CUDA when there is one; an index on another device is an error there)."""
    from minibatch.model.training import batched_causal_attention
    dev = next(target.parameters()).device
    x = x.to(dev)
    b, S = x.shape
    K = heads.num_heads
    _, hs = target(x.reshape(-1), torch.arange(S, device=dev).repeat(b), batched_causal_attention(b, S),
                   hidden_states=("final",))
    h = hs["final"].view(b, S, -1)[:, prompt_len - 1: S - K - 1]                  # rows t: the root is t + 1
    logits = heads(h.reshape(-1, h.shape[-1]).float()).view(b, -1, K, heads.vocab_size)   # [b, P, K, V]
    P = logits.shape[1]
    ranks = torch.empty(b, P, K, dtype=torch.long, device=dev)
    for d in range(K):                                     # head d guesses the token at t + 2 + d
        want = x[:, prompt_len + 1 + d: prompt_len + 1 + d + P]                      # [b, P]
        rank_d = (logits[:, :, d] > logits[:, :, d].gather(-1, want[..., None])).sum(-1)   # [b, P]
        ranks[:, :, d] = rank_d.clamp(max=MAX_RANK)
    return ranks
