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

**Quantized blocks** (``kv_cache_dtype``, ``kv/quant.py``) travel as they are stored, one byte a value (fp8 as its
bytes: gloo has no float8), with their scales (a ``KVPayload``): per (token, head), the prompt's [L, 2, n, Hkv]
scales, written beside the values on the decode side; per tensor, the prefill side's layer scales [L, 2], which a
decode instance that calibrates (``calculate_kv_scales``) adopts, and which a decode instance with other scales
requantizes by (dequantize with the sender's, quantize with its own). The bytes on the wire shrink with the cache:
a quarter of float32's, plus the scales. (SGLang shipped a bug where a radix-cache hit dropped the scales, #24198:
the K/V were read back with the wrong ones, silently; a scale goes wherever its values go.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from minibatch.kv import quant
from minibatch.kv.kv_cache import _raw, slot_mapping

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


@dataclass
class KVPayload:
    """What a handoff sends: ``kv`` [L, 2, n, Hkv, D] in the pool's storage dtype, and ``scales``: None ("auto"),
    the layer scales [L, 2] (per tensor) or [L, 2, n, Hkv] (per token and head)."""
    kv: torch.Tensor
    scales: Optional[torch.Tensor] = None

    @property
    def shapes(self) -> tuple:
        return tuple(self.kv.shape), None if self.scales is None else tuple(self.scales.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.scales) if t is not None)


def _slots(kv_cache, block_table: list, start: int, n: int, block_size: int) -> torch.Tensor:
    return slot_mapping([block_table], [start], [n - start], block_size, kv_cache.device)


def gather_prompt(kv_cache, block_table: list, num_tokens: int, block_size: int) -> KVPayload:
    """The K/V of positions 0 .. num_tokens-1 of one sequence, copied (with their scales, if quantized)."""
    L, _, N, bs, H, D = kv_cache.kv.shape
    slots = _slots(kv_cache, block_table, 0, num_tokens, block_size)
    kv = _raw(kv_cache.kv).view(L, 2, N * bs, H, D)[:, :, slots].view(kv_cache.dtype)
    scales = kv_cache.scales
    if scales is not None:
        scales = scales.view(L, 2, N * bs, H)[:, :, slots] if scales.dim() > 2 else scales.clone()
    return KVPayload(kv, scales)


def scatter_prompt(kv_cache, block_table: list, start: int, payload: KVPayload, block_size: int) -> None:
    """Write the payload's positions start .. n-1 (of 0 .. n-1) into the sequence's slots, with their scales."""
    L, _, N, bs, H, D = kv_cache.kv.shape
    kv, scales = payload.kv, payload.scales
    n = kv.shape[2]
    if n <= start:
        return
    slots = _slots(kv_cache, block_table, start, n, block_size)
    kv = kv[:, :, start:].to(kv_cache.device)
    if scales is not None and scales.dim() > 2:              # per (token, head): the scales go with their values
        kv_cache.scales.view(L, 2, N * bs, H)[:, :, slots] = scales[:, :, start:].to(kv_cache.device)
    elif scales is not None:                                 # per tensor: adopt the sender's, or requantize
        scales = scales.to(kv_cache.device)
        kv_cache.adopt_scales(scales)
        if not torch.equal(scales, kv_cache.scales):
            x = kv.to(torch.float32) * scales[:, :, None, None, None]
            kv = quant._quantize(x, kv_cache.dtype, kv_cache.scales[:, :, None, None, None])
    if kv_cache.scales is None:
        kv = kv.to(kv_cache.dtype)
    _raw(kv_cache.kv).view(L, 2, N * bs, H, D)[:, :, slots] = _raw(kv)


class KVSender:
    """The prefill side's connector: gathers at ``request_finished``, sends after the step."""

    def __init__(self, kv_cache, block_size: int, wants):
        self.kv_cache, self.block_size = kv_cache, block_size
        self.wants = wants               # seq -> bool: does this finished sequence go on decoding elsewhere?
        self.pending: list = []          # (seq, KVPayload, Transfer)

    def request_finished(self, seq, block_table: list) -> None:
        if seq.finish_reason != "length" or not self.wants(seq):
            return
        n = seq.num_computed_tokens      # the prompt (the first token's K/V is computed by the decode side)
        payload = gather_prompt(self.kv_cache, block_table, n, self.block_size)
        self.pending.append((seq, payload, Transfer(seq.request_id, n, list(block_table[: -(-n // self.block_size)]),
                                                    payload.nbytes)))

    def send_all(self, header_queue, make_header) -> list:
        """Send every pending copy: its header on the queue, then the tensor. Returns the Transfers."""
        done, self.pending = self.pending, []
        out = []
        for seq, payload, tr in done:
            tr.t_start = time.perf_counter()
            header_queue.put(make_header(seq, payload.shapes, tr))
            dist.send(_raw(payload.kv).contiguous(), dst=DECODE_RANK)
            if payload.scales is not None:
                dist.send(payload.scales.contiguous(), dst=DECODE_RANK)
            tr.duration = time.perf_counter() - tr.t_start
            out.append(tr)
        return out


def receive(shapes: tuple, kv_cache) -> KVPayload:
    """The decode side: the tensors that follow a header (``KVPayload.shapes``), in ``kv_cache``'s storage dtype;
    blocks until they have arrived, or the timeout."""
    kv_shape, scales_shape = shapes
    kv = torch.empty(kv_shape, dtype=kv_cache.dtype)
    dist.recv(_raw(kv), src=PREFILL_RANK)              # (a view: the bytes land in kv)
    scales = None
    if scales_shape is not None:
        scales = torch.empty(scales_shape, dtype=quant.SCALE_DTYPE)
        dist.recv(scales, src=PREFILL_RANK)
    return KVPayload(kv, scales)
