"""Mutant (exercise 1): decode thinking: every new token goes into the last block of the table."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(start, start + count)
        out.append(int(table[-1]) * block_size + pos % block_size)  # BUG: table[pos // block_size]
    return torch.cat(out).to(device)
