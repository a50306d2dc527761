"""The KV transfer of disaggregated serving: a prompt's K/V leaves the prefill instance's pool and arrives in
the decode instance's (DistServe §4; vLLM's ``KVConnector``, roles ``kv_producer`` / ``kv_consumer``).

The prefill instance computes a request's prompt and samples its first token, as any engine does. When that
sequence finishes there (its ``max_tokens`` was set to 1), the scheduler hands it to the **connector before
freeing its blocks** (``request_finished``, vLLM's hook). The connector gathers the prompt's K/V out of the
pool, one copy [layers, 2, n, kv_heads, head_dim] in position order, and the blocks go back to the free list
at once. After the step it sends the copy to the decode instance with ``torch.distributed`` point-to-point
(``dist.send``; gloo over TCP on a CPU, NCCL between GPUs), after a header on the control queue that says what
follows. vLLM's connectors instead keep the blocks until an asynchronous transfer is done
(``delay_free_blocks``); copying first costs one gather and frees the pool sooner, which suits a step loop
that transfers synchronously.

The decode instance allocates blocks for the prompt (a prefix-cache hit gives back blocks it holds already:
those keep their own K/V, which equal the received ones, and are never written, so a block shared with
another sequence is never touched), writes the received K/V of the remaining positions into their slots
(the slot mapping), registers the full blocks in its prefix cache, and the sequence joins the running batch
with num_computed_tokens = prompt length: its next step is a plain decode of the first token.

Bytes per request: 2 (K and V) x layers x prompt tokens x kv_heads x head_dim x element size; for the tiny
target, 2 x 4 x 256 x 4 = 8 KiB per prompt token in float32. ``transfer_bytes`` is the one formula.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minibatch.kv.kv_cache import slot_mapping

PREFILL_RANK, DECODE_RANK = 0, 1


def transfer_bytes(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    return 2 * num_layers * num_tokens * num_kv_heads * head_dim * elem_bytes


@dataclass
class Transfer:
    """One request's handoff, as the trace records it (``KVTransferEvent``)."""
    request_id: str
    num_tokens: int
    src_blocks: list                 # the prefill instance's blocks it came from
    nbytes: int
    t_start: float = 0.0             # time.perf_counter, shared by the processes of one machine
    duration: float = 0.0
    dst_blocks: list = field(default_factory=list)


def gather_prompt(kv_cache, block_table: list, num_tokens: int, block_size: int) -> torch.Tensor:
    """The K/V of positions 0 .. num_tokens-1 of one sequence: a copy [L, 2, n, Hkv, D]."""
    L, _, N, bs, H, D = kv_cache.kv.shape
    slots = slot_mapping([block_table], [0], [num_tokens], block_size, kv_cache.device)
    return kv_cache.kv.view(L, 2, N * bs, H, D)[:, :, slots].clone()


def scatter_prompt(kv_cache, block_table: list, start: int, kv: torch.Tensor, block_size: int) -> None:
    """Write kv [L, 2, n, Hkv, D] (positions 0 .. n-1) at positions start .. n-1 of the sequence's slots."""
    L, _, N, bs, H, D = kv_cache.kv.shape
    n = kv.shape[2]
    if n <= start:
        return
    slots = slot_mapping([block_table], [start], [n - start], block_size, kv_cache.device)
    kv_cache.kv.view(L, 2, N * bs, H, D)[:, :, slots] = kv[:, :, start:].to(kv_cache.device, kv_cache.dtype)


class KVSender:
    """The prefill side's connector: gathers at ``request_finished``, sends after the step."""

    def __init__(self, kv_cache, block_size: int, wants):
        self.kv_cache, self.block_size = kv_cache, block_size
        self.wants = wants               # seq -> bool: does this finished sequence go on decoding elsewhere?
        self.pending: list = []          # (seq, kv copy, Transfer)

    def request_finished(self, seq, block_table: list) -> None:
        if seq.finish_reason != "length" or not self.wants(seq):
            return
        n = seq.num_computed_tokens      # the prompt (the first token's K/V is computed by the decode side)
        kv = gather_prompt(self.kv_cache, block_table, n, self.block_size)
        self.pending.append((seq, kv, Transfer(seq.request_id, n, list(block_table[: -(-n // self.block_size)]),
                                               kv.numel() * kv.element_size())))

    def send_all(self, header_queue, make_header) -> list:
        """Send every pending copy: its header on the queue, then the tensor. Returns the Transfers."""
        done, self.pending = self.pending, []
        out = []
        for seq, kv, tr in done:
            tr.t_start = time.perf_counter()
            header_queue.put(make_header(seq, tuple(kv.shape), tr))
            dist.send(kv.contiguous(), dst=DECODE_RANK)
            tr.duration = time.perf_counter() - tr.t_start
            out.append(tr)
        return out


def receive(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The decode side: the tensor that follows a header (blocks until it has arrived, or the timeout)."""
    kv = torch.empty(shape, dtype=dtype)
    dist.recv(kv, src=PREFILL_RANK)
    return kv
