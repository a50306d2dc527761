"""Mutant (exercise 3), a wrapper: one row through the engine's batched filter (``top_k_top_p_batched``). Right
wherever that filter is the reference; a student release computes it through exercise 3 itself, so it must fail
there."""
import torch

from minibatch.sampling.sampler import top_k_top_p_batched


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    row = logits.reshape(1, -1)
    out = top_k_top_p_batched(row, torch.tensor([int(top_k or 0)]), torch.tensor([float(top_p)]))   # BUG
    return out.view(logits.shape)
