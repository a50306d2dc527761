"""Exercise 1: the slot mapping (vLLM / PagedAttention, Kwon et al., SOSP'23, Sec. 4.1-4.2).

The KV cache is one pool of fixed-size *blocks*; each block holds ``block_size``
tokens. A sequence does not own a contiguous range of the pool: its *block
table* lists the physical blocks that hold its logical blocks 0, 1, 2, ...

    block_table = [5, 2]      block_size = 4
    positions 0..3 live in physical block 5, positions 4..7 in physical block 2

Every token has a **slot**, its place in the flattened pool ``[num_blocks * block_size]``
(block b's slots are b * block_size .. (b + 1) * block_size - 1). Work out from the picture above which
slot a position lands in; the example below checks your formula. (``exercises/hints/ex1.md`` spells it out.)

Before each step, the engine computes one slot per *new* token (the **slot
mapping**) so that the attention layer can write all the new keys and values
with one scatter, whatever mix of prefills and decodes the batch holds.

Run the tests:  MINIBATCH_STUDENT=slot_mapping python -m pytest tests/exercises -m ex1
"""
from __future__ import annotations

import torch


def slot_mapping(block_tables, starts, counts, block_size: int, device="cpu") -> torch.Tensor:
    """slots[T] int64 of the new tokens: sequence b's positions starts[b] .. starts[b] + counts[b] - 1.

    block_tables: B lists of physical block ids (sequence b's block table, logical order).
    starts[b]:    how many tokens of sequence b are already in the cache (its first new position).
    counts[b]:    how many new tokens sequence b feeds this step (1 for a decode, more for a prefill).
    Returns a 1-D int64 tensor on ``device`` with T = sum(counts) entries, in batch order:
    sequence 0's new tokens first (by position), then sequence 1's, and so on.

    Example: block_tables [[5, 2], [7]], starts [3, 0], counts [3, 2], block_size 4
             -> positions (3, 4, 5) of sequence 0 and (0, 1) of sequence 1
             -> slots [23, 8, 9, 28, 29]

    You may assume every position falls inside the blocks its table holds (the allocator handed
    them out before the step). The tests also ask for device="meta", a device that holds shapes
    but no values: build the slots on the CPU and move the result at the end.
    """
    raise NotImplementedError("Exercise 1: slot_mapping (exercises/ex1_slot_mapping.py)")
