"""Mutant (exercise 1): forgets the tokens already cached; numbers the new tokens from position 0."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(count)                                   # BUG: should start at `start`
        out.append(torch.tensor(list(table), dtype=torch.int64)[pos // block_size] * block_size + pos % block_size)
    return torch.cat(out).to(device)
