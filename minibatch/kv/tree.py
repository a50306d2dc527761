"""Token trees: many guesses verified in one forward, and the one path the target keeps.

A chain of k drafts wastes a drafter's second-best guesses: when draft 1 is wrong, drafts 2..k are
thrown away with it. A **token tree** (SpecInfer, Miao et al. 2024 §3; Medusa, Cai et al. 2024 §2.1.2;
EAGLE-2, Li et al. 2024b) puts several candidates at each depth, and the target verifies them all in
the same single forward. It keeps the longest accepted root-to-leaf path.

The tree of one sequence, as the flat batch sees it (``parents`` is the whole description):

    node 0 is the **root**: the last accepted token (not a draft; its K/V is not in the cache yet);
    nodes 1..N are drafts, listed parents first: parents[i] < i, parents[0] = -1.

    e.g. parents = [-1, 0, 0, 1, 1, 2]             root
                                                   /    \\
                                               1 ("a")  2 ("b")
                                               /   \\       \\
                                           3 ("c") 4 ("d")  5 ("e")

Three facts follow from the parent list, and nothing else is needed to verify a tree:

* **positions**: node i sits at ``context_len + depth[i]`` (its siblings share its position: they are
  alternatives for the same token). The model's position embedding reads these.
* **the tree mask**: node i attends to the whole context, to its ancestors and to itself, never to a
  sibling or a cousin. Row i of the mask is its parent's row plus itself (``ancestor_mask``). Its K/V
  are stored at cache index ``context_len + i`` (node order, one slot each, so no two nodes share a
  slot); the mask, not the slot order, says who sees whom.
* **the accepted path**: root, then at each node the child the target accepts (``greedy_path`` for
  greedy; ``rejection_sampler.tree_rejection_sample`` at temperature > 0). Its K/V then move to
  consecutive slots ``context_len + 0, 1, 2, ...`` (the model runner copies them), so the cache holds a
  plain chain again and the next step needs to know nothing about trees.

A chain of k drafts is the tree ``[-1, 0, 1, ..., k-1]``: its mask is the causal one.
"""
from __future__ import annotations

import torch

MAX_TREE_NODES = 64          # root + 63 drafts: a node's row of the mask fits one int64 bitmap (the kernels')


def check_parents(parents) -> list:
    """Return ``parents`` as a list of ints, or raise ValueError naming what is wrong with it."""
    if isinstance(parents, torch.Tensor):
        parents = parents.tolist()
    if not isinstance(parents, (list, tuple)) or not parents:
        raise ValueError(f"a tree's parent list must be a non-empty list of ints, got {parents!r}")
    if any(not isinstance(p, int) or isinstance(p, bool) for p in parents):
        raise ValueError(f"a tree's parent list must hold ints, got {list(parents)!r}")
    if parents[0] != -1:
        raise ValueError(f"node 0 is the root: parents[0] must be -1, got {parents[0]}")
    if len(parents) > MAX_TREE_NODES:
        raise ValueError(f"a tree has at most {MAX_TREE_NODES} nodes (root included), got {len(parents)}")
    for i, p in enumerate(parents[1:], start=1):
        if p == -1:
            raise ValueError(f"node {i} has parent -1: a tree has one root (node 0); parents={list(parents)}")
        if p < 0 or p >= i:
            raise ValueError(f"node {i} has parent {p}: a parent must come before its children "
                             f"(0 <= parent < {i}); a forward reference or a cycle; parents={list(parents)}")
    return list(parents)


def chain_parents(k: int) -> list:
    """The chain of k drafts as a tree: [-1, 0, 1, ..., k-1]."""
    return [-1] + list(range(k))


def positions(parents, context_len: int) -> list:
    """Where each node sits in its sequence: context_len + its depth (siblings share a position).
    The root sits at context_len, right after the cached context; a node one past its parent."""
    pos = [context_len] * len(parents)
    for i in range(1, len(parents)):          # parents first: pos[parents[i]] is known already
        pos[i] = pos[parents[i]] + 1
    return pos


def depths(parents) -> list:
    """depth[i]: edges from the root to node i (the root 0, its children 1, ...): positions without a context.
    (Defined through ``positions``, which exercise 8 has students write, so it gives nothing away there.)"""
    return positions(parents, 0)


def ancestor_mask(parents) -> torch.Tensor:
    """mask [N+1, N+1] bool: mask[i, j] = node j is node i or one of its ancestors (what i attends to)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            mask[i] = mask[parents[i]]           # everything the parent sees ...
        mask[i, i] = True                        # ... and itself
    return mask


def mask_bits(parents) -> list:
    """The mask as one int64 per node: bit j of row i set = node i sees node j (the kernels' form).
    Bit 63 is the sign bit of an int64, so a row that has it set is stored as a negative number."""
    rows = [sum(1 << j for j in range(len(row)) if row[j]) for row in ancestor_mask(parents).tolist()]
    return [b - (1 << 64) if b >= 1 << 63 else b for b in rows]


def children(parents) -> list:
    """children[i]: node i's children, in node order (the order the drafter ranked them)."""
    out = [[] for _ in parents]
    for i in range(1, len(parents)):
        out[parents[i]].append(i)
    return out


def leaves(parents) -> list:
    kids = children(parents)
    return [i for i in range(len(parents)) if not kids[i]]


def greedy_path(parents, tokens, target_argmax) -> list:
    """Greedy verification: the longest path whose every draft is the target's argmax at its parent.

    tokens[i] is node i's token (tokens[0], the root's, is not read); target_argmax[i] is the target's
    argmax at node i: the token it would put after node i. From the root, step to the first child (in
    node order) whose token is the argmax at the current node; stop when no child's is. Returns the
    accepted path [0, ...]; the token after it is target_argmax[path[-1]] (a bonus if the path reaches a
    leaf, else a correction). (Siblings carry different tokens in a drafter's tree, so at most one child
    can match and the walk finds the longest accepted path; node order only settles duplicates.)"""
    kids, path = children(parents), [0]
    while True:
        nxt = next((c for c in kids[path[-1]] if tokens[c] == target_argmax[path[-1]]), None)
        if nxt is None:
            return path
        path.append(nxt)


def judged_depths(parents, path) -> int:
    """How many depths the target judged when it kept ``path``: each accepted node's, plus the next one unless
    the path ended at a leaf (then nothing below it was tried). A chain's counterpart is min(k, accepted + 1)."""
    return len(path) - 1 + int(path[-1] in parents)           # a node with children is some node's parent


def from_choices(choices) -> tuple:
    """Medusa's static tree: each choice (r_0, ..., r_{d-1}) is the node whose token is head d-1's rank
    r_{d-1} guess, under the node (r_0, ..., r_{d-2}) (Cai et al. 2024 §2.1.2's Cartesian product, kept
    sparse). Returns (parents, choices sorted parents first: by depth, then by ranks), the root included
    as the empty choice ()."""
    try:
        cs = [tuple(int(r) for r in c) for c in choices]
    except TypeError:
        raise ValueError(f"tree choices must be a list of tuples of ranks, e.g. [(0,), (1,), (0, 0)]; "
                         f"got {choices!r}") from None
    if not cs:
        raise ValueError("a tree needs at least one choice, e.g. [(0,), (1,), (0, 0)]; got an empty list")
    if any(not c or min(c) < 0 for c in cs):
        raise ValueError(f"every tree choice is a non-empty tuple of ranks >= 0; got {choices!r}")
    if len(set(cs)) != len(cs):
        raise ValueError(f"tree choices hold a duplicate: {choices!r}")
    order = [()] + sorted(cs, key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(order)}
    missing = [c for c in cs if c[:-1] not in index]
    if missing:
        raise ValueError(f"tree choices {missing} have no parent choice {[c[:-1] for c in missing]}: "
                         f"a node needs every prefix of its path in the tree")
    parents = [-1] + [index[c[:-1]] for c in order[1:]]
    return check_parents(parents), order
