"""Mutant (exercise 3): filters the caller's logits in place (masked_fill_), so the input changes."""
import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits.masked_fill_(logits < kth, float("-inf"))          # BUG: writes into the input
    if top_p < 1.0:
        probs = logits.softmax(-1)
        sorted_p, _ = probs.sort(descending=True)
        mass_before = sorted_p.cumsum(0) - sorted_p
        keep_sorted = mass_before < top_p
        threshold = sorted_p[keep_sorted].min()
        logits.masked_fill_(probs < threshold, float("-inf"))    # BUG: writes into the input
    return logits
