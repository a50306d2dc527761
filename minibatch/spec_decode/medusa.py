"""The Medusa proposer (Cai et al. 2024, Medusa-1, §2.1): extra heads on the target guess k tokens at once.

Head i reads the target's last hidden state h_t (the ln_f output that feeds the LM head) and guesses
the token at t + 2 + i, while the target's own head gives t + 1 (``minibatch/model/heads.py``). The
hidden state is the one the step just computed: the model runner asks the target for it (``hidden_states
= ("final",)``) at the rows that produced each sequence's newest token. So proposing costs **no extra
sequential model pass**: one small batched matmul per head, on rows already in hand. That is Medusa's
whole point against a draft model, which runs k passes of its own every step.

The *chain* form proposes the top-1 token of heads 0 .. k-1. The heads do not see one another's guesses
(head 2 guesses t + 4 without knowing what head 1 guessed for t + 3), which is why their accuracy falls
with i, and why Medusa's **tree** (§2.1.2; ``"tree": "static"`` or a list of choices) verifies several
top-k combinations at once: node (r_0, ..., r_{d-1}) is head (d-1)'s rank-r_{d-1} guess under the node
(r_0, ..., r_{d-2}). The tree's shape is fixed (``medusa_tree.py`` chooses it from held-out acceptance);
only its tokens change per step, read off each head's top-k in one gather.

Lossless at any temperature: the drafts are deterministic (top-1), so q is one-hot (``spec_probs =
None``) and the rejection sampler accepts x with probability p(x), else samples norm(max(0, p - q)).
Medusa's *typical acceptance* (§2.3.1) accepts far more at temperature > 0 but is lossy: it is an
explicit opt-in (``"acceptance": "typical"``, ``typical.py``), never the default.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minibatch.spec_decode.proposer import Proposer, hidden_rows, proposal_budget
from minibatch.kv.tree import from_choices


class MedusaProposer(Proposer):
    method = "medusa"
    sequential_passes = 0
    hidden_states = ("final",)

    def __init__(self, heads, k=None, tree=None):
        # tree: None (a chain of k), or Medusa's static tree as a list of choices (tree.from_choices)
        self.parents = None
        if tree is not None:
            self.parents, order = from_choices(tree)
            self.choices = order[1:]                                 # node i + 1 is choices[i], parents first
            depth = max(map(len, self.choices))
            if k is not None and k != depth:
                raise ValueError(f"num_speculative_tokens={k}, but the Medusa tree is {depth} deep (leave it out)")
            if depth > heads.num_heads:
                raise ValueError(f"the tree is {depth} deep but the medusa checkpoint has {heads.num_heads} heads "
                                 f"(a node at depth d is head d-1's guess)")
            k = depth
            self.tree_nodes = self.num_lookahead_slots = len(self.choices)
            # node i + 1's token: head (depth - 1)'s rank (last rank) guess, read from the heads' top-r table
            self.node_head = torch.tensor([len(c) - 1 for c in self.choices])                 # [N]
            self.node_rank = torch.tensor([c[-1] for c in self.choices])                      # [N]
            self.top_r = int(self.node_rank.max()) + 1
            if self.top_r > heads.vocab_size:
                raise ValueError(f"a tree choice asks for rank {self.top_r - 1}, past the vocabulary "
                                 f"({heads.vocab_size} tokens)")
            self.num_at_depth = [sum(len(c) <= d for c in self.choices) for d in range(depth + 1)]
        if k > heads.num_heads:
            raise ValueError(f"num_speculative_tokens={k} but the medusa checkpoint has {heads.num_heads} heads: "
                             f"head i guesses token t + 2 + i, so k can be at most {heads.num_heads}")
        super().__init__(k)
        self.heads = heads
        # The first k heads as two batched ops (one matmul for the residual blocks, one bmm for the
        # projections), built once: per step they run on one row per sequence, where call overhead dominates.
        with torch.no_grad():
            self.w_res = torch.cat([lin.weight.t() for lin in heads.res[:k]], dim=1).contiguous()   # [C, k C]
            self.b_res = torch.cat([lin.bias for lin in heads.res[:k]])                            # [k C]
            self.w_out = torch.stack([lin.weight.t() for lin in heads.lm_head[:k]]).contiguous()   # [k, C, V]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h[B, C] -> heads 0 .. k-1's logits, [k, B, V] (= heads(h)[:, :k].transpose(0, 1), fused)."""
        B, C = h.shape
        z = h[:, None, :] + F.silu(h @ self.w_res + self.b_res).view(B, self.k, C)   # [B, k, C]
        return torch.bmm(z.transpose(0, 1), self.w_out)                              # [k, B, V]

    def guesses(self, h: torch.Tensor) -> torch.Tensor:
        """h[B, C] -> the top-1 token of heads 0 .. k-1, [B, k]."""
        return self.logits(h).argmax(-1).t()

    def tree_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """h[B, C] -> every tree node's token, [B, N]: node c = (r_0 .. r_{d-1}) takes head d-1's rank r_{d-1}."""
        top = self.logits(h).topk(self.top_r, dim=-1).indices                        # [k, B, r]
        return top[self.node_head, :, self.node_rank].t()                            # [N, B] -> [B, N]

    @torch.inference_mode()
    def propose(self, seqs, runner_output, scheduler_output) -> None:
        rows = hidden_rows(seqs, runner_output, scheduler_output)
        todo = [(s, proposal_budget(s, self.k)) for s in seqs if s.seq_id in rows]
        for seq, _ in todo:
            seq.clear_spec()
        todo = [(s, k) for s, k in todo if k > 0]
        if not todo:
            return
        h = runner_output.hidden_states["final"][[rows[s.seq_id] for s, _ in todo]].to(self.w_res.dtype)   # [B, C]
        if self.parents is None:
            for (seq, k), g in zip(todo, self.guesses(h).tolist()):                            # [B, k]
                seq.spec_token_ids = g[:k]                        # q one-hot: spec_probs stays None
            return
        for (seq, k), toks in zip(todo, self.tree_tokens(h).tolist()):                         # [B, N]
            n = self.num_at_depth[k]              # near max_tokens: only the nodes at depth <= k (listed first)
            seq.spec_token_ids, seq.spec_parents = toks[:n], self.parents[: n + 1]
