"""Mutant (exercise 8): tries only each node's first child: when the drafter's best guess is wrong, the
second-best sibling is never looked at (a tree verified as one chain)."""
import torch


def ancestor_mask(parents):
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:                                        # i, its parent, ..., the root
            mask[i, j] = True
            j = parents[j]
    return mask


def positions(parents, context_len):
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return [context_len + d for d in depth]


def greedy_path(parents, tokens, target_argmax):
    path = [0]
    while True:
        node = path[-1]
        kids = [c for c in range(node + 1, len(parents)) if parents[c] == node]
        if not kids or tokens[kids[0]] != target_argmax[node]:    # BUG: later siblings never tried
            return path
        path.append(kids[0])
