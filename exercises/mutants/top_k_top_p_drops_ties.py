"""Mutant (exercise 3): keeps exactly k (and exactly the sorted nucleus) by index, so ties are cut arbitrarily."""
import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.numel():
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[torch.topk(logits, top_k).indices] = True        # BUG: ties with the k-th are dropped
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        sorted_p, order = logits.softmax(-1).sort(descending=True)
        keep_sorted = sorted_p.cumsum(0) - sorted_p < top_p
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[order[keep_sorted]] = True                       # BUG: ties with the boundary token are dropped
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits
