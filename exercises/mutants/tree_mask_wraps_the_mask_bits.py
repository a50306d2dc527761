"""Mutant (exercise 8), a wrapper: the mask decoded from the engine's kernel form (``tree.mask_bits``), the
positions from ``tree.depths``, the greedy path from the tree sampler on one-hot targets. Right wherever those are
the reference's; a student release computes them through exercise 8 itself, so it must fail there."""
import torch

from minibatch.kv import tree
from minibatch.spec_decode.rejection_sampler import tree_rejection_sample


def ancestor_mask(parents):
    n = len(parents)
    bits = tree.mask_bits(parents)                                # BUG: the engine's
    return torch.tensor([[(bits[i] >> j) & 1 == 1 for j in range(n)] for i in range(n)], dtype=torch.bool)


def positions(parents, context_len):
    return [context_len + d for d in tree.depths(parents)]       # BUG: the engine's


def greedy_path(parents, tokens, target_argmax):
    V = max([int(t) for t in tokens[1:]] + [int(t) for t in target_argmax]) + 1
    p = torch.nn.functional.one_hot(torch.tensor([int(t) for t in target_argmax]), V).double()
    return tree_rejection_sample(list(parents), [0] + [int(t) for t in tokens[1:]], p)[0]   # BUG: the engine's
