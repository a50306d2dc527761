"""Paged attention for any mix of query lengths, in one Triton kernel.

The flat batch of one engine iteration holds, side by side, sequences in very
different states: a **decode** (1 new token, long context), a **prefill**
(q_len = seq_len), a **chunked prefill** (a later chunk of a long prompt, the
earlier chunks already in the cache) and a **speculative verify** (q_len =
k + 1). All of them are the same computation: new query token i of sequence b
sits at position ``p = seq_len - q_len + i`` and attends causally to the keys at
positions ``0..p``, which live in the paged KV cache, scattered over physical
blocks that the sequence's **block table** names (vLLM paper, Kwon et al. 2023,
section 4.1). This step's own keys are already in the cache (``store_kv`` ran
first), so "causal with a context offset" is the only mask needed.

Token trees (tree speculative decoding; SpecInfer, Miao et al. 2024, §4.1 "tree
attention"). A sequence's new tokens may be the nodes of a tree of drafts: node
i is cached at ``context_len + i`` but sees only the context, its ancestors and
itself. ``tree_bits[t]`` (int64, one per query row) holds that row's mask over
this step's tokens: key ``context_len + r`` is visible iff bit r is set (and it
is causal), -1 = every bit = plain causal. A tree has at most 64 nodes; the shift
is clamped to 0..63 because other rows (a long prefill beside a tree, -1) and key
tiles past seq_len reach further, and a shift of 64 or more is undefined. Without trees the launch passes ``HAS_TREE=False`` and the kernel
compiles exactly as before: no load, no bit test.

Parallelisation. One program per (sequence, tile of query tokens, KV head).
Under grouped-query attention (GQA, Ainslie et al. 2023) the G = H / Hkv query
heads of a group read the same K/V, so a program takes all of them at once:
its BLOCK_M rows are (query token, head of the group) pairs, and every K/V tile
is loaded once for G heads. Each program walks the sequence's keys BLOCK_N at a
time, looking each key's physical block up in the block table, and keeps a
FlashAttention online softmax (Dao et al. 2022, section 3.1; Milakov &
Gimelshein 2018): a running max m, running sum l and unnormalised output acc,
all float32, rescaled whenever the max grows. Nothing of size seq_len is ever
materialised. Pure-decode steps go to ``flash_decode.py`` instead: full tiles
and the keys split over several programs ("flash-decoding").

Quantized blocks (fp8 e4m3 / e5m2, int8; ``kv_quant.py``). With ``KV_FORMAT`` != 0 the caches hold codes
(fp8 as uint8 bits) and k_scale / v_scale their scales (per tensor, or per token and head). K and V tiles
are loaded as codes and turned into floats in registers; a key's scale multiplies its score column
(``q . k_code * s_k``) and a value's scale its probability column (``(p * s_v) @ v_code``), so no
dequantized context exists anywhere. ``KV_FORMAT=0`` compiles the kernel exactly as before.

Shapes: T new tokens in the flat batch, B sequences, H query heads, Hkv KV
heads, D head dim.
    query [T, H, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D]
    block_tables [B, max_blocks] int32/int64; seq_lens [B]; query_start_loc [B+1]
    tree_bits [T] int64 or None; k_scale, v_scale None, one float32 each, or [num_blocks, block_size, Hkv]
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import kv_quant

BLOCK_N = 32          # keys per inner-loop iteration (any cache block size works)
PREFILL_ROWS = 64     # target rows (token, head) per program when q_len > 1
MIN_DOT = 16          # every tl.dot dimension >= 16 keeps all Triton versions / GPUs happy


@triton.jit(do_not_specialize=["stride_bt"])      # the table's width changes from step to step: no recompile
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    tree_bits_ptr,                                # [T] int64 tree mask rows (read only if HAS_TREE)
    k_scale_ptr, v_scale_ptr,                     # a quantized cache's scales (read only if KV_FORMAT)
    scale,
    stride_qt, stride_qh, stride_qd,              # query [T, H, D]
    stride_ot, stride_oh, stride_od,              # out   [T, H, D]
    stride_kb, stride_ks, stride_kh, stride_kd,   # key_cache   [blocks, block_size, Hkv, D]
    stride_vb, stride_vs, stride_vh, stride_vd,   # value_cache [blocks, block_size, Hkv, D]
    stride_bt,                                    # block_tables row stride
    stride_sb, stride_ss, stride_sh,              # scales [blocks, block_size, Hkv]; 0, 0, 0 per tensor
    block_size, head_dim,
    QUERIES_PER_KV: tl.constexpr,   # G = H // Hkv query heads share one KV head
    BLOCK_Q: tl.constexpr,          # query tokens per program
    BLOCK_M: tl.constexpr,          # rows per program: BLOCK_Q * G rounded up to 2^k, >= 16
    BLOCK_N: tl.constexpr,          # keys per iteration
    BLOCK_D: tl.constexpr,          # head_dim rounded up to 2^k, >= 16
    DOT_PRECISION: tl.constexpr,    # "ieee" for float32 (no TF32 rounding), else "tf32"
    HAS_TREE: tl.constexpr,         # some row has a token-tree mask (tree_bits_ptr is real)
    KV_FORMAT: tl.constexpr = 0,    # kv_quant's: 0 = the caches are in the query's dtype, 1 e4m3, 2 e5m2, 3 int8
):
    seq = tl.program_id(0)          # which sequence of the batch
    q_tile = tl.program_id(1)       # which tile of its new tokens
    kv_head = tl.program_id(2)      # which KV head (and so which group of query heads)

    # --- Where this sequence's queries are, and where they sit in it. ---------
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    tile_start = q_tile * BLOCK_Q
    # The grid is sized for the longest query; shorter ones (a decode next to
    # a prefill, or q_len = 0) have nothing to do in the later tiles.
    if tile_start >= q_len:
        return
    context_len = seq_len - q_len   # tokens cached before this step's tokens

    # --- Rows: (query token, head of the group) pairs. -------------------------
    # Row r is token tile_start + r // G of the sequence, head kv_head*G + r % G.
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    # Rows past BLOCK_Q*G are padding (BLOCK_M is a power of two), rows past
    # q_len belong to the next sequence: neither is loaded nor stored.
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (tok < q_len)
    q_pos = context_len + tok       # absolute position: the causal limit of the row

    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim     # lanes past head_dim (non power-of-two D) are masked
    q_ptrs = (q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)                 # [BLOCK_M, BLOCK_D]
    if HAS_TREE:
        # Row r's tree mask over this step's tokens (bit i: sees token i); padding rows see all (-1).
        bits = tl.load(tree_bits_ptr + q_start + tok, mask=row_valid, other=-1)   # [BLOCK_M] int64

    # --- Online softmax state, float32 whatever the input dtype. --------------
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)          # running max of scores
    l_i = tl.zeros([BLOCK_M], tl.float32)                        # running sum of exp
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)               # running sum of exp * v

    # The tile's last token decides how far into the context we must read;
    # keys beyond it are in no row's causal window, so they are never loaded.
    last_tok = tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_tok + 1                          # <= seq_len

    for start_n in range(0, kv_end, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)                  # [BLOCK_N] key positions
        k_valid = k_pos < kv_end
        # Paging: logical block k_pos // block_size -> physical block, via the
        # block table. Masked, so padding entries past the last block are
        # never read (they may hold -1 or garbage).
        phys = tl.load(block_tables_ptr + seq * stride_bt + k_pos // block_size,
                       mask=k_valid, other=0).to(tl.int64)
        in_block = k_pos % block_size                            # row inside that block

        # K^T tile [BLOCK_D, BLOCK_N], loaded transposed so the dot needs no
        # tl.trans. The k_valid mask skips slots past the context (the tail of
        # the last block: stale data, NaN in the tests); their scores are
        # replaced by -inf below anyway, so here the mask only saves traffic.
        kT_ptrs = (k_cache_ptr + phys[None, :] * stride_kb + in_block[None, :] * stride_ks
                   + kv_head * stride_kh + offs_d[:, None] * stride_kd)
        kT = tl.load(kT_ptrs, mask=d_valid[:, None] & k_valid[None, :], other=0.0)
        if KV_FORMAT != 0:
            # Codes -> floats in registers, exact in the query's dtype (kv_quant.py); the scale comes after the dot
            kT = kv_quant.codes_to_float(kT, KV_FORMAT).to(q.dtype)

        # Scores for every (row, key) pair, float32 accumulation.
        s = tl.dot(q, kT, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        if KV_FORMAT != 0:                                       # q . (k_code * s_k) = s_k * (q . k_code)
            s = s * kv_quant.load_scales(k_scale_ptr, phys, in_block, kv_head, stride_sb, stride_ss, stride_sh,
                                         k_valid)[None, :]
        # Causal with the context offset: row at position p sees keys 0..p.
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if HAS_TREE:
            # Tree: key context_len + i (node i) only if bit i of the row is set; the context always.
            node = k_pos - context_len                                 # [BLOCK_N], < 0 in the context
            shift = tl.minimum(tl.maximum(node, 0), 63)                # a shift of 64+ is undefined (LLVM)
            bit = (bits[:, None] >> shift[None, :]) & 1                   # [BLOCK_M, BLOCK_N]
            visible = visible & ((bit != 0) | (node < 0)[None, :])
        s = tl.where(visible, s, float("-inf"))

        # Online softmax update. m_safe avoids (-inf) - (-inf) = NaN in a row
        # that has seen no visible key yet (only padding rows can).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])                          # [BLOCK_M, BLOCK_N]
        alpha = tl.exp(m_i - m_safe)                             # rescales the old state
        l_i = l_i * alpha + tl.sum(p, 1)

        v_ptrs = (v_cache_ptr + phys[:, None] * stride_vb + in_block[:, None] * stride_vs
                  + kv_head * stride_vh + offs_d[None, :] * stride_vd)
        # Here the mask is essential: p = 0 for a hidden key, but 0 * NaN = NaN.
        v = tl.load(v_ptrs, mask=k_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if KV_FORMAT != 0:                                       # (p * s_v) @ v_code = p @ (v_code * s_v)
            v = kv_quant.codes_to_float(v, KV_FORMAT).to(q.dtype)
            pv = p * kv_quant.load_scales(v_scale_ptr, phys, in_block, kv_head, stride_sb, stride_ss, stride_sh,
                                          k_valid)[None, :]
        else:
            pv = p
        # p goes to the value dtype for the tensor-core dot (as FlashAttention does).
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Normalise; l_i > 0 for every valid row (key 0 is always visible).
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = (out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


def check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens,
                       query_start_loc, scale, max_query_len, who="paged_attention",
                       tree_bits=None, k_scale=None, v_scale=None) -> int:
    """Raise one clear TypeError/ValueError for bad input; return the max q_len.

    Shape and dtype checks cost nothing; the value checks (offsets, lengths,
    block-table entries in range) need one host sync, taken once for all.
    """
    named = dict(query=query, key_cache=key_cache, value_cache=value_cache,
                 block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if query.dim() != 3:
        raise ValueError(f"{who}: query must be [T, num_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"{who}: key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    T, H, D = query.shape
    num_blocks, block_size, Hkv, Dc = key_cache.shape
    if D != Dc:
        raise ValueError(f"{who}: query head_dim {D} != cache head_dim {Dc}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{who}: num_heads {H} is not a multiple of num_kv_heads {Hkv}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"{who}: block_size {block_size} is not a power of two")
    if query.dtype not in _FLOATS:
        raise TypeError(f"{who}: query dtype {query.dtype} unsupported; use one of {_FLOATS}")
    kv_quant.check_scales(key_cache, value_cache, k_scale, v_scale, who)
    if kv_quant.kv_format(key_cache) == kv_quant.NONE and (key_cache.dtype != query.dtype
                                                          or value_cache.dtype != query.dtype):
        raise TypeError(f"{who}: query is {query.dtype} but the caches are "
                        f"{key_cache.dtype} / {value_cache.dtype}; they must match")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        if named[name].dtype not in _INTS:
            raise TypeError(f"{who}: {name} must be int32 or int64, got {named[name].dtype}")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise ValueError(f"{who}: want block_tables [B, max_blocks], seq_lens [B], query_start_loc "
                         f"[B+1]; got {tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, "
                         f"{tuple(query_start_loc.shape)}")
    B = seq_lens.shape[0]
    if block_tables.shape[0] != B or query_start_loc.shape[0] != B + 1:
        raise ValueError(f"{who}: {B} seq_lens, but block_tables has {block_tables.shape[0]} rows "
                         f"and query_start_loc {query_start_loc.shape[0]} entries (want B+1)")
    devices = {x.device for x in named.values()}
    if len(devices) != 1:
        raise ValueError(f"{who}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{who}: scale must be a finite real number, got {scale!r}")
    if tree_bits is not None and (not isinstance(tree_bits, torch.Tensor) or tree_bits.dtype != torch.int64
                                  or tree_bits.shape != (T,) or tree_bits.device != query.device):
        raise TypeError(f"{who}: tree_bits must be None or an int64 tensor [T = {T}] on {query.device}, got "
                        f"{getattr(tree_bits, 'dtype', type(tree_bits).__name__)} "
                        f"{tuple(getattr(tree_bits, 'shape', ()))} on {getattr(tree_bits, 'device', '-')}")
    if max_query_len is not None and (isinstance(max_query_len, bool)
                                      or not isinstance(max_query_len, int) or max_query_len < 0):
        raise TypeError(f"{who}: max_query_len must be None or an int >= 0, got {max_query_len!r}")
    if B == 0:
        if T != 0 or query_start_loc[0].item() != 0:
            raise ValueError(f"{who}: no sequences but {T} query tokens")
        return 0

    # --- Value checks, one sync for all of them. ------------------------------
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    sl = seq_lens.long()
    max_blocks = block_tables.shape[1]
    n_used = (sl.clamp(min=0) + block_size - 1) // block_size          # blocks each sequence reads
    used = torch.arange(max_blocks, device=sl.device)[None, :] < n_used[:, None]
    bt = block_tables.long()
    bad_entry = used & ((bt < 0) | (bt >= num_blocks))
    bad_tree = torch.zeros((), dtype=torch.bool, device=qsl.device)
    if tree_bits is not None and T:
        # a tree row (not -1) is one of its sequence's first 64 tokens and sees itself (bit i of row i)
        t = torch.arange(T, device=qsl.device)
        i = t - qsl[torch.searchsorted(qsl[1:], t, right=True).clamp(max=B - 1)]   # [T] index in its sequence
        bad_tree = ((tree_bits != -1) & ((i >= 64) | ((tree_bits >> i.clamp(0, 63)) & 1 == 0))).any()
    facts = torch.stack([
        qsl[0] != 0, qsl[-1] != T, (q_lens < 0).any(), (sl < q_lens).any(),
        (n_used > max_blocks).any(), bad_entry.any(), q_lens.max(), bad_tree,
    ]).tolist()
    first_bad, last_bad, neg_len, short_seq, few_blocks, bad_bt, max_q, bad_tree = facts
    if first_bad or last_bad:
        raise ValueError(f"{who}: query_start_loc must start at 0 and end at T = {T}, got "
                         f"{qsl[0].item()} .. {qsl[-1].item()}")
    if neg_len:
        raise ValueError(f"{who}: query_start_loc must be non-decreasing")
    if short_seq:
        raise ValueError(f"{who}: a sequence has seq_len < its number of new query tokens "
                         f"(seq_lens counts this step's tokens too)")
    if few_blocks:
        raise ValueError(f"{who}: a sequence needs more blocks than block_tables has columns "
                         f"({max_blocks} x block_size {block_size})")
    if bad_bt:
        raise ValueError(f"{who}: a used block_tables entry is outside [0, {num_blocks})")
    if bad_tree:
        raise ValueError(f"{who}: a tree_bits row other than -1 must belong to one of its sequence's first 64 "
                         f"tokens (a tree has at most 64 nodes) and have its own bit set (a node sees itself)")
    if max_query_len is not None and max_query_len < max_q:
        raise ValueError(f"{who}: max_query_len {max_query_len} < the longest query {max_q}")
    return int(max_q)


def _tiles(max_q_len: int, queries_per_kv: int):
    """Pick (BLOCK_Q, BLOCK_M): one token per program for decode, many for prefill."""
    if max_q_len <= 1:
        block_q = 1                      # decode: one token, all G heads of the group
    else:
        block_q = max(1, min(triton.next_power_of_2(max_q_len), PREFILL_ROWS // queries_per_kv))
    block_m = max(MIN_DOT, triton.next_power_of_2(block_q * queries_per_kv))
    return block_q, block_m


def _launch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            scale, max_q_len, out, tree_bits=None, k_scale=None, v_scale=None):
    """Launch the kernel on already-checked inputs (the benchmark times this)."""
    T, H, D = query.shape
    Hkv = key_cache.shape[2]
    G = H // Hkv
    block_q, block_m = _tiles(max_q_len, G)
    ks, vs, *scale_strides = kv_quant.scale_args(k_scale, v_scale, seq_lens)
    grid = (seq_lens.shape[0], triton.cdiv(max_q_len, block_q), Hkv)
    _paged_attention_kernel[grid](
        query, kv_quant.storage_view(key_cache), kv_quant.storage_view(value_cache), out,
        block_tables, seq_lens, query_start_loc,
        seq_lens if tree_bits is None else tree_bits,     # a pointer never read when HAS_TREE is False
        ks, vs, float(scale),
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_tables.stride(0), *scale_strides,
        key_cache.shape[1], D,
        QUERIES_PER_KV=G, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(D)),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_TREE=tree_bits is not None, KV_FORMAT=kv_quant.kv_format(key_cache),
    )
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    max_query_len: Optional[int] = None, *,
                    tree_bits: Optional[torch.Tensor] = None, k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of the flat batch's queries over the paged KV cache.

    query [T, H, D] -> out [T, H, D] (query dtype). Sequence b's queries are rows
    query_start_loc[b]:query_start_loc[b+1]; its context (this step's tokens
    included, already stored) is seq_lens[b] tokens, found through
    block_tables[b]. max_query_len, if given, must be >= every q_len.
    tree_bits [T] int64, if given: row t sees this step's token i only if bit i is set
    (a token tree's mask, ``minibatch/kv/tree.py``'s mask_bits; -1 = causal).
    k_scale, v_scale: a quantized cache's scales (fp8, int8; one float32 each or [num_blocks, block_size, Hkv]).
    """
    max_q = check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens,
                               query_start_loc, scale, max_query_len, tree_bits=tree_bits,
                               k_scale=k_scale, v_scale=v_scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0 or max_q == 0:
        return out
    return _launch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                   scale, max_q, out, tree_bits=tree_bits, k_scale=k_scale, v_scale=v_scale)
