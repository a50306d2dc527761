"""Exercise 8: the token tree's mask, its positions and the accepted path (SpecInfer, Miao et al. 2024,
Sec. 3 and 4.1; Medusa, Cai et al. 2024, Sec. 2.1.2; EAGLE-2, Li et al. 2024).

A chain of k drafts throws the drafter's second-best guesses away: when draft 1 is wrong, drafts 2..k go
with it. A **token tree** keeps several candidates at each depth, and the target model verifies all of
them in one forward. It keeps the longest accepted root-to-leaf path. Read
``minibatch/kv/tree.py``'s module docstring first.

One sequence's tree is a **parent list**, and nothing else is needed to verify it:

    parents[0] == -1         node 0 is the root: the last accepted token (not a draft);
    0 <= parents[i] < i      nodes 1..N are the drafts, listed parents first (a parent before its children,
                             siblings in the order the drafter ranked them); at most 64 nodes in all.

    parents = [-1, 0, 0, 1, 1, 2]        root (0)                depth 0
                                         /      \\
                                      1 "a"    2 "b"             depth 1
                                      /   \\       \\
                                   3 "c" 4 "d"   5 "e"           depth 2

The forward feeds the N + 1 nodes as one flat run of new tokens after the sequence's context_len cached
ones. Two things make that run a tree rather than a chain, and you write both:

* **the tree mask** (``ancestor_mask``): node i attends to the context, to itself and to its ancestors, and
  to nothing else: not a sibling, not a cousin, not a descendant. (Node 4 must not see node 3: they are
  alternatives for the same token.) Here:

                 j = 0  1  2  3  4  5
      mask[0] =    [1, 0, 0, 0, 0, 0]       the root sees itself
      mask[1] =    [1, 1, 0, 0, 0, 0]
      mask[2] =    [1, 0, 1, 0, 0, 0]       not node 1, its sibling
      mask[3] =    [1, 1, 0, 1, 0, 0]       its parent 1 and the root: every ancestor
      mask[4] =    [1, 1, 0, 0, 1, 0]
      mask[5] =    [1, 0, 1, 0, 0, 1]

  A chain, ``[-1, 0, 1, 2]``, gets the ordinary causal (lower-triangular) mask.
* **the positions** (``positions``): node i sits at ``context_len + depth(i)``: the root right after the
  context, each node one past its parent, so siblings share a position (they are guesses for the same
  token) and the position embedding reads each node as the next token of its own path. Here, with
  context_len = 7: [7, 8, 8, 9, 9, 9].

The engine turns your mask into one int64 bitmap per row for the attention backends
(``tree.mask_bits`` calls your ``ancestor_mask``) and feeds your positions to the model.

Then, from the target's logits at every node, **the accepted path** (``greedy_path``, for greedy
requests): the target's argmax at node i is the token it would put after node i, so a child c of i is
accepted when tokens[c] == target_argmax[i]. Walk from the root: at each node, step to its first child (in
node order) whose token is the argmax at that node; stop when none is. E.g. with the tree above,

    tokens        = [r, "a", "b", "c", "d", "e"]
    target_argmax = ["a", "d", "x", .., .., ..]   (the argmax *after* nodes 0, 1, 2, ...)
    root: argmax "a" -> node 1 ("a") accepted; node 1: argmax "d" -> node 3 ("c") no, node 4 ("d") yes;
    node 4 is a leaf -> path [0, 1, 4]; the engine appends "a", "d" and the bonus target_argmax[4].

Run the tests:  MINIBATCH_STUDENT=tree_mask python -m pytest tests/exercises -m ex8
"""
from __future__ import annotations

import torch

from minibatch.kv.tree import children  # noqa: F401  (given: children(parents)[i], node i's children in node order)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """The tree mask: mask [N+1, N+1] bool, mask[i, j] = True iff node j is node i or one of its ancestors.

    parents: the parent list (parents[0] == -1, 0 <= parents[i] < i), N + 1 = len(parents) nodes, 1 to 64.
    Returns a new torch.bool tensor on the CPU every call (the caller may change it: never hand two callers
    the same tensor); row i is what node i attends to among the tree's nodes.
    Read ``parents``, never change it (the engine passes the same list on to positions()).

    Hint: the nodes come parents first, so when you reach node i its parent's row is already done.
    """
    raise NotImplementedError("Exercise 8: ancestor_mask (exercises/ex8_tree_mask.py)")


def positions(parents: list[int], context_len: int) -> list[int]:
    """Where each node sits in its sequence: a list of N + 1 ints, node i's being context_len + depth(i).

    depth(0) = 0 (the root sits at context_len, right after the cached context), depth(i) =
    depth(parents[i]) + 1. Siblings share a position; a node's position is not context_len + i.
    Read ``parents``, never change it.
    """
    raise NotImplementedError("Exercise 8: positions (exercises/ex8_tree_mask.py)")


def greedy_path(parents: list[int], tokens: list[int], target_argmax: list[int]) -> list[int]:
    """Greedy verification of a tree: the accepted path, a list of node indices [0, ...] from the root.

    tokens[i]: node i's token, any int (tokens[0], the root's, is already accepted: never compare it).
    target_argmax[i]: the target's argmax at node i, the token it would put *after* node i.
    A child c of node i is accepted when tokens[c] == target_argmax[i] (the argmax at its parent, not at c).
    From the root: step to the first child (in node order) that is accepted; if the first is not, try its
    next sibling, and so on; stop when no child of the current node is accepted (a leaf, or every child
    rejected). Two siblings with the same token: the first in node order, even if the later one's branch
    would go deeper. A rejected node ends its branch: nothing below it can be accepted, whatever its children's
    tokens. Returns at least [0] (every draft rejected). The lists are the engine's: read them only.
    """
    raise NotImplementedError("Exercise 8: greedy_path (exercises/ex8_tree_mask.py)")
