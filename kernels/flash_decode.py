"""Paged attention for pure-decode steps: full tiles and a context split over programs (flash-decoding).

At decode each sequence brings one query token. ``paged_attention.py`` serves it with one program per
(sequence, KV head) whose tile rows are (token, query head of the group) pairs, padded to 16 rows for
``tl.dot``. For the shipped target (4 heads, 4 KV heads, head_dim 64: G = 1 query head per KV head)
that tile uses 1 row of 16 (6 %), and a batch of one launches 4 programs on a GPU of 108-132 SMs.
This kernel fixes both, and was chosen by counting, as no GPU was at hand to time it:

- **Full tiles.** The rows are only the G query heads of one KV head (padded to a power of two, not
  to 16), and the scores are a multiply and a row sum on CUDA cores, not a ``tl.dot``: with G = 1
  every lane of the [G, BLOCK_N, D] product is real work. Each K/V tile is still read once per group.
- **Split context** (flash-decoding; Dao, Haziza, Massa & Sizov 2023). Programs are (sequence, KV head,
  split); split s reads keys ``s * keys_per_split ..`` and writes its unnormalised partial
  (m, l, acc), and ``_combine_kernel`` merges the splits exactly as the online softmax merges tiles
  (Milakov & Gimelshein 2018). The split count comes from shapes only (batch, KV heads, block-table
  width; never a length read back from the GPU), so the launch takes no host sync and, with a
  fixed-width table, has one shape per batch size (CUDA-graph friendly):
  ``splits = min(ceil(128 / (B * Hkv)), ceil(max_ctx / 64))``.
  For the target at its 512-token context (BLOCK_N = 32): B = 1 launches 4 x 8 = 32 programs (was 4), B = 16
  launches 64 x 2 = 128 (was 64); B >= 32 is one split and one launch, the same work as before.
  Bytes moved: K/V are read once either way (a fp16 512-token context: 4 heads x 512 x 64 x 2 x
  2 B = 512 KiB); the partials add B x H x splits x (D + 2) x 4 B = 8.4 KiB at B = 1 (1.6 %).
- **What the compiler reports** (``tests/test_kernel_compile.py`` compiles every launch for sm_80 and
  sm_90 and reads registers with ``cuobjdump -res-usage``). fp16, G = 1, D = 64, sm_90, 4 warps:
  BLOCK_N = 64 keys per iteration takes 254 registers a thread (2 programs per SM fit), 32 takes 144
  (3 per SM, 8 KiB of K/V loaded per iteration), 16 takes 89 (5 per SM, 4 KiB); none spills, and
  shared memory is 512 B (the cross-warp sums; the general kernel stages 7 KiB for its ``tl.dot``).
  At B = 1-16 there are about one program per SM, so bytes in flight per program count most; at
  large B, programs per SM do. ``PRODUCT_LANES`` = 2048 (BLOCK_N = 32 for the target) sits between.
  (Those figures are without alignment hints; at the engine's real launches, 16-byte-aligned, the test
  reports 62-96 registers for every flash_decode specialisation, 4 KiB of shared memory at most.)

The triton backend (``minibatch/kv/backends/triton.py``) dispatches a step here when every sequence has
exactly one new token and there is no tree; the rest (prefill, chunks, verify, trees) goes to
``paged_attention``. Per-step values (the block-table width, the keys per split, the split count)
are ``do_not_specialize``: a wider table is a new value, not a new compile.

Shapes: query [B, H, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D];
block_tables [B, max_blocks]; seq_lens [B] (the new token included); out [B, H, D].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant

from kernels.paged_decode import check_decode_inputs

TARGET_PROGRAMS = 128     # about one wave of programs on an A100 (108 SMs) or H100 (132 SMs)
MIN_SPLIT_KEYS = 64       # fewer keys per split and the partials cost more than they save
PRODUCT_LANES = 2048      # [BLOCK_G, BLOCK_N, BLOCK_D] fp32 lanes: 16 per thread at 4 warps (see the docstring)


@triton.jit(do_not_specialize=["stride_bt", "keys_per_split"])
def _flash_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr,                    # [B, H, splits, BLOCK_D], [B, H, splits, 2] fp32 (if SPLIT)
    block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr,                     # a quantized cache's scales (read only if KV_FORMAT)
    scale,
    stride_qb, stride_qh, stride_qd,              # query [B, H, D]
    stride_ob, stride_oh, stride_od,              # out   [B, H, D]
    stride_kb, stride_ks, stride_kh, stride_kd,   # key_cache
    stride_vb, stride_vs, stride_vh, stride_vd,   # value_cache
    stride_sb, stride_ss, stride_sh,              # scales [blocks, block_size, Hkv]; 0, 0, 0 per tensor
    stride_bt,                                    # block_tables row stride: the table's width, per step
    block_size, head_dim,
    keys_per_split,                               # a multiple of BLOCK_N
    QUERIES_PER_KV: tl.constexpr,   # G
    BLOCK_G: tl.constexpr,          # G rounded up to a power of two
    BLOCK_N: tl.constexpr,          # keys per iteration
    BLOCK_D: tl.constexpr,          # head_dim rounded up to a power of two
    SPLIT: tl.constexpr,            # write partials for _combine_kernel (else the output itself)
    KV_FORMAT: tl.constexpr = 0,    # a quantized cache (kernels/kv_quant.py): 0 = none, 1 e4m3, 2 e5m2, 3 int8
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)     # a split past the sequence's end reads nothing

    g = tl.arange(0, BLOCK_G)
    head = kv_head * QUERIES_PER_KV + g                   # the group's query heads, one per row
    g_valid = g < QUERIES_PER_KV
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)   # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        k_pos = start_n + offs_n
        k_valid = k_pos < end
        phys = tl.load(block_tables_ptr + seq * stride_bt + k_pos // block_size,
                       mask=k_valid, other=0).to(tl.int64)                              # [BLOCK_N]
        in_block = k_pos % block_size
        kv_mask = k_valid[:, None] & d_valid[None, :]       # the tail of the last block is not ours (NaN)
        k = tl.load(k_cache_ptr + phys[:, None] * stride_kb + in_block[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if KV_FORMAT != 0:                                  # codes -> floats in registers (kv_quant.py)
            k = kv_quant.codes_to_float(k, KV_FORMAT)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2) * scale             # [BLOCK_G, BLOCK_N]
        if KV_FORMAT != 0:                                  # each key's scale on its score column
            s = s * kv_quant.load_scales(k_scale_ptr, phys, in_block, kv_head, stride_sb, stride_ss, stride_sh,
                                         k_valid)[None, :]
        s = tl.where(k_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))               # finite: every iteration has a valid key
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + phys[:, None] * stride_vb + in_block[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if KV_FORMAT != 0:                                  # each value's scale on its probability column
            v = kv_quant.codes_to_float(v, KV_FORMAT)
            p = p * kv_quant.load_scales(v_scale_ptr, phys, in_block, kv_head, stride_sb, stride_ss, stride_sh,
                                         k_valid)[None, :]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)   # [BLOCK_G, BLOCK_D]
        m_i = m_new

    if SPLIT:
        # Partial of (seq, head, split): unnormalised acc and its (m, l); an empty split is (-inf, 0, 0).
        row = (seq * tl.num_programs(1) * QUERIES_PER_KV + head) * num_splits + split     # [BLOCK_G]
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_valid[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_valid)
    else:
        out = acc / l_i[:, None]                            # l > 0: the split holds the whole context
        tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=g_valid[:, None] & d_valid[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    num_splits, head_dim,
    BLOCK_D: tl.constexpr,
):
    """out[seq, head] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M the running max (one program each)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    base = (seq * tl.num_programs(1) + head) * num_splits
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        m_s = tl.load(part_ml_ptr + (base + s) * 2)
        l_s = tl.load(part_ml_ptr + (base + s) * 2 + 1)
        acc_s = tl.load(part_acc_ptr + (base + s) * BLOCK_D + offs_d)
        m_new = tl.maximum(m_i, m_s)                        # split 0 is never empty, so M is finite at the end
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m_i - m_safe)
        b = tl.exp(m_s - m_safe)
        l_i = l_i * a + l_s * b
        acc = acc * a + acc_s * b
        m_i = m_new
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             (acc / l_i).to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def plan(batch: int, num_kv_heads: int, max_ctx: int, block_n: int) -> tuple[int, int]:
    """(splits, keys_per_split) from shapes alone: enough programs for about one wave, at least
    MIN_SPLIT_KEYS keys each; keys_per_split a multiple of block_n."""
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, max(1, batch * num_kv_heads)),
                        triton.cdiv(max_ctx, MIN_SPLIT_KEYS)))
    keys = triton.cdiv(triton.cdiv(max_ctx, splits), block_n) * block_n
    return triton.cdiv(max_ctx, keys), keys


def _launch_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, out, k_scale=None, v_scale=None):
    """Launch on already-checked inputs, one query row per sequence (the engine's triton backend calls this)."""
    B, H, D = query.shape
    block_size, Hkv = key_cache.shape[1], key_cache.shape[2]
    G = H // Hkv
    block_g, block_d = triton.next_power_of_2(G), triton.next_power_of_2(D)
    block_n = max(8, min(64, PRODUCT_LANES // (block_g * block_d)))
    splits, keys = plan(B, Hkv, block_tables.shape[1] * block_size, block_n)
    if splits > 1:
        part_acc = torch.empty((B, H, splits, block_d), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((B, H, splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out                          # pointers never written when SPLIT is False
    ks, vs, *scale_strides = kv_quant.scale_args(k_scale, v_scale, seq_lens)
    _flash_decode_kernel[(B, Hkv, splits)](
        query, kv_quant.storage_view(key_cache), kv_quant.storage_view(value_cache), out, part_acc, part_ml,
        block_tables, seq_lens, ks, vs, float(scale),
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), *scale_strides,
        block_tables.stride(0), block_size, D, keys,
        QUERIES_PER_KV=G, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=splits > 1,
        KV_FORMAT=kv_quant.kv_format(key_cache),
    )
    if splits > 1:
        _combine_kernel[(B, H)](part_acc, part_ml, out, *out.stride(), splits, D, BLOCK_D=block_d)
    return out


def flash_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                 k_scale: torch.Tensor = None, v_scale: torch.Tensor = None) -> torch.Tensor:
    """Decode attention, query [B, H, D] -> out [B, H, D]: ``paged_decode``'s contract, split over the context."""
    check_decode_inputs(query, key_cache, value_cache, block_tables, seq_lens, scale, "flash_decode",
                        k_scale, v_scale)
    B = query.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if B == 0:
        return out
    return _launch_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, out, k_scale, v_scale)
