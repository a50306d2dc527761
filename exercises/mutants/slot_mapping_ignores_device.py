"""Mutant (exercise 1): right slots, but always on the CPU: the ``device`` argument is ignored."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(start, start + count)
        out.append(torch.tensor(list(table), dtype=torch.int64)[pos // block_size] * block_size + pos % block_size)
    return torch.cat(out)                                           # BUG: .to(device) forgotten
