"""What the torch backends derive from a step's metadata, once per step: the plan, shared by every layer.

A step's rows are split into groups (decodes, bucketed by context length; the rest: prefill, chunks,
verification, trees), and each group gets the slots to gather its context from the pool, the query rows it
reads, and its mask. ``batched.py`` gathers each group into a padded [G, L, Hkv, D] and hands it to
``scaled_dot_product_attention``; ``cpu.py`` does the same for its long rows only. A plan is cached in
``AttentionMetadata.plan`` under the backend's name, so every layer of the step reuses it.
"""
from __future__ import annotations

import itertools

import torch


def _buckets(rows: list, lens: list, max_waste: float = 0.3, max_buckets: int = 4) -> list:
    """Decode rows split by context length, so that padding every row of a group to its longest wastes
    little: the gather copies G x L_max rows of K and V per layer, and copying is most of the cost."""
    if len(rows) <= 2:
        return [rows]
    order = sorted(rows, key=lambda b: -lens[b])
    out = [[order[0]]]
    for b in order[1:]:
        if lens[b] < (1 - max_waste) * lens[out[-1][0]] and len(out) < max_buckets:
            out.append([])
        out[-1].append(b)
    return out if len(out) > 1 else [rows]         # one bucket: keep batch order (no scatter needed)


def _static_decode_plan(md, block_size: int, device) -> tuple:
    """A fixed-shape decode batch (``md.static``: every row one query, the shapes fixed by the buffers, not by
    the lengths): the plan from the device tensors alone, so a CUDA graph can replay it. Each row gathers the
    whole width of its block table, L = W * block_size positions, and masks past its own length; a padding row
    (length 0, table -1) reads slot 0 through position 0, finite and discarded."""
    bt = md.block_tables.to(device).long().clamp(min=0)                           # [P, W]
    L = bt.shape[1] * block_size
    j = torch.arange(L, device=device)
    slots = bt[:, j // block_size] * block_size + j % block_size                  # [P, L]
    valid = j[None] < md.seq_lens.to(device).long().clamp(min=1)[:, None]         # [P, L]
    slots = torch.where(valid, slots, slots[:, :1])            # past the length: position 0 again (see _plan)
    return slots, None, None, valid[:, None, None, :]                            # mask [P, 1, 1, L]


def _plan(md, block_size: int, device) -> list:
    """Once per step, for each group of rows (decodes; the rest): the gather slots [G, L], the flat query
    rows [G, Q] (None: the group is every row, in order, the same number of queries each), which of those are
    real [G, Q], and the mask [G, 1, Q, L] (None: nothing to mask), causal with each row's context offset, and
    for tree rows (only ever in the rest: a tree of 2+ nodes has q_len > 1; a root alone sees what a decode
    sees) the tree's."""
    if "batched" in md.plan:
        return md.plan["batched"]
    if md.static:
        md.plan["batched"] = [_static_decode_plan(md, block_size, device)]
        return md.plan["batched"]
    groups = []
    decodes = [b for b, n in enumerate(md.query_lens_list) if n == 1]
    rest = [b for b, n in enumerate(md.query_lens_list) if n > 1]
    for rows in (*_buckets(decodes, md.seq_lens_list), rest):
        if rows:
            groups.append(_group(md, rows, block_size, device))
    md.plan["batched"] = groups
    return groups


def _group(md, rows: list, block_size: int, device) -> tuple:
    """One group's (slots [G, L], q_rows [G, Q] or None, q_valid [G, Q] or None, mask [G, 1, Q, L] or None)
    for the sequences ``rows`` of the step (see ``_plan``)."""
    q_lens, s_lens = md.query_lens_list, md.seq_lens_list
    L, Q = max(s_lens[b] for b in rows), max(q_lens[b] for b in rows)
    sl = torch.tensor([s_lens[b] for b in rows], device=device)                  # [G]
    ql = torch.tensor([q_lens[b] for b in rows], device=device)                  # [G]
    j = torch.arange(L, device=device)
    valid = j[None] < sl[:, None]                                                # [G, L]
    bt = md.block_tables.to(device)[torch.tensor(rows, device=device)].long()    # [G, W]
    slots = bt[:, (j // block_size).clamp(max=bt.shape[1] - 1)].clamp(min=0) * block_size + j % block_size
    # A padding position (past a row's own length) gathers the row's position 0 instead: a real, finite
    # key that the mask then hides. (An unowned slot may hold NaN, and a masked 0 * NaN is still NaN.)
    slots = torch.where(valid, slots, slots[:, :1])                              # [G, L]
    i = torch.arange(Q, device=device)
    q_pos = (sl - ql)[:, None] + i[None]                                         # [G, Q]
    mask = (j[None, None, :] <= q_pos[:, :, None])[:, None]                      # [G, 1, Q, L]
    if Q == 1 and min(s_lens[b] for b in rows) == L:
        mask = None                                                              # decodes of one length
    if rows == list(range(len(q_lens))) and all(q_lens[b] == Q for b in rows):
        # every row of the batch, in order, Q queries each (decodes; one sequence's chunk or verify; a batch
        # verifying k drafts each): the flat [T, H, D] is [G, Q, H, D] already, no gather or scatter
        q_rows = q_valid = None
    else:
        starts = [0, *itertools.accumulate(q_lens)]                              # each row's first query
        q_valid = i[None] < ql[:, None]                                          # [G, Q]
        q_rows = (torch.tensor([starts[b] for b in rows], device=device)[:, None] + i[None]) * q_valid
    if md.tree_bits is not None and Q > 1:        # the tree mask, folded in once per step (see the loop)
        bits = md.tree_bits.to(device)                                             # [T]
        bits = bits.view(len(rows), Q) if q_rows is None else bits[q_rows]         # [G, Q]; padding: never read
        r = j[None] - (sl - ql)[:, None]                                           # [G, L] node index
        bit = (bits[:, :, None] >> r.clamp(0, 63)[:, None, :]) & 1                 # [G, Q, L]
        mask = mask & ((r < 0)[:, None, :] | (bit == 1))[:, None]                  # [G, 1, Q, L]
    return slots, q_rows, q_valid, mask
