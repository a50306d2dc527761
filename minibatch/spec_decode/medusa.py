"""The Medusa proposer (Cai et al. 2024, Medusa-1, §2.1): extra heads on the target guess k tokens at once.

Head i reads the target's last hidden state h_t (the ln_f output that feeds the LM head) and guesses
the token at t + 2 + i, while the target's own head gives t + 1 (``minibatch/model/heads.py``). The
hidden state is the one the step just computed: the model runner asks the target for it (``hidden_states
= ("final",)``) at the rows that produced each sequence's newest token. So proposing costs **no extra
sequential model pass**: one small batched matmul per head, on rows already in hand. That is Medusa's
whole point against a draft model, which runs k passes of its own every step.

This is the *chain* form: the proposal is the top-1 token of heads 0 .. k-1. The heads do not see one
another's guesses (head 2 guesses t + 4 without knowing what head 1 guessed for t + 3), which is why
their accuracy falls with i and why Medusa's tree (§2.1.2, the next issue) tries several top-k
combinations at once.

Lossless at any temperature: the drafts are deterministic (top-1), so q is one-hot (``spec_probs =
None``) and the rejection sampler accepts x with probability p(x), else samples norm(max(0, p - q)).
Medusa's *typical acceptance* (§2.3.1) accepts far more at temperature > 0 but is lossy: it is an
explicit opt-in (``"acceptance": "typical"``, ``typical.py``), never the default.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minibatch.spec_decode.proposer import Proposer, hidden_rows, proposal_budget


class MedusaProposer(Proposer):
    method = "medusa"
    sequential_passes = 0
    hidden_states = ("final",)

    def __init__(self, heads, k: int):
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

    def guesses(self, h: torch.Tensor) -> torch.Tensor:
        """h[B, C] -> the top-1 token of heads 0 .. k-1, [B, k] (= heads(h)[:, :k].argmax(-1), fused)."""
        B, C = h.shape
        z = h[:, None, :] + F.silu(h @ self.w_res + self.b_res).view(B, self.k, C)   # [B, k, C]
        return torch.bmm(z.transpose(0, 1), self.w_out).argmax(-1).t()               # [k, B, V] -> [B, k]

    @torch.no_grad()
    def propose(self, seqs, runner_output, scheduler_output) -> None:
        rows = hidden_rows(seqs, runner_output, scheduler_output)
        todo = [(s, proposal_budget(s, self.k)) for s in seqs if s.seq_id in rows]
        for seq, _ in todo:
            seq.spec_token_ids, seq.spec_probs = [], None
        todo = [(s, k) for s, k in todo if k > 0]
        if not todo:
            return
        h = runner_output.hidden_states["final"][[rows[s.seq_id] for s, _ in todo]]    # [B, C]
        guesses = self.guesses(h.to(self.w_res.dtype)).tolist()                            # [B, k]
        for (seq, k), g in zip(todo, guesses):
            seq.spec_token_ids = g[:k]                            # q one-hot: spec_probs stays None
