"""Mutant (exercise 8): accepts every node whose token is the argmax at its parent, in node order,
whether or not its parent was accepted: the path goes on below a rejection (and may hold two siblings)."""
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
    for c in range(1, len(parents)):
        if tokens[c] == target_argmax[parents[c]]:           # BUG: never checks that parents[c] was accepted
            path.append(c)
    return path
