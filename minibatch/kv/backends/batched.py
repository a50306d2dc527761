"""Backend "batched", the default on a GPU: the whole batch gathered at once, then one SDPA call per group.

The rows are split into decodes (q_len 1) and the rest (prefill, chunks, verification), and each group is
gathered at once into padded [G, L, Hkv, D] and handed to ``scaled_dot_product_attention`` with one mask.
What it derives from the metadata (gather indices, masks) is built once per step, not per layer
(``plan.py``). The same answer as the teaching loop (``loop.py``), which reads the same layout one sequence
at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minibatch.kv.backends import plan
from minibatch.kv.checks import _check_attention
from minibatch.kv.metadata import AttentionMetadata


def paged_attention_batched(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                            tree_bits=None, k_scale=None, v_scale=None):
    """Same as paged_attention_loop, for the whole batch at once (two groups: decodes and the rest)."""
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     "paged_attention_batched", tree_bits, k_scale, v_scale)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    md = AttentionMetadata(None, block_tables, seq_lens, query_start_loc, 0, 0, None,
                           lens, [e - s for s, e in zip(qsl[:-1], qsl[1:])], tree_bits=tree_bits)
    return _batched(query, key_cache, value_cache, md, scale, k_scale, v_scale)


def _batched(query, key_cache, value_cache, md, scale, k_scale=None, v_scale=None):
    T, H, D = query.shape
    if T == 0:
        return torch.zeros_like(query)
    out = None
    for slots, q_rows, q_valid, mask in plan._plan(md, key_cache.shape[1], query.device):
        o = _sdpa_group(query, key_cache, value_cache, slots, q_rows, mask, scale, k_scale, v_scale)  # [G, Q, H, D]
        if q_rows is None:
            return o.reshape(T, H, D)                                                # the flat rows, in order
        if out is None:           # one spare row T: a group's padding queries land there (no boolean mask,
            out = query.new_empty(T + 1, H, D)                              # so no host sync), then dropped
        rows = torch.where(q_valid, q_rows, T).view(-1)
        out.index_copy_(0, rows, o.reshape(-1, H, D))
    return out[:T]


def _sdpa_group(query, key_cache, value_cache, slots, q_rows, mask, scale, k_scale=None, v_scale=None):
    """One group's attention: its context gathered out of the pool, then one SDPA call. -> [G, Q, H, D]
    A quantized cache's gathered rows are dequantized on the way (their scales gathered by the same slots)."""
    T, H, D = query.shape
    N, bs, Hkv, _ = key_cache.shape
    # CPU matmuls in half precision are slow or missing: compute in float32 there, natively on a GPU
    dt = torch.float32 if query.device.type == "cpu" else query.dtype
    flat_k, flat_v = key_cache.view(N * bs, Hkv, D), value_cache.view(N * bs, Hkv, D)
    G, L = slots.shape                              # (index_select copies rows about 2x faster than x[slots])
    k = flat_k.index_select(0, slots.view(-1)).view(G, L, Hkv, D)
    v = flat_v.index_select(0, slots.view(-1)).view(G, L, Hkv, D)
    if k_scale is not None:
        k, v = (_dequantize(x, sc, slots, dt) for x, sc in ((k, k_scale), (v, v_scale)))
    k, v = k.to(dt).transpose(1, 2), v.to(dt).transpose(1, 2)                          # [G, Hkv, L, D]
    q = query.view(G, -1, H, D) if q_rows is None else query[q_rows]                 # [G, Q, H, D]
    o = F.scaled_dot_product_attention(q.to(dt).transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=H != Hkv).transpose(1, 2)          # [G, Q, H, D]
    return o.to(query.dtype)


def _dequantize(x, scale, slots, dt):
    """Gathered quantized rows x [G, L, Hkv, D] -> x * scale in dt: one scale (per tensor), or each row's own,
    gathered out of the scale cache [num_blocks, block_size, Hkv] by the same slots [G, L]."""
    if scale.numel() != 1:
        scale = scale.view(-1, x.shape[2]).index_select(0, slots.view(-1)).view(*x.shape[:3], 1)   # [G, L, Hkv, 1]
    return (x.to(torch.float32) * scale).to(dt)
