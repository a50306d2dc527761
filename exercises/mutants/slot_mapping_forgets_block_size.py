"""Mutant (exercise 1): adds the offset to the block id without scaling the block id by block_size."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(start, start + count)
        out.append(torch.tensor(list(table), dtype=torch.int64)[pos // block_size] + pos % block_size)  # BUG: * bs
    return torch.cat(out).to(device)
