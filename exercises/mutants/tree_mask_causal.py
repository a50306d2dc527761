"""Mutant (exercise 8): the chain's causal mask (every earlier node), so siblings and cousins see each other."""
import torch


def ancestor_mask(parents):
    n = len(parents)
    return torch.tril(torch.ones(n, n, dtype=torch.bool))    # BUG: right for a chain only


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
