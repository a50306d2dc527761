"""Mutant (exercise 3): the nucleus stops *before* the token that crosses top_p (cumsum <= top_p)."""
import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        probs = logits.softmax(-1)
        sorted_p, _ = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) <= top_p                  # BUG: the boundary token is dropped
        threshold = sorted_p[keep].min() if keep.any() else float("inf")
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
