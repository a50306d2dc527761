"""Medusa's static tree (Cai et al. 2024, §2.1.2 and §3.3.2): which top-k combinations of the heads to verify.

Head d - 1 guesses the token d places after the root. A chain verifies each head's top-1 only; a tree also
tries the runner-up guesses. Its nodes are **choices**: the choice (r_0, ..., r_{d-1}) is the node at depth
d whose token is head (d - 1)'s rank-r_{d-1} guess, under the node (r_0, ..., r_{d-2}). All top-k
combinations (the Cartesian product) would be far too many, so Medusa keeps a sparse set chosen from the
heads' measured accuracy. This module chooses it, ships it, and loads it.

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

    python -m minibatch.spec_decode.medusa_tree            # ~2 min on one CPU core

They are greedy's trees; at temperature 1 the same trees are verified by the lossless tree rule
(``rejection_sampler.tree_rejection_sample``), with lower acceptance.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter

import numpy as np
import torch

from minibatch.model.weights import WEIGHTS_DIR

TREE_FILE = WEIGHTS_DIR / "medusa_tree.json"
SIZES = (8, 16, 32)             # draft nodes (the root not counted) of the shipped trees
DEFAULT_SIZE = 16               # {"tree": "static"} without num_draft_tokens
MAX_RANK = 8                    # ranks considered per head (top-8): deeper runners-up are almost never right


def load_tree(num_draft_tokens=None) -> list:
    """The shipped static tree of ``num_draft_tokens`` nodes (default 16), as a list of choices."""
    n = DEFAULT_SIZE if num_draft_tokens is None else num_draft_tokens
    if not TREE_FILE.exists():
        raise FileNotFoundError(f"no shipped Medusa tree at {TREE_FILE}; make it with "
                                f"python -m minibatch.spec_decode.medusa_tree")
    trees = json.loads(TREE_FILE.read_text())["trees"]
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
def measure_ranks(target, heads, num_prompts: int = 512, prompt_len: int = 64, new_tokens: int = 128,
                  seed: int = 0) -> list:
    """Per generated sequence, the ranks [P, K] of the target's own greedy tokens in each head's distribution."""
    from minibatch.engine.llm import LLM
    from minibatch.engine.sampler import SamplingParams
    from minibatch.model.data import val_documents
    rng = np.random.default_rng(seed)
    docs = val_documents(num_prompts, min_len=prompt_len + 400, seed=seed)       # every held-out file this long
    prompts = []
    for i in range(num_prompts):                                                  # windows at seeded offsets
        d = docs[i % len(docs)]
        start = int(rng.integers(0, len(d) - prompt_len))
        prompts.append(list(d[start: start + prompt_len]))
    outs = LLM(target, max_num_seqs=64).generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens))
    seqs = torch.tensor([p + o.outputs[0].token_ids for p, o in zip(prompts, outs)])   # [B, S]
    out = []
    for i in range(0, len(seqs), 16):                                             # 16 sequences per forward
        out += list(ranks_of(target, heads, seqs[i: i + 16], prompt_len).cpu().numpy())
    return out


@torch.no_grad()
def ranks_of(target, heads, x: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """x [b, S] token ids (any device) -> ranks [b, P, K] on the target's device: for each window position past
    the prompt, the rank of the target's greedy token under each head. Every tensor follows the model's device
    (load_model puts it on CUDA when there is one; an index on another device is an error there)."""
    from minibatch.model.train import batched_causal_attention
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


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minibatch.spec_decode.medusa_tree",
                                 description="Choose Medusa's static trees from the shipped heads' held-out ranks.")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES))
    ap.add_argument("--out", default=str(TREE_FILE))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from minibatch.model.heads import load_head
    from minibatch.model.weights import load_model, read_manifest
    t0 = time.time()
    target = load_model("target")
    heads = load_head("medusa", target)
    per_seq = measure_ranks(target, heads, args.prompts, new_tokens=args.new_tokens, seed=args.seed)
    fit, held = np.concatenate(per_seq[0::2]), np.concatenate(per_seq[1::2])       # by sequence, not position
    counts = prefix_counts(fit)
    K = heads.num_heads
    chain = [(0,) * d for d in range(1, K + 1)]
    trees = {}
    print(f"{len(fit)} positions to choose on, {len(held)} held out; chain k={K}: tau {tau(chain, held):.3f}")
    for n in args.sizes:
        ch = choose(counts, n)
        trees[str(n)] = {"choices": [list(c) for c in ch], "depth": max(map(len, ch)),
                         "tau_fit": round(tau(ch, fit), 4), "tau_held_out": round(tau(ch, held), 4)}
        print(f"{n:>3} nodes, depth {trees[str(n)]['depth']}: tau {trees[str(n)]['tau_held_out']:.3f} held out "
              f"({trees[str(n)]['tau_fit']:.3f} on the positions it was chosen on)")
    doc = {"what": "Medusa static trees (minibatch/spec_decode/medusa_tree.py): choice (r_0..r_{d-1}) = head d-1's "
                   "rank r_{d-1} guess under the node (r_0..r_{d-2}); tau = 1 + expected accepted drafts, greedy",
           "medusa_sha256": read_manifest("medusa")["sha256"],
           "command": "python -m minibatch.spec_decode.medusa_tree " + " ".join(argv or []),
           "data": {"prompts": args.prompts, "prompt_len": 64, "new_tokens": args.new_tokens, "seed": args.seed,
                    "positions_fit": int(len(fit)), "positions_held_out": int(len(held)), "max_rank": MAX_RANK},
           "chain": {"choices": [list(c) for c in chain], "tau_fit": round(tau(chain, fit), 4),
                     "tau_held_out": round(tau(chain, held), 4)},
           "trees": trees, "minutes": round((time.time() - t0) / 60, 1)}
    text = json.dumps(doc, indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)   # a choice on one line
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(f"wrote {args.out} in {doc['minutes']} min")


if __name__ == "__main__":
    main()
