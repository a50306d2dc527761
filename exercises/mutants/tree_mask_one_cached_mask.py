"""Mutant (exercise 8): caches each tree's mask and hands the same tensor to every caller: a caller that changes
its mask (the engine pads and writes into it) changes the next caller's."""
import torch


_CACHE = {}


def ancestor_mask(parents):
    key = tuple(parents)
    if key in _CACHE:
        return _CACHE[key]                            # BUG: one tensor shared by every caller
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:                                        # i, its parent, ..., the root
            mask[i, j] = True
            j = parents[j]
    _CACHE[key] = mask
    return mask


def positions(parents, context_len):
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return [context_len + d for d in depth]


def greedy_path(parents, tokens, target_argmax):
    kids = [[c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))]
    path = [0]
    while True:
        nxt = next((c for c in kids[path[-1]] if tokens[c] == target_argmax[path[-1]]), None)
        if nxt is None:
            return path
        path.append(nxt)
