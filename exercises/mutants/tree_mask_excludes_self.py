"""Mutant (exercise 8): a node's row holds its ancestors but not the node itself (the root's row is empty:
no node attends to its own key)."""
import torch


def ancestor_mask(parents):
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = parents[i]                                        # BUG: starts at the parent, skipping i itself
        while j != -1:
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
        node, nxt = path[-1], None
        for c in range(node + 1, len(parents)):
            if parents[c] == node and tokens[c] == target_argmax[node]:
                nxt = c
                break
        if nxt is None:
            return path
        path.append(nxt)
