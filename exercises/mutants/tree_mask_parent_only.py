"""Mutant (exercise 8): each row holds the node and its parent only, not every ancestor (the grandparent and
the root drop out below depth 1: a depth-2 draft is verified as if its path started at its parent)."""
import torch


def ancestor_mask(parents):
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if i > 0:
            mask[i, parents[i]] = True                        # BUG: the parent, but not the parent's ancestors
    return mask


def positions(parents, context_len):
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return [context_len + d for d in depth]


def greedy_path(parents, tokens, target_argmax):
    path = [0]
    while True:
        node, nxt = path[-1], None
        for c in range(node + 1, len(parents)):
            if parents[c] == node and tokens[c] == target_argmax[node]:
                nxt = c
                break
        if nxt is None:
            return path
        path.append(nxt)
