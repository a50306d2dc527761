"""Exercise 9: a Triton kernel, paged decode attention (PagedAttention, Kwon et al., SOSP'23, Sec. 4.1;
online softmax, Milakov & Gimelshein 2018), in the style of Triton-Puzzles.

At decode every sequence brings exactly one new token. Its query attends to all
``seq_len`` keys of its sequence (its own key included: it was stored a moment
ago), so there is no causal mask, only the paging: logical block j of sequence
b (positions ``j * block_size .. (j + 1) * block_size - 1``) lives in physical
block ``block_tables[b, j]``, anywhere in the pool.

You write the kernel; the launcher ``paged_decode`` below is given. One program
per (sequence, query head), a grid of (B, H). A program:

    1. finds its sequence ``seq = tl.program_id(0)``, its query head ``head = tl.program_id(1)``,
       and the KV head it reads: GQA, ``kv_head = head // QUERIES_PER_KV`` (consecutive query heads
       share one KV head);
    2. loads its query vector q [BLOCK_D] (in float32);
    3. walks the sequence's logical blocks, one whole cache block per iteration: looks up the physical
       block in the block table, loads that block's keys and values, computes the scores
       (K . q) * scale, and folds them into an *online softmax* (a running maximum, a running
       denominator and a running numerator, rescaled whenever the maximum grows: Milakov &
       Gimelshein 2018, Sec. 3; the update rules are in ``exercises/hints/ex9.md``);
    4. stores out = acc / l at out[seq, head].

The traps the tests set:
  * only the last block of a sequence can be part-full. Its rows at positions >= seq_len are not
    the sequence's: they hold another sequence's data, or NaN in the tests. Never load them (a
    load mask with ``other=0.0``), and give their scores -inf (``tl.where``), because
    0 * NaN = NaN: a NaN value weighted by p = 0 still poisons the sum.
  * head_dim need not be a power of two (BLOCK_D is the next one): mask the lanes d >= head_dim.
  * the value cache has strides of its own (it need not be laid out like the key cache), and so has
    ``out`` (the query may be a strided view): never borrow one tensor's strides for another. Writes
    outside ``out`` are caught: the tests guard the memory around it.
  * scores far below 0 (every one of them) must still give a proper softmax; q . k in float16 overflows
    (65504): compute in float32. Caches can pass 2**31 elements: block offsets in int64.

Triton in ten lines (https://triton-lang.org, "triton.language"):
  * ``tl.arange(0, N)`` (N a power of two, a constexpr) is a vector of offsets; ``ptr + offsets``
    a vector of addresses; ``ptr + rows[:, None] * stride_r + cols[None, :] * stride_c`` a 2-D tile.
  * ``tl.load(ptrs, mask=m, other=0.0)`` reads where m is true, ``tl.store(ptrs, x, mask=m)`` writes.
  * ``tl.sum(x, axis)``, ``tl.max(x, axis)``, ``tl.exp``, ``tl.maximum``, ``tl.where(c, a, b)``,
    ``x.to(tl.float32)``, ``tl.cdiv(a, b)``; ``tl.full((), value, tl.float32)`` is a scalar,
    ``tl.zeros([N], tl.float32)`` a vector. Scalars loaded from memory: ``tl.load(ptr + i)``.
  * a loop ``for j in range(0, n):`` with n loaded from memory is fine.
  * use int64 for block ids before multiplying by a stride: ``phys.to(tl.int64)``.
  * debugging: without a GPU the tests run your kernel in Triton's interpreter (TRITON_INTERPRET=1,
    set by tests/conftest.py), where ``print(x)`` inside the kernel works; ``tl.device_print("x", x)``
    works everywhere.

``kernels/README.md`` explains the kernels (the conventions, the paging, the online softmax). A student release
holds every attention kernel back: ``kernels/paged_decode.py``'s, and the general and flash-decode ones too, whose
launchers there run your kernel instead (the engine's "triton" backend then decodes, and prefills one query row at
a time, on yours).

Run the tests:  MINIBATCH_STUDENT=paged_decode python -m pytest tests/exercises -m ex9
"""
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
    stride_kb, stride_ks, stride_kh, stride_kd,   # key_cache   [num_blocks, block_size, Hkv, D]
    stride_vb, stride_vs, stride_vh, stride_vd,   # value_cache [num_blocks, block_size, Hkv, D]
    stride_bt,                                    # block_tables row stride
    head_dim,                                     # D (BLOCK_D >= D is a power of two)
    QUERIES_PER_KV: tl.constexpr,                 # G = H // Hkv
    BLOCK_SIZE: tl.constexpr,                     # the cache block size: one block per iteration
    BLOCK_D: tl.constexpr,                        # head_dim rounded up to a power of two
    # A quantized cache (fp8, int8; kernels/kv_quant.py): not part of this exercise, whose tests pass KV_FORMAT = 0
    # and read none of these; kernels/paged_decode.py shows what a kernel does with them.
    k_scale_ptr, v_scale_ptr,
    stride_sb, stride_ss, stride_sh,
    KV_FORMAT: tl.constexpr = 0,
):
    """out[seq, head] = softmax(scale * K q) V over the seq_len keys of sequence ``seq``, read through its block table.

    Delete the static_assert when you start. The step-by-step version is in ``exercises/hints/ex9.md``.
    """
    tl.static_assert(False, "Exercise 9: write _paged_decode_kernel (exercises/ex9_paged_decode_kernel.py)")


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
        k_scale_ptr=seq_lens, v_scale_ptr=seq_lens, stride_sb=0, stride_ss=0, stride_sh=0,   # not quantized
    )
    return out
