"""A step's attention metadata: the scheduler's plain lists turned into tensors, and checked, once.

``AttentionMetadata.build`` is the one place a step's shape is checked (lengths agree, counts are sane, every
position has a block, the tables' block ids are >= 0, trees are trees); the per-layer call
(``attention.PagedAttention``) and every backend (``backends/``) then read it without checking again.
Sequence b feeds ``num_new[b]`` tokens after ``num_computed[b]`` cached ones: its query i sits at position
``num_computed[b] + i``, or, for a token tree's node i, at ``num_computed[b] + depth[i]`` (``tree.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from minibatch.kv import tree      # tree.mask_bits / positions looked up per call: an exercise patches them
from minibatch.kv.kv_cache import block_table_tensor, slot_mapping as _slot_mapping


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64, -1 = do not store
    block_tables: torch.Tensor       # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor           # [B] int32, context length including this step's tokens
    query_start_loc: torch.Tensor    # [B+1] int32
    max_query_len: int
    max_seq_len: int
    positions: Optional[torch.Tensor] = None      # [T] int64: where each new token sits in its sequence
    # host-side copies, so no backend has to read a device tensor back (a sync) to plan its work
    seq_lens_list: list = field(default_factory=list)
    query_lens_list: list = field(default_factory=list)
    max_block_id: int = -1                        # the largest block id any table holds
    plan: dict = field(default_factory=dict)      # backends cache what they derive once per step here
    tree_bits: Optional[torch.Tensor] = None      # [T] int64 tree mask rows (-1: plain causal); None: no tree
    # A fixed-shape decode batch (engine/input_batch.py): every row one query, the tensors views of persistent
    # buffers, padding rows with slot -1 and length 0. A graph-safe backend then plans from the device tensors
    # alone (no host list, no length-dependent shape), so a CUDA graph can replay the step.
    static: bool = False

    @classmethod
    def build(cls, block_tables, num_computed, num_new, block_size: int, device="cpu",
              tree_parents=None) -> "AttentionMetadata":
        """Sequence b has num_computed[b] tokens in the cache already and feeds num_new[b] new ones.

        tree_parents: None, or per sequence None (an ordinary one) or the parent list of the token tree its
        num_new[b] new tokens form (``tree.py``: node 0 = its first new token, the root).
        Every check on the step's shape happens here, once: lengths agree, counts are sane, every
        position has a block (``slot_mapping`` checks that), the tables' block ids are >= 0, trees are trees."""
        if not len(block_tables) == len(num_computed) == len(num_new):
            raise ValueError(f"block_tables, num_computed, num_new have different lengths "
                             f"({len(block_tables)}, {len(num_computed)}, {len(num_new)})")
        if any(n < 1 for n in num_new) or any(c < 0 for c in num_computed):
            raise ValueError(f"need num_new >= 1 and num_computed >= 0, got {list(num_new)}, {list(num_computed)}")
        trees = _check_trees(tree_parents, num_new)
        lens = [c + n for c, n in zip(num_computed, num_new)]
        slots = _slot_mapping(block_tables, num_computed, num_new, block_size, device)
        starts = [0]
        for n in num_new:
            starts.append(starts[-1] + n)
        positions, bits = [], []               # a tree node sits at context + its depth; siblings share one
        for c, n, parents in zip(num_computed, num_new, trees):
            if parents is None:
                positions += range(c, c + n)
                bits += [-1] * n
            else:
                positions += tree.positions(parents, c)
                bits += tree.mask_bits(parents)
        tree_bits = None if all(p is None for p in trees) else torch.tensor(bits, dtype=torch.int64, device=device)
        return cls(slots, block_table_tensor(block_tables, device),
                   torch.tensor(lens, dtype=torch.int32, device=device),
                   torch.tensor(starts, dtype=torch.int32, device=device),
                   max(num_new, default=0), max(lens, default=0),
                   torch.tensor(positions, dtype=torch.int64, device=device),
                   lens, list(num_new), max((max(t) for t in block_tables if len(t)), default=-1),
                   tree_bits=tree_bits)


def _check_trees(tree_parents, num_new) -> list:
    """tree_parents as a list of B entries, each None or a checked parent list of length num_new[b]."""
    if tree_parents is None:
        return [None] * len(num_new)
    if not isinstance(tree_parents, (list, tuple)) or len(tree_parents) != len(num_new):
        n = len(tree_parents) if isinstance(tree_parents, (list, tuple)) else type(tree_parents).__name__
        raise ValueError(f"tree_parents must be a list with one entry (None or a parent list) per sequence: "
                         f"{len(num_new)} sequences, got {n}")
    out = []
    for b, parents in enumerate(tree_parents):
        if parents is not None:
            try:
                parents = tree.check_parents(parents)
            except ValueError as e:
                raise ValueError(f"tree_parents[{b}]: {e}") from None
            if len(parents) != num_new[b]:
                raise ValueError(f"tree_parents[{b}] has {len(parents)} nodes, but sequence {b} feeds "
                                 f"num_new = {num_new[b]} new tokens: one node (the root included) per new token")
        out.append(parents)
    return out
