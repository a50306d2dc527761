"""Mutant (exercise 3): runs the nucleus even at top_p = 1; the rounded cumulative mass reaches 1.0
before the tail, whose tiny probabilities are then dropped."""
import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p <= 1.0:                                       # BUG: top_p = 1 is off
        probs = logits.softmax(-1)
        sorted_p, _ = probs.sort(descending=True)
        mass_before = sorted_p.cumsum(0) - sorted_p
        keep_sorted = mass_before < top_p
        threshold = sorted_p[keep_sorted].min()
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
