"""Backend "cpu", the default on a CPU: the C++ operator for the short rows, SDPA for the long chunks.

The operator (``cpu_kernel.py``: vLLM's CPU attention kept small, compiled at first use) reads the blocks in
place with an online softmax, OpenMP over (sequence, KV head); this module holds its Python entry points, the
checked public ``paged_attention_cpu`` and the engine's ``attend`` and ``store``, and the split of a step
between it and "batched"'s gather and SDPA (``_cpu_attend``). Where the operator cannot be built,
``backends.get("cpu")`` hands out "batched" (said once, in a warning). A quantized cache (``kv/quant.py``: int8,
fp8 e4m3 or e5m2, scales per tensor or per (token, head)) is read with its scales, k_scale= and v_scale=, by
every path here: the operator dequantizes in its inner loop and the store quantizes (``cpu_quant.py``), and the
long rows' SDPA dequantizes what it gathers (``batched._sdpa_group``).
"""
from __future__ import annotations

import torch

from minibatch.kv.backends import cpu_kernel
from minibatch.kv.backends.batched import _sdpa_group
from minibatch.kv.backends.plan import _group
from minibatch.kv.checks import _check_attention


def paged_attention_cpu(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                        tree_bits=None, k_scale=None, v_scale=None):
    """query [T, H, D] -> out [T, H, D], the blocks read in place; the same answer as ``paged_attention_loop``.
    k_scale, v_scale: a quantized cache's scales (one element, or [num_blocks, block_size, Hkv]), else None.
    Checks its inputs (``checks.py``) and raises RuntimeError where the operator cannot be built."""
    _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     "paged_attention_cpu", tree_bits, k_scale, v_scale)
    if query.device.type != "cpu":
        raise ValueError(f"paged_attention_cpu runs on CPU tensors, got {query.device}")
    op = cpu_kernel.load()
    if op is None:
        raise RuntimeError("paged_attention_cpu: the C++ operator could not be built here (see the warning)")
    i32 = (x.to(torch.int32).contiguous() for x in (block_tables, seq_lens, query_start_loc))
    scales = [None if s is None else s.contiguous() for s in (k_scale, v_scale)]
    return op(query, key_cache.contiguous(), value_cache.contiguous(), *i32, float(scale), tree_bits, *scales)


def attend(query, key_cache, value_cache, md, scale, seq_lens=None, k_scale=None, v_scale=None):
    """The engine's path (``backends.get("cpu")``): the metadata was checked once, by ``AttentionMetadata.build``.
    ``seq_lens`` [B] int32 replaces ``md.seq_lens`` (a 0 skips a row: ``_cpu_attend`` gives long rows
    to SDPA)."""
    if query.device.type != "cpu":
        raise ValueError(f"the 'cpu' attention backend runs on CPU tensors, got {query.device}; "
                         f"on a GPU choose 'triton' or 'batched'")
    return cpu_kernel._OP(query, key_cache, value_cache, md.block_tables, md.seq_lens if seq_lens is None else seq_lens,
               md.query_start_loc, scale, md.tree_bits, k_scale, v_scale)


def store(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """The engine's store for "cpu" (vLLM's ``cpu_attn_reshape_and_cache``): key, value [T, Hkv, D] -> their slots,
    in place, slot -1 skipped; one C++ loop of row copies, quantized on the way into an int8 / fp8 cache (per
    (token, head) writing each row's scale). The slots were checked by ``AttentionMetadata.build``
    (``loop.store_kv_torch`` is the checked, public version)."""
    torch.ops.minibatch.store_kv_cpu(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


# -- cpu: the C++ operator for the short rows, SDPA for the long chunks ------------------------------------------
# Measured on the shipped target's shapes (4 heads of 64, one row against a 512-token context, one thread;
# ``python -m minibatch.bench attention --cpu`` prints the same comparison): the operator takes 0.16x of "batched"'s time for one query,
# 0.5-0.6x for 4-8 (verify chains, small trees), and 1.4x-4.5x for 16 and more, where SDPA's matrix products
# win (``cpu_kernel.py`` says why). So a row of up to LONG_QUERY queries is read in place, and a longer
# one (a prefill chunk, a big tree) goes through "batched"'s gather and SDPA, in the same step.
LONG_QUERY = 8


def _hybrid_plan(md, block_size: int, device) -> tuple:
    """Once per step: (seq_lens for the operator [B] int32, the long rows' group or None, where its valid
    outputs come from [n] and go to [n]). A long row's seq_len is 0 for the operator, which then reads no
    context for it (the padding row's case) and writes zeros that the SDPA rows overwrite."""
    if "cpu" in md.plan:
        return md.plan["cpu"]
    long_rows = [] if md.static else [b for b, n in enumerate(md.query_lens_list) if n > LONG_QUERY]
    if not long_rows:
        plan = (md.seq_lens, None, None, None)
    else:
        seq_lens = md.seq_lens.clone()
        seq_lens[long_rows] = 0
        group = _group(md, long_rows, block_size, device)
        _, q_rows, q_valid, _ = group
        src = None if q_rows is None else q_valid.reshape(-1).nonzero().squeeze(1)    # [n]: real queries only
        dst = None if q_rows is None else q_rows.reshape(-1)[src]                     # [n]: their flat rows
        plan = (seq_lens, group, src, dst)
    md.plan["cpu"] = plan
    return plan


def _cpu_attend(query, key_cache, value_cache, md, scale, k_scale=None, v_scale=None):
    T, H, D = query.shape
    seq_lens, group, src, dst = _hybrid_plan(md, key_cache.shape[1], query.device)
    if group is not None and group[1] is None:            # every row long: SDPA alone
        return _sdpa_group(query, key_cache, value_cache, group[0], None, group[3], scale,
                           k_scale, v_scale).reshape(T, H, D)
    out = attend(query, key_cache, value_cache, md, scale, seq_lens=seq_lens, k_scale=k_scale, v_scale=v_scale)
    if group is not None:
        slots, q_rows, _, mask = group
        o = _sdpa_group(query, key_cache, value_cache, slots, q_rows, mask, scale, k_scale, v_scale).reshape(-1, H, D)
        out.index_copy_(0, dst, o.index_select(0, src))
    return out
