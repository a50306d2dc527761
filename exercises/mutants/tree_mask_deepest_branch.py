"""Mutant (exercise 8): when several children of a node carry the argmax's token, follows the one whose accepted
branch goes deepest, not the first in node order (the same path when siblings differ)."""
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
    def best(node):                                   # the longest accepted path below node
        paths = [best(c) for c in range(node + 1, len(parents))
                 if parents[c] == node and tokens[c] == target_argmax[node]]
        return [node] + max(paths, key=len, default=[])      # BUG: the deepest branch, not the first child
    return best(0)
