"""A decode step's inputs in persistent, preallocated buffers (vLLM's ``InputBatch``, nano-vllm's ``prepare_decode``).

The eager path builds a step's tensors from Python lists, new ones every step. A decode step that a CUDA graph
replays cannot: the graph reads fixed addresses. So the buffers here are made once, at the largest batch, and
each step writes into their first P rows, P being the batch padded up to a captured size:

    input_ids    [P]      int64   the token each row feeds                  padding: 0
    positions    [P]      int64   its position (= tokens before it)        padding: 0
    slot_mapping [P]      int64   where its K/V goes                       padding: -1 (write nowhere)
    seq_lens     [P]      int32   context including it                     padding: 0
    block_tables [P, W]   int32   W = ceil(n_ctx / block_size), -1 padded  padding: all -1
    query_start_loc [P+1] int32   0, 1, ..., P (one query per row; fixed, written once)

The block tables persist across steps (vLLM's ``InputBatch`` keeps its ``block_table`` the same way): row b
remembers which sequence's table it holds and how much of it, and a step writes only what changed. A sequence
still in row b with the blocks it had, plus any new ones, gets just the new entries written (a decode step adds
one block every block_size tokens); a row that another sequence now holds (one joined, one left, the order
shifted), or whose blocks changed (copy-on-write gave it a new last block, preemption new blocks altogether), is
written whole; padding rows are -1 and forget what they held. The 1-D inputs (tokens, positions, slots, lengths)
change every step and are written every step.

On CUDA each buffer has a pinned host twin: a step fills the host side with plain CPU writes, then one
``copy_(non_blocking=True)`` per buffer sends it, asynchronous with the host. (Rewriting a pinned buffer while
its last copy is still in flight would race; it cannot happen here, as the step before ended in the sampler's
``.tolist()``, which waits for the stream.) On the CPU host and device buffers are the same tensors.
"""
from __future__ import annotations

import torch

from minibatch.kv.attention import AttentionMetadata
from minibatch.kv import kv_cache         # kv_cache.slot_mapping looked up per call: exercise 1 patches it


class DecodeBuffers:
    def __init__(self, max_batch: int, n_ctx: int, block_size: int, device):
        self.device, self.block_size = torch.device(device), block_size
        self.width = -(-n_ctx // block_size)                     # W: blocks of the longest context
        pin = self.device.type == "cuda"
        specs = {"input_ids": ((max_batch,), torch.int64, 0), "positions": ((max_batch,), torch.int64, 0),
                 "slot_mapping": ((max_batch,), torch.int64, -1), "seq_lens": ((max_batch,), torch.int32, 0),
                 "block_tables": ((max_batch, self.width), torch.int32, -1)}
        self.host = {k: torch.full(shape, fill, dtype=dt, pin_memory=pin) for k, (shape, dt, fill) in specs.items()}
        self.dev = {k: v.to(self.device) if pin else v for k, v in self.host.items()}
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)
        self.max_batch = max_batch
        self.held: list = [None] * max_batch      # row b: (sequence id, the table entries written), or None
        self.table_writes = 0                     # block-table entries written by fill, all steps (tests read it)

    def fill(self, tokens: list, tables: list, computed: list, padded: int, seq_ids=None) -> None:
        """Row b < B feeds tokens[b] at position computed[b] of the sequence whose block table is tables[b]
        (seq_ids[b] names it; without seq_ids every table is written whole); rows B .. padded-1 are padding.
        The slots are checked as every step's are (kv_cache.slot_mapping)."""
        B, W = len(tokens), self.width
        if not B <= padded <= self.max_batch or len(tables) != B or len(computed) != B \
                or (seq_ids is not None and len(seq_ids) != B):
            raise ValueError(f"a decode batch of {B} rows padded to {padded}: need B <= padded <= "
                             f"{self.max_batch} and one table, one count (and one id) per row")
        if any(len(t) > W for t in tables):
            raise ValueError(f"a block table is longer than the buffers' width {W} (n_ctx / block_size)")
        h = self.host
        h["input_ids"][:B] = torch.tensor(tokens)
        h["positions"][:B] = torch.tensor(computed)
        h["slot_mapping"][:B] = kv_cache.slot_mapping(tables, computed, [1] * B, self.block_size)
        h["seq_lens"][:B] = torch.tensor(computed) + 1
        self._fill_tables(tables, seq_ids)
        for k in h:                                              # the padding rows
            h[k][B:padded] = -1 if k in ("slot_mapping", "block_tables") else 0
        self.held[B:padded] = [None] * (padded - B)
        if h["input_ids"] is not self.dev["input_ids"]:
            for k in h:
                self.dev[k][:padded].copy_(h[k][:padded], non_blocking=True)

    def _fill_tables(self, tables: list, seq_ids) -> None:
        """Write each row's block table, or only its new entries where the row still holds that sequence's."""
        bt = self.host["block_tables"]
        for b, table in enumerate(tables):
            held = self.held[b]
            n = len(held[1]) if held is not None else 0
            same = held is not None and seq_ids is not None and held[0] == seq_ids[b]
            if same and len(table) >= n and table[:n] == held[1]:
                if len(table) > n:                                  # the sequence's new blocks only
                    bt[b, n:len(table)] = torch.tensor(table[n:], dtype=torch.int32)
                    self.table_writes += len(table) - n
            else:                                                   # another sequence, or its blocks changed
                bt[b, :len(table)] = torch.tensor(table, dtype=torch.int32)
                bt[b, len(table):] = -1
                self.table_writes += self.width
            self.held[b] = (seq_ids[b], list(table)) if seq_ids is not None else None

    def metadata(self, padded: int) -> AttentionMetadata:
        """The attention metadata over the first ``padded`` rows: views of the buffers, ``static``, so a
        graph-safe backend reads the lengths from the device and every shape depends on ``padded`` alone.
        (max_block_id stays -1: the allocator's tables were checked in ``fill``.)"""
        d = self.dev
        return AttentionMetadata(d["slot_mapping"][:padded], d["block_tables"][:padded], d["seq_lens"][:padded],
                                 self.query_start_loc[:padded + 1], 1, self.width * self.block_size,
                                 d["positions"][:padded], query_lens_list=[1] * padded, static=True)
