"""Mutant (exercise 1): adds the whole position to the block's first slot instead of the offset inside the block."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(start, start + count)
        out.append(torch.tensor(list(table), dtype=torch.int64)[pos // block_size] * block_size + pos)  # BUG: % bs
    return torch.cat(out).to(device)
