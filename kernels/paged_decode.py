"""Paged attention, decode only: the simplest paged kernel, to read first.

At decode every sequence brings exactly one new token, whose query attends to
*all* ``seq_len`` keys of its sequence (its own key was stored a moment ago by
``store_kv``), so there is no causal mask inside the context at all. What is
left is the one new idea of PagedAttention (Kwon et al. 2023, section 4.1):
the keys are not contiguous. Logical block j of sequence b (positions
``j*block_size .. (j+1)*block_size - 1``) lives in physical block
``block_tables[b, j]``, anywhere in the pool.

So: one program per (sequence, query head). It walks the sequence's logical
blocks in order, one whole cache block per iteration, looks up the physical
block, loads its ``[block_size, D]`` keys and values, and folds them into an
online softmax (running max m, running sum l, unnormalised output acc; Milakov
& Gimelshein 2018). No tl.dot: with one query row, a multiply and a row sum is
the dot product, and there is no minimum tile size to pad to.

``paged_attention.py`` generalises this to many query tokens per sequence
(prefill, chunked prefill, speculative verify), a causal mask with a context
offset, and one K/V load shared by a whole group of GQA heads.

Shapes: query [B, H, D] (row b is sequence b's new token);
key_cache, value_cache [num_blocks, block_size, Hkv, D];
block_tables [B, max_blocks]; seq_lens [B] (the new token included).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant

from kernels.paged_attention import check_paged_inputs


@triton.jit(do_not_specialize=["stride_bt"])      # the table's width changes from step to step: no recompile
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr,
    scale,
    stride_qb, stride_qh, stride_qd,              # query [B, H, D]
    stride_ob, stride_oh, stride_od,              # out   [B, H, D]
    stride_kb, stride_ks, stride_kh, stride_kd,   # key_cache
    stride_vb, stride_vs, stride_vh, stride_vd,   # value_cache
    stride_bt,                                    # block_tables row stride
    head_dim,
    QUERIES_PER_KV: tl.constexpr,   # G = H // Hkv
    BLOCK_SIZE: tl.constexpr,       # the cache block size: one block per iteration
    BLOCK_D: tl.constexpr,          # head_dim rounded up to a power of two
    # A quantized cache (kernels/kv_quant.py), last so that exercise 9's kernel reads as before (its tests pass 0):
    k_scale_ptr, v_scale_ptr,                     # the scales (read only if KV_FORMAT)
    stride_sb, stride_ss, stride_sh,              # scales [blocks, block_size, Hkv]; 0, 0, 0 per tensor
    KV_FORMAT: tl.constexpr = 0,    # 0 = the query's dtype, 1 e4m3, 2 e5m2, 3 int8 (fp8 as uint8 bits)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV     # GQA: G query heads read one KV head
    seq_len = tl.load(seq_lens_ptr + seq)

    # The one query vector of this (sequence, head), in float32.
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim          # mask the lanes past a non power-of-two D
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + offs_d * stride_qd,
                mask=d_valid, other=0.0).to(tl.float32)          # [BLOCK_D]

    # Online softmax state: scalars m, l and a [D] accumulator.
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)

    offs_n = tl.arange(0, BLOCK_SIZE)    # the rows of one cache block
    num_logical = tl.cdiv(seq_len, BLOCK_SIZE)
    for j in range(0, num_logical):
        # The paging step: logical block j -> physical block. Only entries
        # j < cdiv(seq_len, block_size) are read; the padding after them never.
        phys = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs_n
        # Only the last block can be partly filled; its tail rows are not the
        # sequence's (stale, or NaN in the tests) and must not be loaded.
        k_valid = k_pos < seq_len

        k = tl.load(k_cache_ptr + phys * stride_kb + offs_n[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :] * stride_kd,
                    mask=k_valid[:, None] & d_valid[None, :], other=0.0)
        if KV_FORMAT != 0:               # codes: floats in registers, each key's scale on its score
            k = kv_quant.codes_to_float(k, KV_FORMAT)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1) * scale     # [BLOCK_SIZE] scores
        if KV_FORMAT != 0:
            s = s * kv_quant.load_scales(k_scale_ptr, phys, offs_n, kv_head, stride_sb, stride_ss, stride_sh,
                                         k_valid)
        s = tl.where(k_valid, s, float("-inf"))

        # Every block visited has at least one valid key, so m_new is finite
        # and exp(m_i - m_new) is 0 on the first block, a rescale afterwards.
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)                                    # [BLOCK_SIZE]
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)

        v = tl.load(v_cache_ptr + phys * stride_vb + offs_n[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=k_valid[:, None] & d_valid[None, :], other=0.0)
        if KV_FORMAT != 0:               # each value's scale on its probability: (p * s_v) . v_code
            v = kv_quant.codes_to_float(v, KV_FORMAT)
            p = p * kv_quant.load_scales(v_scale_ptr, phys, offs_n, kv_head, stride_sb, stride_ss, stride_sh,
                                         k_valid)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)   # [BLOCK_D]
        m_i = m_new

    out = acc / l_i
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_valid)


def check_decode_inputs(query, key_cache, value_cache, block_tables, seq_lens, scale, who: str,
                        k_scale=None, v_scale=None) -> None:
    """One clear TypeError/ValueError for bad decode input (``check_paged_inputs`` with one query per sequence)."""
    if not isinstance(query, torch.Tensor) or not isinstance(seq_lens, torch.Tensor):
        raise TypeError(f"{who}: query and seq_lens must be torch.Tensors")
    if query.dim() != 3 or seq_lens.dim() != 1 or query.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"{who}: want query [B, H, D] with one row per sequence and "
                         f"seq_lens [B]; got {tuple(query.shape)} and {tuple(seq_lens.shape)}")
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens,
                       query_start_loc, scale, None, who=who, k_scale=k_scale, v_scale=v_scale)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                 k_scale: torch.Tensor = None, v_scale: torch.Tensor = None) -> torch.Tensor:
    """Decode attention: query [B, H, D], one new token per sequence -> out [B, H, D].

    Same as ``paged_attention`` with ``query_start_loc = arange(B + 1)``. k_scale, v_scale: a quantized cache's
    scales (``kv_quant.py``): each key's scale multiplies its score, each value's its probability.
    """
    check_decode_inputs(query, key_cache, value_cache, block_tables, seq_lens, scale, "paged_decode",
                        k_scale, v_scale)
    B = query.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if B == 0:
        return out
    H, D = query.shape[1:]
    grid = (B, H)
    _paged_decode_kernel[grid](
        query, kv_quant.storage_view(key_cache), kv_quant.storage_view(value_cache), out, block_tables, seq_lens,
        float(scale),
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_tables.stride(0), D,
        QUERIES_PER_KV=H // key_cache.shape[2],
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(D),
        **kv_quant.launch_args(key_cache, k_scale, v_scale, seq_lens),
    )
    return out
