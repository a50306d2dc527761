"""Scratch blocks: how a drafter that shares the target's KV cache drafts past what the target computed.

Early exit and EAGLE draft *inside the target's cache*. Early exit runs the target's own first E
layers, so for every token the target has computed, the draft's K/V at those layers *are* the target's
(LayerSkip, Elhoushi et al. 2024 §4.2): the drafter needs no prefill and no cache of its own, it reads
the target's block table. EAGLE's head keeps its K/V as one more layer of the same cache (vLLM V1).

But drafting also writes K/V, for positions the target has not computed yet: the last sampled token and
the drafts. Those positions have no slots (the scheduler gives them out at the next step, as a verify)
and the drafts may be rejected. So the drafter writes them into **scratch blocks**: a few blocks past the
allocator's pool, in the same tensor, which no sequence owns (as static batching's padding rows do).

For a sequence with m computed tokens, drafting positions m .. m + n - 1, its drafting block table is

    target_table[: m // bs]                          full blocks, read in place (never written)
    + [copy of target_table[m // bs]]                if m % bs: the partly filled block, copied (its first
                                                     m % bs slots are context; the rest take drafts)
    + fresh scratch blocks                           until the table covers m + n positions

so the target's blocks are never written by a drafter: rejected drafts leave nothing behind, and a
block shared by the prefix cache or a fork is safe. When the target verifies the drafted positions, early
exit copies their K/V from scratch into the slots the scheduler then gives them (LayerSkip's KV reuse; with
``kv_reuse=False`` the target recomputes them instead: see early_exit.py).
"""
from __future__ import annotations

import math


def scratch_blocks_per_seq(block_size: int, num_positions: int) -> int:
    """Blocks one sequence needs to draft ``num_positions`` positions from any offset in a block."""
    return math.ceil((block_size - 1 + num_positions) / block_size)


class ScratchTables:
    def __init__(self, kv_cache, first_block: int, num_blocks: int, block_size: int, layers):
        if first_block + num_blocks > kv_cache.num_blocks:
            raise ValueError(f"scratch blocks {first_block}..{first_block + num_blocks - 1} lie past the cache's "
                             f"{kv_cache.num_blocks} blocks")
        self.kv_cache, self.first, self.num_blocks, self.block_size = kv_cache, first_block, num_blocks, block_size
        self.layers = list(layers)                # the cache layers the drafter reads and writes

    def tables(self, items) -> list:
        """items: [(target block table, m computed, n positions to draft)] -> drafting block tables.

        Scratch blocks are handed out afresh every call (drafting ends within a call); the partly filled
        blocks are copied in one gather, at the drafter's layers only."""
        bs, nxt, out, self.copies = self.block_size, self.first, [], []
        for table, m, n in items:
            tbl = list(table[: m // bs])
            if m % bs:
                self.copies.append((table[m // bs], nxt, m % bs))     # (target block, its copy, slots in use)
                tbl.append(nxt)
                nxt += 1
            while len(tbl) * bs < m + n:
                tbl.append(nxt)
                nxt += 1
            out.append(tbl)
        if nxt > self.first + self.num_blocks:
            raise RuntimeError(f"drafting needs {nxt - self.first} scratch blocks, {self.num_blocks} were reserved")
        if self.copies:
            kv = self.kv_cache.kv                  # [layers, 2, blocks, bs, H, D]
            src, dst = [c[0] for c in self.copies], [c[1] for c in self.copies]
            for layer in self.layers:
                kv[layer, :, dst] = kv[layer, :, src]
        return out

    def copy_back(self) -> None:
        """EAGLE writes its entries for *computed* positions in the same pass as its first draft; those that fell
        in a partly filled block went to the copy. Return them (the first m % bs slots) to the target's block."""
        kv = self.kv_cache.kv
        for real, copy, n in self.copies:
            for layer in self.layers:
                kv[layer, :, real, :n] = kv[layer, :, copy, :n]
