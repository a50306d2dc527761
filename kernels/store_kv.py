"""Write this step's keys and values into the paged KV cache, by slot mapping.

Before attention can read a token's key and value from the paged cache, they
have to be *in* it. The engine hands us, for each of the T new tokens of the
flat batch, one **slot**: ``slot = block_id * block_size + offset``, i.e. which
physical block and which row inside that block the token's K/V belong in
(vLLM paper, Kwon et al. 2023, section 4.1: "PagedAttention" stores each
sequence's KV cache in non-contiguous fixed-size blocks). A slot of -1 means
"do not store this token" (vLLM uses it for padding tokens).

This is a scatter, nothing more: ``key_cache.view(-1, Hkv, D)[slot[t]] = key[t]``.
The Triton version launches one program per token; each program moves that
token's whole ``[Hkv, D]`` key and value tile with one masked load and one
masked store each.

A quantized cache (fp8, int8; ``kv_quant.py``) is stored as ``minibatch/kv/quant.py`` stores it, bit for bit:
``q = clamp(x / scale, -max, max)`` cast to the storage format. Per tensor, the scale is the layer's one float32
(k_scale, v_scale); per (token, head) each program computes its token's scales, amax over head_dim / max (1.0
for an all-zero head), and writes them into the scale caches at the token's slot, beside the codes
(``backends/loop.py``'s ``_quantize_rows``). fp8 is encoded from the float32 bits with integer arithmetic,
as ``kv_quant.py`` says why (sm_80 has no e4m3 in Triton).

Shapes:
    key, value              [T, Hkv, D]
    key_cache, value_cache  [num_blocks, block_size, Hkv, D]  (any strides)
    slot_mapping            [T] int32 or int64, -1 = skip
    k_scale, v_scale        None; one float32 each (per tensor); or [num_blocks, block_size, Hkv] (per token, head)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,                  # [T, Hkv, D] new keys / values
    key_cache_ptr, value_cache_ptr,      # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,                    # [T]
    k_scale_ptr, v_scale_ptr,            # a quantized cache's scales (read per tensor, written per token-head)
    stride_kt, stride_kh, stride_kd,     # strides of key (elements, not bytes)
    stride_vt, stride_vh, stride_vd,     # strides of value
    stride_cb, stride_cs, stride_ch, stride_cd,   # strides of key_cache
    stride_wb, stride_ws, stride_wh, stride_wd,   # strides of value_cache
    stride_sb, stride_ss, stride_sh,              # strides of the per-token-head scale caches
    block_size,                          # rows (tokens) per cache block
    num_kv_heads, head_dim,              # true sizes; the tile below may be larger
    BLOCK_H: tl.constexpr,               # num_kv_heads rounded up to a power of two
    BLOCK_D: tl.constexpr,               # head_dim rounded up to a power of two
    KV_FORMAT: tl.constexpr = 0,         # kv_quant's: 0 = the model's dtype, 1 e4m3, 2 e5m2, 3 int8
    PER_TOKEN_SCALE: tl.constexpr = False,   # scales per (token, head), computed here (else one per tensor)
):
    # One program per token of the flat batch.
    t = tl.program_id(0)

    # Where does this token go? A slot of -1 means "skip": the program exits
    # before touching memory, so those cache rows keep their old contents.
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // block_size        # which physical block
    offset = slot % block_size           # which row inside it

    # A [BLOCK_H, BLOCK_D] grid of (head, dim) indices. Tile sizes must be
    # powers of two in Triton, so we round up and mask the extra lanes off:
    # without the mask the padded lanes would read the next token's key and
    # write into the neighbouring cache row.
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)

    # Gather key[t, :, :] and value[t, :, :] (strided, so views work too).
    src_k = key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    src_v = value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    k = tl.load(src_k, mask=mask, other=0.0)     # 0 in the padded lanes: a per-head amax ignores them
    v = tl.load(src_v, mask=mask, other=0.0)

    # Scatter into row `offset` of block `block_id`. The cache strides are
    # passed in, so a layer's K/V views of the big 6-d cache need no copy.
    dst_k = (key_cache_ptr + block_id * stride_cb + offset * stride_cs
             + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd)
    dst_v = (value_cache_ptr + block_id * stride_wb + offset * stride_ws
             + offs_h[:, None] * stride_wh + offs_d[None, :] * stride_wd)
    if KV_FORMAT != 0:
        k = _quantize(k, k_scale_ptr, block_id, offset, offs_h, num_kv_heads,
                      stride_sb, stride_ss, stride_sh, KV_FORMAT, PER_TOKEN_SCALE)
        v = _quantize(v, v_scale_ptr, block_id, offset, offs_h, num_kv_heads,
                      stride_sb, stride_ss, stride_sh, KV_FORMAT, PER_TOKEN_SCALE)
    tl.store(dst_k, k, mask=mask)
    tl.store(dst_v, v, mask=mask)


@triton.jit
def _quantize(x, scale_ptr, block_id, offset, offs_h, num_kv_heads, stride_sb, stride_ss, stride_sh,
              KV_FORMAT: tl.constexpr, PER_TOKEN_SCALE: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] (masked lanes 0) -> its codes. Per (token, head) the scales are amax / max, written at
    the token's slot of the scale cache; per tensor, the one scale is read."""
    x = x.to(tl.float32)
    if PER_TOKEN_SCALE:
        amax = tl.max(tl.abs(x), 1)                                              # [BLOCK_H]
        s = tl.where(amax > 0, tl.math.div_rn(amax, kv_quant.max_code(KV_FORMAT)), 1.0)
        tl.store(scale_ptr + block_id * stride_sb + offset * stride_ss + offs_h * stride_sh, s,
                 mask=offs_h < num_kv_heads)
        return kv_quant.quantize_tile(x, s[:, None], KV_FORMAT)
    else:
        return kv_quant.quantize_tile(x, tl.load(scale_ptr), KV_FORMAT)


def _check_store_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Raise one clear TypeError/ValueError for bad input; touch nothing."""
    names = ("key", "value", "key_cache", "value_cache", "slot_mapping")
    for name, x in zip(names, (key, value, key_cache, value_cache, slot_mapping)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"store_kv: {name} must be a torch.Tensor, got {type(x).__name__}")
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"store_kv: key and value must be [T, num_kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"store_kv: key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"store_kv: key_cache and value_cache must both be "
                         f"[num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"store_kv: key has (num_kv_heads, head_dim) = {tuple(key.shape[1:])} "
                         f"but the cache holds {tuple(key_cache.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"store_kv: slot_mapping must be [T] = [{key.shape[0]}], "
                         f"got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"store_kv: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    quantized = kv_quant.kv_format(key_cache) != kv_quant.NONE
    if quantized or k_scale is not None or v_scale is not None:
        kv_quant.check_scales(key_cache, value_cache, k_scale, v_scale, "store_kv")
    dtypes = {key.dtype, value.dtype} if quantized else {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    if len(dtypes) != 1 or (quantized and not key.is_floating_point()):
        raise TypeError(f"store_kv: key, value and the caches must share one dtype, got "
                        f"{key.dtype}, {value.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    devices = {x.device for x in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"store_kv: all tensors must be on one device, got {sorted(map(str, devices))}")
    # Value checks (one host sync): an out-of-range slot would write outside
    # the cache; two tokens with one slot would race and leave either value.
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel():
        bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
        stored = slot_mapping[slot_mapping >= 0]
        dup = stored.numel() != torch.unique(stored).numel()
        if bool(bad.any()):
            raise ValueError(f"store_kv: slot_mapping holds {slot_mapping[bad][0].item()}, "
                             f"outside [-1, {num_slots}) (num_blocks * block_size)")
        if dup:
            raise ValueError("store_kv: two tokens map to the same slot; each slot holds one token")


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
             k_scale: torch.Tensor = None, v_scale: torch.Tensor = None) -> None:
    """Scatter ``key[t]``/``value[t]`` into cache slot ``slot_mapping[t]`` (in place).

    key, value: [T, Hkv, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, D]
    (strided views are fine); slot_mapping: [T] int32/int64, -1 = skip the token.
    k_scale, v_scale: a quantized cache's scales (see the module docstring); per (token, head) they are written.
    """
    _check_store_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    launch_store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def launch_store_kv(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """Launch the kernel on already-checked inputs (the engine checks its metadata once per step)."""
    T, num_kv_heads, head_dim = key.shape
    if T == 0:
        return
    fmt = kv_quant.kv_format(key_cache)
    ks, vs, *scale_strides = kv_quant.scale_args(k_scale, v_scale, slot_mapping)
    grid = (T,)
    _store_kv_kernel[grid](
        key, value, kv_quant.storage_view(key_cache), kv_quant.storage_view(value_cache), slot_mapping, ks, vs,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(), *scale_strides,
        key_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FORMAT=fmt, PER_TOKEN_SCALE=fmt != kv_quant.NONE and k_scale.numel() != 1,
    )
