"""Exercise 3: top-k and top-p (nucleus) filtering of one row of logits.

The sampler turns a request's logits into a distribution in a fixed order:

    logits / temperature  ->  keep the top-k  ->  keep the top-p nucleus  ->  softmax  ->  draw

You write the two "keep" steps. Filtering means setting a logit to -inf, so that
the softmax gives it probability 0 and renormalises over what is left.

* **top-k** keeps the k largest logits. Ties: every token whose logit *equals* the
  k-th largest is kept too, so the kept set never depends on how a sort orders
  equal values (you may keep more than k tokens). k <= 0 or k >= V: no filtering.
* **top-p** (Holtzman et al., "The Curious Case of Neural Text Degeneration",
  ICLR 2020, Sec. 3.1) keeps the *smallest* set of most probable tokens whose
  total probability reaches top_p. The token that crosses the boundary is kept
  (with top_p = 0.6 and probabilities 0.5, 0.3, 0.2 you keep 0.5 and 0.3); a set
  whose mass *equals* top_p has reached it (top_p = 0.8 keeps 0.5 and 0.3 only),
  and any token tied with the last one kept is kept too. top_p = 1: no filtering.
  The probabilities are those of the logits *after* top-k (softmax over what
  top-k kept), since top-k runs first.

Run the tests:  MINIBATCH_STUDENT=top_k_top_p python -m pytest tests/exercises -m ex3
"""
from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits[V] -> logits[V] with every token outside the top-k and the top-p nucleus set to -inf.

    top_k: -1 or 0 = off; top_p in (0, 1], 1.0 = off. Kept logits keep their values unchanged
    (do not normalise them); return a new tensor, or the input itself when nothing is filtered.
    Never write into ``logits`` itself: the caller still uses it (``masked_fill``, not ``masked_fill_``).

    (Stuck on ties or on mapping a sorted decision back to vocabulary order? ``exercises/hints/ex3.md``.)
    """
    raise NotImplementedError("Exercise 3: apply_top_k_top_p (exercises/ex3_top_k_top_p.py)")
