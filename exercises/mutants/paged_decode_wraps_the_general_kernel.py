"""Mutant (exercise 9), a wrapper: no kernel of its own; the decode batch goes to the general kernel
(``kernels.paged_attention``, one query per sequence). Right wherever that kernel is the reference; a student release
launches exercise 9's kernel there, so it must fail there."""
import torch

from kernels.paged_attention import paged_attention


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, qsl, scale)   # BUG: the engine's
