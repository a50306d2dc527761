"""Mutant (exercise 1): off by one, the first new token taken to be at position start + 1."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(start + 1, start + count + 1)              # BUG: one position too far
        blocks = torch.tensor(list(table) + [0], dtype=torch.int64)[pos // block_size]
        out.append(blocks * block_size + pos % block_size)
    return torch.cat(out).to(device)
