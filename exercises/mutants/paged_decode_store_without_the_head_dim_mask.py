"""Mutant (exercise 9): stores all BLOCK_D lanes of the output: with a head_dim that is not a power of two,
the lanes past it land in the next row, and past the end of ``out`` for the last one."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import check_paged_inputs


@triton.jit
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
                    mask=k_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * scale                    # [BLOCK_SIZE] scores
        s = tl.where(k_valid, s, float("-inf"))

        # Every block visited has at least one valid key, so m_new is finite
        # and exp(m_i - m_new) is 0 on the first block, a rescale afterwards.
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)                                    # [BLOCK_SIZE]
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)

        v = tl.load(v_cache_ptr + phys * stride_vb + offs_n[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :] * stride_vd,
                    mask=k_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)            # [BLOCK_D]
        m_i = m_new

    out = acc / l_i
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty))          # BUG: no mask=d_valid


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention: query [B, H, D], one new token per sequence -> out [B, H, D] (query's dtype).

    key_cache, value_cache [num_blocks, block_size, Hkv, D] (block_size a power of two; strided views
    are fine); block_tables [B, max_blocks] int32/int64, padded past each sequence's blocks;
    seq_lens [B] (the new token included). Given: checks the inputs, launches your kernel.
    """
    if not isinstance(query, torch.Tensor) or not isinstance(seq_lens, torch.Tensor):
        raise TypeError("paged_decode: query and seq_lens must be torch.Tensors")
    if query.dim() != 3 or seq_lens.dim() != 1 or query.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"paged_decode: want query [B, H, D] with one row per sequence and "
                         f"seq_lens [B]; got {tuple(query.shape)} and {tuple(seq_lens.shape)}")
    B = query.shape[0]
    query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=seq_lens.device)
    check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens,
                       query_start_loc, scale, None, who="paged_decode")
    # NaN until your kernel writes it: a program that stores nothing shows up in the tests
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=query.device)
    if B == 0:
        return out
    H, D = query.shape[1:]
    _paged_decode_kernel[(B, H)](
        query, key_cache, value_cache, out, block_tables, seq_lens, float(scale),
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_tables.stride(0), D,
        QUERIES_PER_KV=H // key_cache.shape[2],
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(D),
    )
    return out

