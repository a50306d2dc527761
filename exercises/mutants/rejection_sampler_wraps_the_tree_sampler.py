"""Mutant (exercise 4), a wrapper: a chain is a tree, so each sampled row goes to the engine's tree sampler
(``tree_rejection_sample``, whose rule on a chain is the chain's), greedy rows by hand. Right wherever the tree
sampler is the reference; a student release verifies trees through exercise 4 itself, so it must fail there."""
import torch

from minibatch.kv.tree import chain_parents
from minibatch.spec_decode.rejection_sampler import tree_rejection_sample


def rejection_sample(draft_token_ids, draft_probs, target_probs, generators=None, num_draft_tokens=None,
                     greedy=None):
    B, k = draft_token_ids.shape
    ks = [k] * B if num_draft_tokens is None else [int(n) for n in num_draft_tokens]
    rows, accepted = [], []
    for b in range(B):
        drafts = draft_token_ids[b, :ks[b]].tolist()
        p = target_probs[b, :ks[b] + 1].double().cpu()
        if greedy is not None and greedy[b]:
            best = p.argmax(-1).tolist()
            n = next((i for i, x in enumerate(drafts) if x != best[i]), len(drafts))
            toks = drafts[:n] + [best[n]]
        else:
            q = None
            if draft_probs is not None:         # node i's child is draft i + 1, drawn from q_{i+1}
                q = torch.cat([draft_probs[b, :ks[b]].double().cpu(), p[-1:]])
            g = None if generators is None else generators[b]
            path, toks = tree_rejection_sample(chain_parents(ks[b]), [0] + drafts, p, q, g)   # BUG: the engine's
            n = len(path) - 1
        rows.append(toks + [-1] * (k - n))
        accepted.append(n)
    dev = target_probs.device
    return torch.tensor(rows, dtype=torch.int64, device=dev).view(B, k + 1), torch.tensor(accepted, device=dev)
