"""The checks every attention backend shares: one clear error before anything is written.

The public backend functions (``backends.store_kv_torch``, ``paged_attention_loop``, ``paged_attention_batched``,
``paged_attention_cpu``) check what they are handed (``_check_attention``: the caches and their scales,
``check_metadata``, ``check_tree_bits``), so a student or a test calling one directly gets a clear error. Inside
the engine ``AttentionMetadata.build`` made the metadata and checked it once; with debug checks on
(``MINIBATCH_DEBUG_CHECKS=1``) ``PagedAttention`` re-checks it and every layer's q, k, v (``check_layer_inputs``).
``check_accepts`` says clearly when a student's function lacks a parameter a step needs (``tree_bits``, the scales).
"""
from __future__ import annotations

import inspect
import math

import torch

from minibatch.kv import quant
from minibatch.kv.tree import MAX_TREE_NODES


def _check_cache(key_cache, value_cache, who):
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a tensor, got {type(x).__name__}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"{who}: key_cache and value_cache must both be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype or key_cache.device != value_cache.device:
        raise TypeError(f"{who}: key_cache and value_cache differ in dtype or device")


def check_metadata(block_tables, seq_lens, query_start_loc, num_blocks, block_size, T, device, who):
    named = dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a tensor, got {type(x).__name__}")
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{who}: {name} must be int32 or int64, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{who}: {name} is on {x.device}, the cache on {device}")
    B = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if block_tables.dim() != 2 or block_tables.shape[0] != B or query_start_loc.shape != (B + 1,):
        raise ValueError(f"{who}: want block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1]; got "
                         f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}")
    qsl, sl = query_start_loc.long(), seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    n_used = (sl.clamp(min=0) + block_size - 1) // block_size             # blocks each sequence reads
    used = torch.arange(block_tables.shape[1], device=device)[None] < n_used[:, None]
    bt = block_tables.long()
    if int(qsl[0]) != 0 or int(qsl[-1]) != T:
        raise ValueError(f"{who}: query_start_loc must run from 0 to T = {T}, got {qsl.tolist()}")
    if bool((q_lens < 0).any()) or bool((sl < q_lens).any()):
        raise ValueError(f"{who}: need non-decreasing query_start_loc and seq_lens >= query lengths "
                         f"(seq_lens counts this step's tokens too); got {sl.tolist()}, {qsl.tolist()}")
    if B and int(n_used.max()) > block_tables.shape[1]:
        raise ValueError(f"{who}: seq_lens {sl.tolist()} need more blocks than block_tables has columns "
                         f"({block_tables.shape[1]})")
    if bool((used & ((bt < 0) | (bt >= num_blocks))).any()):
        raise ValueError(f"{who}: a block table entry a sequence reads is outside 0..{num_blocks - 1}")


def check_scales(key_cache, k_scale, v_scale, who) -> bool:
    """A quantized cache (fp8, int8) comes with its scales, an unquantized one without: both per tensor (one
    element each) or both per (token, head) ([num_blocks, block_size, Hkv], beside the blocks), float32,
    positive and finite, on the cache's device. Returns whether the cache is quantized."""
    quantized = key_cache.dtype in quant.quantized_dtypes()
    if (k_scale is None) != (v_scale is None) or (k_scale is None) == quantized:
        want = "k_scale and v_scale (quant.py)" if quantized else "no k_scale / v_scale (it is not quantized)"
        raise ValueError(f"{who}: a cache of {key_cache.dtype} needs {want}")
    if not quantized:
        return False
    shapes = set()
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor) or s.dtype != quant.SCALE_DTYPE or s.device != key_cache.device:
            raise TypeError(f"{who}: {name} must be a {quant.SCALE_DTYPE} tensor on {key_cache.device}")
        if s.numel() != 1 and tuple(s.shape) != tuple(key_cache.shape[:3]):
            raise ValueError(f"{who}: {name} is one number (per tensor) or [num_blocks, block_size, Hkv] = "
                             f"{list(key_cache.shape[:3])} (per token and head), got {tuple(s.shape)}")
        quant.check_scale(s, f"{who}: {name}")
        shapes.add(s.numel() == 1)
    if len(shapes) != 1:
        raise ValueError(f"{who}: k_scale and v_scale must have one granularity")
    return True


def _check_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, who,
                     tree_bits=None, k_scale=None, v_scale=None):
    _check_cache(key_cache, value_cache, who)
    quantized = check_scales(key_cache, k_scale, v_scale, who)
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError(f"{who}: query must be a tensor [T, H, D]")
    N, bs, Hkv, D = key_cache.shape
    if query.shape[2] != D or query.shape[1] % Hkv:
        raise ValueError(f"{who}: query [T, H={query.shape[1]}, D={query.shape[2]}] does not fit a cache of "
                         f"{Hkv} kv heads of dim {D} (H must be a multiple of Hkv)")
    if (not query.is_floating_point() if quantized else query.dtype != key_cache.dtype) \
            or query.device != key_cache.device:
        raise TypeError(f"{who}: query is {query.dtype} on {query.device}, the cache {key_cache.dtype} "
                        f"on {key_cache.device}; they must match (a quantized cache: any float query)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"{who}: scale must be a finite number, got {scale!r}")
    check_metadata(block_tables, seq_lens, query_start_loc, N, bs, query.shape[0], query.device, who)
    if tree_bits is not None:
        check_tree_bits(tree_bits, query_start_loc, query.shape[0], query.device, who)


def check_tree_bits(tree_bits, query_start_loc, T, device, who):
    """tree_bits [T] int64; a tree row (not -1) is one of its sequence's first MAX_TREE_NODES and sees itself."""
    if not isinstance(tree_bits, torch.Tensor) or tree_bits.dtype != torch.int64 or tree_bits.shape != (T,):
        raise TypeError(f"{who}: tree_bits must be an int64 tensor [T = {T}], got "
                        f"{getattr(tree_bits, 'dtype', type(tree_bits).__name__)} {tuple(getattr(tree_bits, 'shape', ()))}")
    if tree_bits.device != device:
        raise ValueError(f"{who}: tree_bits is on {tree_bits.device}, the query on {device}")
    qsl, t = query_start_loc.long(), torch.arange(T, device=device)
    i = t - qsl[torch.searchsorted(qsl[1:], t, right=True).clamp(max=len(qsl) - 2)]     # [T] index in its sequence
    n = MAX_TREE_NODES
    if bool(((tree_bits != -1) & ((i >= n) | ((tree_bits >> i.clamp(0, n - 1)) & 1 == 0))).any()):
        raise ValueError(f"{who}: a tree_bits row other than -1 must belong to one of its sequence's first {n} "
                         f"tokens (a tree has at most {n} nodes) and have its own bit set (a node sees itself)")


def check_accepts(fn, names, who: str) -> None:
    """A clear error, before the call, when ``fn`` has no parameter for one of ``names``: e.g. a student's paged
    attention (ex2) has no ``tree_bits``, which a token tree step needs."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [n for n in names if n not in params]
    if missing:
        raise TypeError(f"{who} takes no {', '.join(missing)}, which this step needs (a token tree's mask is "
                        f"tree_bits); run trees on another attention backend, or give it "
                        f"{', '.join(f'{n}=None' for n in missing)} and honour it")


def check_layer_inputs(c, md, q, k, v) -> None:
    """Debug checks of one layer's q, k, v against the cache (off by default: the model makes them)."""
    T = md.slot_mapping.shape[0]
    if q.dim() != 3 or q.shape[0] != T or q.shape[2] != c.head_dim or q.shape[1] % c.num_kv_heads:
        raise ValueError(f"PagedAttention: q must be [T={T}, H, D={c.head_dim}] with H a multiple of "
                         f"num_kv_heads={c.num_kv_heads}, got {tuple(q.shape)}")
    want = (T, c.num_kv_heads, c.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"PagedAttention: k and v must be {list(want)}, got {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype == c.model_dtype or not q.device == k.device == v.device == c.device:
        raise TypeError(f"PagedAttention: q/k/v are {q.dtype}/{k.dtype}/{v.dtype} on {q.device}, the cache's model "
                        f"dtype {c.model_dtype} on {c.device}; they must match")
