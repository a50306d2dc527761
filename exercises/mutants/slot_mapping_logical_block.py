"""Mutant (exercise 1): uses the logical block index instead of looking up the physical block."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(start, start + count)
        out.append((pos // block_size) * block_size + pos % block_size)   # BUG: table[pos // block_size]
    return torch.cat(out).to(device)
