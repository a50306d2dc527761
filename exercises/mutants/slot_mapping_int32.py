"""Mutant (exercise 1): right slots as int32 (the block table's dtype in the engine), not int64."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(start, start + count, dtype=torch.int32)
        blocks = torch.tensor(list(table), dtype=torch.int32)       # BUG: the slots come out int32
        out.append(blocks[pos // block_size] * block_size + pos % block_size)
    return torch.cat(out).to(device)
