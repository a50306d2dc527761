"""Mutant (exercise 8): counts the nodes on the path to the root, the node included, as its depth: the root
sits at context_len + 1, every node one past its place."""
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
    out = []
    for i in range(len(parents)):
        count, j = 0, i
        while j != -1:                                        # BUG: counts nodes (i included), not edges
            count += 1
            j = parents[j]
        out.append(context_len + count)
    return out


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
