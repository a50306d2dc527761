"""Mutant (exercise 1): reads counts[b] as the end position (positions start .. count - 1), not as a length."""
import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        pos = torch.arange(start, max(start, count))                # BUG: arange(start, start + count)
        out.append(torch.tensor(list(table), dtype=torch.int64)[pos // block_size] * block_size + pos % block_size)
    return torch.cat(out).to(device)
