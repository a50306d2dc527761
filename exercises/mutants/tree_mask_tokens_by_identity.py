"""Mutant (exercise 8): compares token ids with ``is``: right for the small ints CPython keeps one copy of
(-5 to 256), wrong for most token ids above that, which are equal but not the same object."""
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
    kids = [[c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))]
    path = [0]
    while True:
        nxt = next((c for c in kids[path[-1]] if tokens[c] is target_argmax[path[-1]]), None)   # BUG: is, not ==
        if nxt is None:
            return path
        path.append(nxt)
