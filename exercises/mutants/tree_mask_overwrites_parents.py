"""Mutant (exercise 8): computes the depths in place, in the caller's parent list, to save a list: the
positions are right, but the engine then builds the tree mask from a list of depths."""
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
    depth = parents                                           # BUG: not a copy: the caller's list
    depth[0] = 0
    for i in range(1, len(depth)):
        depth[i] = depth[parents[i]] + 1                      # parents[i] < i already holds its depth
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
