"""Mutant (exercise 11, in exercise 1's file): maps a sequence's new tokens as if its block table began at its
first new token (``start`` taken off the position before the block lookup): right whenever nothing is cached
or computed before, as in a first prefill; a chunk after the first, a decode and a resumed prefix-cache hit
write their K/V into the wrong slots."""
import torch


def slot_mapping(block_tables, starts, counts, block_size, device="cpu"):
    out = []
    for table, start, count in zip(block_tables, starts, counts):
        for i in range(count):
            p = start + i
            out.append(table[i // block_size] * block_size + p % block_size)     # BUG: the block of i, not of p
    return torch.tensor(out, dtype=torch.int64, device=device)
