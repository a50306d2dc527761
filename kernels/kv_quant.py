"""Quantized KV blocks in Triton: fp8 and int8 codes encoded and decoded with integer arithmetic.

A quantized cache (``minibatch/kv/quant.py`` owns the formats and torch's quantize / dequantize, which these
helpers are held to) stores ``q = clamp(x / scale, -max, max)`` cast to fp8 (e4m3: 1 sign, 4 exponent, 3 mantissa
bits, bias 7, max 448; e5m2: 1-5-2, bias 15, max 57344) or rounded to int8 (-127..127); it reads back as
``q * scale``. The kernels receive ``KV_FORMAT`` (a constexpr: 0 = not quantized, then the kernel compiles
exactly as before) and the scales: one float32 each for K and V (per tensor: strides 0, so every key reads the
one element) or [num_blocks, block_size, Hkv] (per token and head, at the key's slot).

**Why fp8 travels as uint8 bits.** Triton's ``tl.float8e4nv`` (e4m3) needs sm_89 or newer: compiling a kernel
that loads it for sm_80 (A100) fails with "type fp8e4nv not supported in this architecture. The supported fp8
dtypes are ('fp8e4b15', 'fp8e5')" (Triton 3.8, ``triton.compile`` for GPUTarget("cuda", 80, 32); found while
writing this module). e5m2 would compile, and both run in the interpreter, but one path that compiles
everywhere beats two: an fp8 cache reaches the kernels as a uint8 view of its bytes (``storage_view``), and
``decode_fp8`` rebuilds the value from the bits (sign, exponent, mantissa, subnormals); ``encode_fp8`` is its
inverse for the store, rounding to nearest even as torch's cast does, so the Triton store is bit-exact with
the torch store. The codes the store never writes (e4m3's NaN, e5m2's inf and NaN: values are clamped to
+-max first) are not decoded specially.

**Where the scale is applied.** A key's scale is one number over head_dim, so ``q . (k_code * s) =
s * (q . k_code)``: the kernels take the dot product on the codes and multiply the score column by the key's
scale, and multiply each probability by its value's scale before ``p @ v_code``. The dequantized values are
never formed, in registers or anywhere else, let alone a dequantized copy of the context. fp8 and int8 codes
are exact in fp16 (e4m3 and e5m2 are fp16's subsets; int8's are integers below 2048), so a fp16 ``tl.dot`` on
codes loses nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# KV_FORMAT codes: (name in minibatch/kv/quant.py, mantissa bits, exponent bias, largest magnitude)
NONE, E4M3, E5M2, INT8 = 0, 1, 2, 3
_FORMATS = {torch.int8: INT8}
for _name, _code in (("float8_e4m3fn", E4M3), ("float8_e5m2", E5M2)):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _FORMATS[getattr(torch, _name)] = _code


def kv_format(cache: torch.Tensor) -> int:
    """The KV_FORMAT of a cache tensor: NONE for a float cache of the model's dtype."""
    return _FORMATS.get(cache.dtype, NONE)


def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """What a kernel is handed: an fp8 cache as uint8 (the same bytes and strides), anything else as it is."""
    return cache.view(torch.uint8) if kv_format(cache) in (E4M3, E5M2) else cache


def check_scales(key_cache, value_cache, k_scale, v_scale, who: str) -> None:
    """A quantized cache (one dtype for K and V) takes k_scale and v_scale: float32 on its device, one element each
    or [num_blocks, block_size, Hkv] each, positive and finite (as minibatch/kv/checks.py's check_scales; one host
    sync); an unquantized cache takes none."""
    quantized = kv_format(key_cache) != NONE
    if not quantized and k_scale is None and v_scale is None:
        return
    if not quantized or value_cache.dtype != key_cache.dtype:
        raise TypeError(f"{who}: k_scale / v_scale are for a quantized cache (fp8, int8), one dtype for K and V; "
                        f"got {key_cache.dtype} / {value_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.device != key_cache.device:
            raise TypeError(f"{who}: a {key_cache.dtype} cache needs {name}, a float32 tensor on "
                            f"{key_cache.device}; got {getattr(s, 'dtype', type(s).__name__)}")
        if s.numel() != 1 and tuple(s.shape) != tuple(key_cache.shape[:3]):
            raise ValueError(f"{who}: {name} is one element (per tensor) or [num_blocks, block_size, Hkv] = "
                             f"{list(key_cache.shape[:3])} (per token and head), got {tuple(s.shape)}")
    if (k_scale.numel() == 1) != (v_scale.numel() == 1):
        raise ValueError(f"{who}: k_scale and v_scale must have one granularity")
    if not bool(torch.stack([(torch.isfinite(s) & (s > 0)).all() for s in (k_scale, v_scale)]).all()):
        raise ValueError(f"{who}: k_scale and v_scale must be positive and finite everywhere")


def scale_args(k_scale, v_scale, fallback: torch.Tensor) -> tuple:
    """(k_scale, v_scale, stride_sb, stride_ss, stride_sh) for a launch. Per tensor (one element each) the strides
    are 0, so every key reads the one scale; per (token, head) they are the scale caches' own (both one layout).
    No scales (an unquantized cache): ``fallback`` for both pointers, never read (KV_FORMAT is NONE)."""
    if k_scale is None:
        return fallback, fallback, 0, 0, 0
    if k_scale.numel() == 1:
        return k_scale, v_scale, 0, 0, 0
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"k_scale and v_scale must share one layout, got strides {k_scale.stride()} and "
                         f"{v_scale.stride()}")
    return (k_scale, v_scale, *k_scale.stride())


def launch_args(key_cache, k_scale, v_scale, fallback) -> dict:
    """A decode kernel's last arguments, by name (``paged_decode``'s and exercise 9's): the scales, their strides
    and the format (unread pointers, strides 0 and KV_FORMAT 0 for an unquantized cache)."""
    ks, vs, sb, ss, sh = scale_args(k_scale, v_scale, fallback)
    return dict(k_scale_ptr=ks, v_scale_ptr=vs, stride_sb=sb, stride_ss=ss, stride_sh=sh,
                KV_FORMAT=kv_format(key_cache))


@triton.jit
def _pow2(e):
    """2^e as float32 for an int32 e in -126..127, exactly: the exponent field written directly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def decode_fp8(b, MANT: tl.constexpr, BIAS: tl.constexpr):
    """uint8 fp8 bits -> float32 value: (-1)^s (2^MANT + m) 2^(e - BIAS - MANT), or m 2^(1 - BIAS - MANT) if e = 0."""
    b = b.to(tl.int32)
    e = (b >> MANT) & ((1 << (7 - MANT)) - 1)
    m = b & ((1 << MANT) - 1)
    mag = tl.where(e == 0, m, m + (1 << MANT)).to(tl.float32) * _pow2(tl.maximum(e, 1) - BIAS - MANT)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def encode_fp8(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """float32 y with |y| <= the format's max -> uint8 fp8 bits, rounded to nearest even (torch's cast).

    Normal results round fp32's bits from 23 to MANT mantissa bits (a carry moves into the exponent, as it
    should) and rebias the exponent; subnormal ones (|y| < 2^(1 - BIAS)) round the 24-bit significand shifted
    to the subnormal step 2^(1 - BIAS - MANT), where a round up to 2^MANT is exactly the smallest normal's code."""
    bits = y.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    e = a >> 23                                                   # fp32's biased exponent
    SH: tl.constexpr = 23 - MANT
    r = (a + (1 << (SH - 1)) - 1 + ((a >> SH) & 1)) >> SH        # round half to even
    normal = r - ((127 - BIAS) << MANT)
    sig = (a & 0x7FFFFF) | tl.where(e != 0, 0x800000, 0)
    s2 = SH + (1 - BIAS) - (tl.maximum(e, 1) - 127)              # the subnormal shift (> SH where used);
    s2 = tl.minimum(tl.maximum(s2, SH + 1), 31)                  # kept in 1..31 where not (no undefined shift)
    sub = (sig + (1 << (s2 - 1)) - 1 + ((sig >> s2) & 1)) >> s2
    code = tl.where(e - 127 >= 1 - BIAS, normal, sub)
    return (code | tl.where(bits < 0, 0x80, 0)).to(tl.uint8)


@triton.jit
def codes_to_float(x, KV_FORMAT: tl.constexpr):
    """A tile loaded from a quantized cache (uint8 fp8 bits, or int8) -> its codes as float32 (value / scale)."""
    if KV_FORMAT == 1:
        return decode_fp8(x, 3, 7)
    elif KV_FORMAT == 2:
        return decode_fp8(x, 2, 15)
    else:
        return x.to(tl.float32)


@triton.jit
def load_scales(scale_ptr, phys, in_block, kv_head, stride_sb, stride_ss, stride_sh, mask):
    """The scales of the keys at (phys, in_block) of kv_head: one per key (strides 0: the per-tensor one)."""
    return tl.load(scale_ptr + phys * stride_sb + in_block * stride_ss + kv_head * stride_sh, mask=mask, other=1.0)


@triton.jit
def max_code(KV_FORMAT: tl.constexpr):
    """The largest magnitude a format stores (quant.max_representable): 448, 57344 or 127."""
    if KV_FORMAT == 1:
        return 448.0
    elif KV_FORMAT == 2:
        return 57344.0
    else:
        return 127.0


@triton.jit
def quantize_tile(x, s, KV_FORMAT: tl.constexpr):
    """float32 x / s clamped to +-max -> the codes to store: uint8 fp8 bits, or int8 rounded half to even.
    As quant._quantize: an IEEE division (div_rn; Triton's ``/`` is approximate on a GPU), the clamp, the cast."""
    m = max_code(KV_FORMAT)
    y = tl.math.div_rn(x, s)
    y = tl.minimum(tl.maximum(y, -m), m)
    if KV_FORMAT == 1:
        return encode_fp8(y, 3, 7)
    elif KV_FORMAT == 2:
        return encode_fp8(y, 2, 15)
    else:
        # round half to even: adding 1.5 * 2^23 leaves no fraction bits in fp32, and the add rounds to nearest even
        return ((y + 12582912.0) - 12582912.0).to(tl.int8)
