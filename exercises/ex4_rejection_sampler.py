"""Exercise 4: the rejection sampler of speculative decoding (Leviathan et al., 2023, Sec. 2.3
and Appendix A.1; Chen et al., 2023, Algorithm 2 and Theorem 1).

A cheap proposer guessed k tokens x_1..x_k for a sequence, drawing x_i from its
distribution q_i (a small draft model), or with no distribution at all (an
n-gram lookup: q_i is then one-hot at x_i). The target model scored all k + 1
positions in one forward, giving p_1..p_{k+1}. Now, per row, for i = 1, 2, ...:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))      (draw u ~ U[0,1): accept if u < p/q)
    on the first rejection: emit one token drawn from the residual
        r_i = norm(max(0, p_i - q_i))            and stop
    if all k_b drafts were accepted: emit a *bonus* token drawn from p_{k_b+1}

The emitted tokens are then distributed exactly as if the target had sampled
them one by one, because for one position
    P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) r(x) = p(x).
So every step emits between 1 and k_b + 1 tokens, and loses nothing.

Greedy rows (temperature 0) need no randomness: accept x_i while it equals
argmax p_i; at the first mismatch emit argmax p_i; if all match, emit argmax p_{k_b+1}.

Run the tests:  MINIBATCH_STUDENT=rejection_sampler python -m pytest tests/exercises -m ex4
"""
from __future__ import annotations

from typing import Optional

import torch


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                     generators: Optional[list] = None, num_draft_tokens: Optional[list] = None,
                     greedy: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep a prefix of the drafts, then add one target token; row b reads only its first k_b drafts.

    draft_token_ids [B, k] int64: the guesses. Row b has k_b = num_draft_tokens[b] of them
        (k for every row when num_draft_tokens is None); entries past k_b are padding (e.g. -1):
        never read them.
    draft_probs [B, k, V] float: q_i, or None for one-hot drafts (n-gram). With q one-hot at x,
        the acceptance probability is p(x) and the residual is p with x removed. Row b's entries
        past k_b are padding too (anything, even NaN).
    target_probs [B, k+1, V] float: p_1..p_{k+1}; row b's bonus distribution is at index k_b.
    generators: None or B entries, each a torch.Generator or None. Draw every random number of
        row b from generators[b] (``torch.rand((), generator=g)``, ``torch.multinomial(d, 1, generator=g)``),
        so a seeded request samples the same tokens whatever else is in the batch.
    greedy: None or B bools; a greedy row uses argmax and no randomness.

    Returns (tokens [B, k+1] int64, num_accepted [B] int64), on target_probs' device. Row b of
    tokens is its accepted drafts, then the replacement (or bonus) token, then -1 up to k+1 entries,
    so row b has num_accepted[b] + 1 valid tokens.

    Example (greedy, k=3): drafts [1, 2, 9], argmax p = [1, 2, 3, 4] -> tokens [1, 2, 3, -1], accepted 2.

    Each position is a fresh trial: draw a new uniform for every draft you check, and stop at the
    first rejection (the accepted drafts are a prefix).

    Hints: a Python loop over rows, and over positions inside a row, is fine. Work in float64 on
    the CPU (``.double().cpu()``). ``torch.multinomial`` accepts weights that do not sum to 1,
    but not negative ones. If the residual is all zeros (p == q, so rejection was impossible),
    fall back to p.
    """
    raise NotImplementedError("Exercise 4: rejection_sample (exercises/ex4_rejection_sampler.py)")
