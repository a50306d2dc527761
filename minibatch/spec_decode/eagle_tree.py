"""EAGLE-2's dynamic draft tree (Li et al. 2024b, §4): grow where the drafter is confident, then keep the best.

A chain spends every draft pass on the drafter's top-1 guess. EAGLE-2 observes that the drafter's own
probability is a good estimate of acceptance (§3), and grows a *tree* shaped by it, per sequence and per step:

1. **expand** (§4.1): depth 1 holds the top-``topk`` tokens of the head's distribution at the root. At each
   next depth, the ``topk`` nodes of the newest layer with the highest *value* (the cumulative
   log-probability of their path, log q(x_1) + ... + log q(x_d): the drafter's estimate that the whole path
   is accepted) are run through the head, and each gets its top-``topk`` children. ``depth`` passes in all,
   the same number of sequential head passes as a chain of ``depth`` drafts.
2. **re-rank** (§4.2): of every node grown (topk at depth 1, topk x topk at each next depth), keep the
   ``num_draft_tokens`` with the highest value. A node's value is never above its parent's (log q <= 0),
   and ties go to the shallower node, so the kept set contains every kept node's ancestors: it is a tree.
3. the kept nodes are listed parents first (by depth, then by value), so each node's children come in the
   drafter's order, which is the order the tree rejection rule tries them in (``tree_rejection_sample``).

The head's passes attend with a **tree mask** too: in the pass that expands depth d, the head is fed the
root's entry and every node expanded so far, each seeing only its ancestors (the attention metadata's
``tree_parents``, as in the target's verify). Those entries are recomputed each pass rather than kept: the
mask covers only a pass's own new tokens, and one small block over 1 + topk x (d - 1) entries costs less
than keeping per-node caches. They live in scratch blocks (``scratch.py``), like the chain's drafts.

Lossless at any temperature: the children are chosen deterministically (top-k by the drafter), so the
target verifies the tree with rule 1 of ``tree_rejection_sample`` (or the greedy longest path).
"""
from __future__ import annotations

import torch


def entries_per_seq(depth: int, topk: int) -> int:
    """Head entries one sequence writes while drafting: its root, then topk expanded nodes per depth < depth."""
    return 1 + topk * (depth - 1)


def rerank(values: list, depths: list, num_draft_tokens: int) -> list:
    """The indices of the ``num_draft_tokens`` best nodes (highest value, the shallower on a tie, then the
    earlier grown), in that order."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], depths[i], i))
    return order[:num_draft_tokens]


class Growth:
    """One sequence's tree while it grows. Node 0 is the root; node i has token, parent, value, depth."""

    def __init__(self, root_token: int, root_feature: torch.Tensor, depth: int):
        self.tokens, self.parents, self.values, self.depths = [root_token], [-1], [0.0], [0]
        self.feature_in = [root_feature]     # the feature node i's entry reads: its parent's f^ (root: true f)
        self.f_hat = [None]                  # node i's f^, once it has been run through the head
        self.expanded = [0]                  # nodes run through the head, in the order they were fed
        self.depth = depth                   # how deep this sequence may grow (its proposal budget)

    def add_children(self, node: int, log_q: torch.Tensor, topk: int) -> list:
        """Node's top-``topk`` children by the head's log-probabilities log_q [V]; returns their indices."""
        lp, tok = log_q.topk(topk)
        new = []
        for v, t in zip(lp.tolist(), tok.tolist()):
            self.tokens.append(t)
            self.parents.append(node)
            self.values.append(self.values[node] + v)
            self.depths.append(self.depths[node] + 1)
            self.feature_in.append(self.f_hat[node])
            self.f_hat.append(None)
            new.append(len(self.tokens) - 1)
        return new

    def fed(self) -> tuple:
        """The entries of the next head pass: (token ids, input features [n, C], parents within the pass)."""
        where = {node: i for i, node in enumerate(self.expanded)}
        parents = [-1] + [where[self.parents[n]] for n in self.expanded[1:]]
        return ([self.tokens[n] for n in self.expanded], torch.stack([self.feature_in[n] for n in self.expanded]),
                parents)

    def result(self, num_draft_tokens: int) -> tuple:
        """(draft tokens of nodes 1..N, parents [N + 1]) of the kept tree, parents first."""
        keep = rerank(self.values[1:], self.depths[1:], num_draft_tokens)
        keep = sorted((i + 1 for i in keep), key=lambda n: (self.depths[n], -self.values[n], n))
        index = {0: 0, **{n: i + 1 for i, n in enumerate(keep)}}
        return [self.tokens[n] for n in keep], [-1] + [index[self.parents[n]] for n in keep]


def draft_trees(proposer, drafting, root_f_hat: dict, draft_table: dict, topk: int, num_draft_tokens: int) -> None:
    """Grow and keep a tree for each drafting sequence; sets ``spec_token_ids`` and ``spec_parents``.

    drafting: [(seq, depth)]; root_f_hat: seq id -> f^ of the root's entry (from the catch-up pass);
    draft_table: seq id -> its drafting block table (scratch blocks from the root's slot on)."""
    if not drafting:
        return
    logits = lambda f: proposer.head.logits(proposer.target, f)                      # [n, C] -> [n, V]
    grow = {}
    for seq, depth in drafting:
        g = Growth(seq.token_ids[seq.num_computed_tokens], proposer.state[seq.seq_id][1], depth)
        g.f_hat[0] = root_f_hat[seq.seq_id]
        grow[seq.seq_id] = g
    # depth 1: the root's children
    live = [(seq, grow[seq.seq_id]) for seq, _ in drafting]
    log_q = torch.log_softmax(logits(torch.stack([g.f_hat[0] for _, g in live])).float(), -1).cpu()   # [B, V]
    newest = {seq.seq_id: g.add_children(0, lq, topk) for (seq, g), lq in zip(live, log_q)}
    for d in range(2, max((depth for _, depth in drafting), default=0) + 1):
        live = [(seq, g) for seq, g in live if g.depth >= d]
        if not live:
            break
        for seq, g in live:              # expand: the topk most valuable nodes of the newest layer
            layer = newest[seq.seq_id]
            g.expanded += sorted(layer, key=lambda n: (-g.values[n], n))[:topk]
        batch = []
        for seq, g in live:
            toks, feats, parents = g.fed()
            batch.append((seq.seq_id, draft_table[seq.seq_id], seq.num_computed_tokens, toks, feats, parents))
        f_hat = proposer._forward(batch)                                              # [sum of fed, C]
        start = 0
        for seq, g in live:
            n = len(g.expanded)
            for i, node in enumerate(g.expanded):
                g.f_hat[node] = f_hat[start + i]
            start += n
        fresh = [(seq, g, node) for seq, g in live for node in g.expanded if g.depths[node] == d - 1]
        log_q = torch.log_softmax(logits(torch.stack([g.f_hat[node] for _, g, node in fresh])).float(), -1).cpu()
        newest = {seq.seq_id: [] for seq, _ in live}
        for (seq, g, node), lq in zip(fresh, log_q):
            newest[seq.seq_id] += g.add_children(node, lq, topk)
    for seq, _ in drafting:
        seq.spec_token_ids, seq.spec_parents = grow[seq.seq_id].result(num_draft_tokens)
        seq.spec_probs = None            # children chosen deterministically: the tree rule needs no q
