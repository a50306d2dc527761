"""Backend "loop": the teaching version of paged attention, and the torch store every torch backend shares.

Every backend reads the step's K/V from the paged cache (this step's own K/V are stored there first, by
``store_kv_torch`` here or a backend's own store), position p of sequence b living in physical block
``block_tables[b, p // block_size]`` at offset ``p % block_size`` (``kv/kv_cache.py``), and computes causal
attention with a context offset: query i of sequence b sits at position ``seq_lens[b] - q_len_b + i``.
Grouped-query attention: query head h reads kv head ``h // (H // Hkv)``. Quantized blocks (``kv/quant.py``): the
store quantizes with the layer's scales (per tensor: read; per token and head: computed from the rows and written
beside them, ``k_scale`` / ``v_scale`` [num_blocks, block_size, Hkv]), and attention dequantizes what it gathers.

A token tree adds one mask (SpecInfer, Miao et al. 2024, §4.1): ``tree_bits`` [T] int64, bit i of row t set =
query t sees this step's token i (cache index ``context_len + i``); the context stays visible and -1 is
plain causal. Query t sees key j iff ``j <= its index`` and (``j < context_len`` or that bit is set).

"loop" takes one sequence at a time: it gathers its K/V through its block table into a contiguous [L, Hkv, D],
then runs a plain masked softmax. Read this one first; every other backend (``batched.py``, ``cpu.py``,
``triton.py``) is held equal to it (``tests/test_attention.py``). Exercise 2 writes it
(``exercises/ex2_paged_attention.py``), and the engine calls it by its module-level name at each step, so that a
student's version can stand in for it.
"""
from __future__ import annotations

import torch

from minibatch.kv import quant
from minibatch.kv.checks import _check_attention, _check_cache, check_scales


# -- store ------------------------------------------------------------------------------
def store_kv_torch(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """key, value [T, Hkv, D] -> cache slot slot_mapping[t] (in place); slot -1 is skipped. A quantized cache
    takes its scales: one element each (per tensor), or [num_blocks, block_size, Hkv] each, written here."""
    who = "store_kv_torch"
    _check_cache(key_cache, value_cache, who)
    quantized = check_scales(key_cache, k_scale, v_scale, who)
    N, bs, Hkv, D = key_cache.shape
    for name, x in (("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape[1:]) != (Hkv, D) or x.dim() != 3:
            raise ValueError(f"{who}: {name} must be [T, {Hkv}, {D}] to fit the cache")
        if (not x.is_floating_point() if quantized else x.dtype != key_cache.dtype) or x.device != key_cache.device:
            raise TypeError(f"{who}: {name} is {x.dtype} on {x.device}, the cache {key_cache.dtype} "
                            f"on {key_cache.device}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.shape != (key.shape[0],) \
            or value.shape[0] != key.shape[0] or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{who}: slot_mapping must be an int tensor [T] with T = {key.shape[0]} for key and value")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"{who}: the caches must be contiguous (a flat [slots] view must alias them)")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if bool((slot_mapping < -1).any()) or bool((slots >= N * bs).any()):
        raise ValueError(f"{who}: a slot is outside -1..{N * bs - 1} (num_blocks * block_size)")
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"{who}: two tokens map to one slot")
    _store(key[keep], value[keep], key_cache, value_cache, slots, k_scale, v_scale)


def _store(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """The store itself, on slots already checked. A slot of -1 (a padding row of a fixed-shape decode batch,
    ``engine/input_batch.py``) writes nowhere, with no data-dependent shape: it rewrites row 0's slot with row 0's
    own K/V, a duplicate write of equal values, so the order of the writes cannot matter (row 0 is always real)."""
    N, bs, Hkv, D = key_cache.shape
    pad = slot_mapping < 0                                                       # [T]
    slots = torch.where(pad, slot_mapping[:1], slot_mapping)
    key, value = (torch.where(pad[:, None, None], x[:1], x) for x in (key, value))
    if k_scale is not None:                  # quantized blocks: each row quantized on its way in (vLLM's store)
        key = _quantize_rows(key, key_cache.dtype, k_scale, slots)
        value = _quantize_rows(value, value_cache.dtype, v_scale, slots)
        if key_cache.is_floating_point():    # fp8: torch has no index_copy_ for it; its bytes copy as uint8
            key_cache, value_cache, key, value = (x.view(torch.uint8) for x in (key_cache, value_cache, key, value))
    key_cache.view(N * bs, Hkv, D).index_copy_(0, slots, key)
    value_cache.view(N * bs, Hkv, D).index_copy_(0, slots, value)


def _quantize_rows(x, dtype, scale, slots):
    """x [T, Hkv, D] -> x quantized to ``dtype``. Per tensor, with the layer's scale; per (token, head), with each
    row's own (amax / max), written into the scale cache [num_blocks, block_size, Hkv] at the row's slot."""
    if scale.numel() == 1:
        return quant._quantize(x, dtype, scale.reshape(()))
    s = quant._token_head_scales(x, quant.max_representable(quant.kv_cache_dtype_of(dtype)))   # [T, Hkv]
    scale.view(-1, x.shape[1]).index_copy_(0, slots, s)
    return quant._quantize(x, dtype, s[..., None])


# -- attend: the teaching version (backend "loop") ---------------------------------------------------------
def paged_attention_loop(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                         tree_bits=None, k_scale=None, v_scale=None):
    """query [T, H, D] -> out [T, H, D]; one sequence at a time, gathered through its block table.
    tree_bits [T] int64 or None: the token-tree mask of each row (see the module docstring).
    k_scale, v_scale: a quantized cache's scales (one element, or [num_blocks, block_size, Hkv]), else None."""
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     "paged_attention_loop", tree_bits, k_scale, v_scale)
    T, H, D = query.shape
    N, bs, Hkv, _ = key_cache.shape
    out = torch.zeros_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, L in enumerate(lens):
        s, e = qsl[b], qsl[b + 1]
        n = e - s
        if n == 0:
            continue
        blocks = block_tables[b, :-(-L // bs)].long()                  # its physical blocks, in logical order
        k = key_cache[blocks].reshape(-1, Hkv, D)[:L].float()          # [L, Hkv, D]: positions 0..L-1
        v = value_cache[blocks].reshape(-1, Hkv, D)[:L].float()
        if k_scale is not None:              # quantized blocks, dequantized as gathered: this sequence's only
            k, v = (x * (sc if sc.numel() == 1 else sc[blocks].reshape(-1, Hkv)[:L, :, None])
                    for x, sc in ((k, k_scale), (v, v_scale)))
        k, v = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))  # [L, H, D]: head h -> kv head h // G
        scores = torch.einsum("qhd,khd->hqk", query[s:e].float(), k) * scale   # [H, n, L]
        q_pos = torch.arange(L - n, L, device=query.device)[:, None]  # its queries are the last n positions
        causal = torch.arange(L, device=query.device)[None, :] <= q_pos  # [n, L]
        if tree_bits is not None:
            # Tree attention (SpecInfer, Miao et al. 2024, §4.1): this step's n tokens are a tree's nodes, and
            # query i sees key L - n + r (node r) only if bit r of its row is set: its ancestors and itself.
            r = torch.arange(L, device=query.device) - (L - n)            # [L]: node index; < 0 in the context
            bit = (tree_bits[s:e, None] >> r.clamp(0, 63)[None, :]) & 1    # [n, L]: bit r of row i
            causal &= (r < 0)[None, :] | (bit == 1)                        # [n, L]: context, or an ancestor
        scores = scores.masked_fill(~causal, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
    return out
