"""Backend "triton": ``kernels/``'s Triton kernels, reading the blocks in place with an online softmax.

The store is ``kernels.store_kv``; attention is ``kernels.paged_attention`` (any query length per sequence,
GQA, token trees), and a pure-decode step (one query per sequence, no tree) goes to ``kernels.flash_decode``
(full tiles, the context split over programs). ``kernels`` is imported at the call, so the other backends
need no Triton. ``kernels/README.md`` explains each kernel. A quantized cache's scales (``kv/quant.py``) go to
the store and to attention as k_scale=, v_scale= (the kernels dequantize in registers, ``kernels/kv_quant.py``).
"""
from __future__ import annotations

import torch


def _triton_store(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    from kernels.store_kv import launch_store_kv
    launch_store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def _pure_decode(query, md) -> bool:
    """Every sequence brings exactly one token and there is no tree: the decode-only kernel's case."""
    return md.tree_bits is None and md.max_query_len == 1 and query.shape[0] == md.seq_lens.shape[0]


def _triton_attend(query, key_cache, value_cache, md, scale, k_scale=None, v_scale=None):
    from kernels.flash_decode import _launch_decode
    from kernels.paged_attention import _launch
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    if _pure_decode(query, md):                   # full tiles, the context split over programs
        return _launch_decode(query, key_cache, value_cache, md.block_tables, md.seq_lens, scale, out,
                              k_scale=k_scale, v_scale=v_scale)
    return _launch(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                   scale, md.max_query_len, out, tree_bits=md.tree_bits, k_scale=k_scale, v_scale=v_scale)
