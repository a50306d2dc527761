"""Mutant (exercise 3): the nucleus is measured on the original distribution, not on what top-k left."""
import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    probs = logits.softmax(-1)                                 # BUG: computed before top-k filters
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        sorted_p, _ = probs.sort(descending=True)
        keep_sorted = sorted_p.cumsum(0) - sorted_p < top_p
        logits = logits.masked_fill(probs < sorted_p[keep_sorted].min(), float("-inf"))
    return logits
