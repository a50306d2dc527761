"""Mutant (exercise 1), a wrapper: the slots are read off the "batched" attention backend's plan
(``minibatch.kv.backends.plan._static_decode_plan`` gathers every position of a row through its block table) instead of
being computed. Right wherever that backend is the reference; a student release computes attention through exercise
2 and has no such plan, so it must fail there."""
import types

import torch

from minibatch.kv.backends import plan


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        md = types.SimpleNamespace(block_tables=torch.tensor([list(table)]), seq_lens=torch.tensor([start + count]))
        slots = plan._static_decode_plan(md, block_size, "cpu")[0][0]           # BUG: the engine's, not mine
        out.append(slots[start:start + count])
    return torch.cat(out).to(device) if out else torch.zeros(0, dtype=torch.int64, device=device)
