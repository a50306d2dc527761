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

    def fill(self, tokens: list, tables: list, computed: list, padded: int) -> None:
        """Row b < B feeds tokens[b] at position computed[b] of the sequence whose block table is tables[b];
        rows B .. padded-1 are padding. The slots are checked as every step's are (kv_cache.slot_mapping)."""
        B, W = len(tokens), self.width
        if not B <= padded <= self.max_batch or len(tables) != B or len(computed) != B:
            raise ValueError(f"a decode batch of {B} rows padded to {padded}: need B <= padded <= "
                             f"{self.max_batch} and one table and one count per row")
        if any(len(t) > W for t in tables):
            raise ValueError(f"a block table is longer than the buffers' width {W} (n_ctx / block_size)")
        h = self.host
        h["input_ids"][:B] = torch.tensor(tokens)
        h["positions"][:B] = torch.tensor(computed)
        h["slot_mapping"][:B] = kv_cache.slot_mapping(tables, computed, [1] * B, self.block_size)
        h["seq_lens"][:B] = torch.tensor(computed) + 1
        h["block_tables"][:B] = torch.tensor([list(t) + [-1] * (W - len(t)) for t in tables],
                                             dtype=torch.int32).view(B, W)
        for k in h:                                              # the padding rows
            h[k][B:padded] = -1 if k in ("slot_mapping", "block_tables") else 0
        if h["input_ids"] is not self.dev["input_ids"]:
            for k in h:
                self.dev[k][:padded].copy_(h[k][:padded], non_blocking=True)

    def metadata(self, padded: int) -> AttentionMetadata:
        """The attention metadata over the first ``padded`` rows: views of the buffers, ``static``, so a
        graph-safe backend reads the lengths from the device and every shape depends on ``padded`` alone.
        (max_block_id stays -1: the allocator's tables were checked in ``fill``.)"""
        d = self.dev
        return AttentionMetadata(d["slot_mapping"][:padded], d["block_tables"][:padded], d["seq_lens"][:padded],
                                 self.query_start_loc[:padded + 1], 1, self.width * self.block_size,
                                 d["positions"][:padded], query_lens_list=[1] * padded, static=True)
