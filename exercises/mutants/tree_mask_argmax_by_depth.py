"""Mutant (exercise 8): reads the target's argmax by depth, as for a chain (target_argmax[len(path) - 1]),
not at the current node: right on the first children, wrong once the path leaves them."""
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
        node, nxt = path[-1], None
        for c in range(node + 1, len(parents)):
            if parents[c] == node and tokens[c] == target_argmax[len(path) - 1]:  # BUG: a chain's index
                nxt = c
                break
        if nxt is None:
            return path
        path.append(nxt)
