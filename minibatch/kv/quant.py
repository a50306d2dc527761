"""Quantized KV blocks in torch: the dtypes, the scales, quantize and dequantize; the reference kernels are held to.

After grouped-query attention, the second lever on KV memory is to store K and V in fewer bits. vLLM's
``kv_cache_dtype`` names the choices, and so does this module:

    "auto"      the model's dtype; nothing quantized, no scale                          (fp32: 4 bytes, bf16: 2)
    "fp8_e4m3"  torch.float8_e4m3fn: 1 sign, 4 exponent, 3 mantissa bits, max +-448    (1 byte; vLLM's "fp8")
    "fp8_e5m2"  torch.float8_e5m2:   1 sign, 5 exponent, 2 mantissa bits, max +-57344  (1 byte)
    "int8"      torch.int8, symmetric: -127..127 steps of one scale                     (1 byte)

A stored value is ``q = clamp(x / scale, -max, max)`` cast to the storage dtype (int8: rounded to the nearest step
first), and it reads back as ``q * scale``. The **scale** maps the values onto the format's range; its
granularity is one of:

    "per_tensor"      one scale per layer for K and one for V (vLLM's ``k_scale`` / ``v_scale``): 1.0, or
                      calibrated on the first batch as amax / max (``calibrate_scale``; vLLM's
                      ``calculate_kv_scales``, which also never updates it)
    "per_token_head"  one scale per (token, KV head), amax over head_dim / max (``token_head_scales``), stored
                      beside the blocks: [num_blocks, block_size, Hkv] per layer for K and for V

The pitfalls this module's tests show: e4m3 saturates at +-448 (so values are clamped, never cast past the range,
where torch gives NaN or inf); a per-tensor scale of 1.0 clips large values and flushes small ones to zero
(below 2^-10 for e4m3, below 0.5 for int8); one calibration batch goes stale as the context grows; and per
(token, head) costs bytes: 4 per scale, one per head_dim values (``bytes_per_token`` counts them).

How close a round trip is, |x - dequantize(quantize(x))|, follows from the format (m mantissa bits, smallest
normal 2^e_min): a float format rounds to the nearest of 2^m steps per binade, so the error is at most
2^-(m+1) |x| for a normal value and half the subnormal step, 2^(e_min - m - 1) * scale, below; int8's steps are
the scale itself, so at most scale / 2. ``round_trip_bound`` says so per dtype, and the tests hold it.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")
ALIASES = {"fp8": "fp8_e4m3"}                    # vLLM's "fp8" is e4m3
SCALE_GRANULARITIES = ("per_tensor", "per_token_head")
SCALE_DTYPE = torch.float32                      # a scale's own dtype, as vLLM's k_scale / v_scale
INT8_MAX = 127                                   # symmetric: -128 is never written, so -q is always representable
_TORCH_NAMES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"}

Scale = Union[float, torch.Tensor]


def check_kv_cache_dtype(name) -> str:
    """The canonical name of a kv_cache_dtype ("fp8" -> "fp8_e4m3"); a ValueError lists the choices."""
    name = ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {list(KV_CACHE_DTYPES)} "
                         f"(or {list(ALIASES)}, vLLM's alias of fp8_e4m3)")
    return name


def check_scale_granularity(name) -> str:
    if name not in SCALE_GRANULARITIES:
        raise ValueError(f"unknown scale granularity {name!r}; choose one of {list(SCALE_GRANULARITIES)}")
    return name


def is_quantized(kv_cache_dtype: str) -> bool:
    return check_kv_cache_dtype(kv_cache_dtype) != "auto"


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype the blocks are stored in: the model's for "auto", else the quantized one. fp8 where this torch
    build has no such dtype is a ValueError naming it."""
    name = check_kv_cache_dtype(kv_cache_dtype)
    if name == "auto":
        return model_dtype
    dtype = getattr(torch, _TORCH_NAMES[name], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kv_cache_dtype {name!r} needs torch.{_TORCH_NAMES[name]}, which this torch build "
                         f"({torch.__version__}) does not have; choose 'int8' or 'auto'")
    return dtype


def max_representable(kv_cache_dtype: str) -> float:
    """The largest magnitude a quantized dtype stores: 448 (e4m3), 57344 (e5m2), 127 (int8)."""
    dtype = storage_dtype(kv_cache_dtype)
    if not is_quantized(kv_cache_dtype):
        raise ValueError("kv_cache_dtype 'auto' quantizes nothing: it has no range to scale onto")
    return float(INT8_MAX) if dtype == torch.int8 else float(torch.finfo(dtype).max)


def round_trip_bound(kv_cache_dtype: str) -> tuple:
    """(relative, absolute in units of the scale): |x - dequantize(quantize(x, s))| <= max(rel * |x|, abs * s)
    for |x| <= max * s. Float formats: rel = 2^-(m+1) = eps / 2, abs = half the subnormal step = eps / 2 * the
    smallest normal; int8: rel = 0, abs = 1/2 (e4m3: 2^-4 and 2^-10; e5m2: 2^-3 and 2^-17)."""
    dtype = storage_dtype(kv_cache_dtype)
    if not is_quantized(kv_cache_dtype):
        return 0.0, 0.0
    if dtype == torch.int8:
        return 0.0, 0.5
    f = torch.finfo(dtype)
    return f.eps / 2, f.eps / 2 * f.smallest_normal


def check_scale(scale: Optional[Scale], who: str = "scale") -> None:
    """A scale is positive and finite, every element of it: zero, negative, NaN or inf is a ValueError."""
    if scale is None:
        raise ValueError(f"{who}: a quantized kv_cache_dtype needs a scale (1.0, calibrated, or per token-head)")
    if isinstance(scale, torch.Tensor):
        if not scale.is_floating_point():
            raise ValueError(f"{who} must be a floating-point tensor, got {scale.dtype}")
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            raise ValueError(f"{who} must be positive and finite everywhere; got {scale[bad].flatten()[:4].tolist()}")
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{who} must be a positive finite number, got {scale!r}")


def _scale_for(scale: Scale, x: torch.Tensor, who: str) -> torch.Tensor:
    """The scale as a float32 tensor that broadcasts over x [..., D]: a number or one element (per tensor), or
    x.shape[:-1] (per token and head: [T, Hkv] for x [T, Hkv, D]), given a trailing axis of 1."""
    s = torch.as_tensor(scale, dtype=SCALE_DTYPE, device=x.device)
    if s.numel() == 1:
        return s.reshape(())
    if tuple(s.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{who}: a scale is one number (per tensor) or one per (token, head) with shape "
                         f"{tuple(x.shape[:-1])}; got {tuple(s.shape)}")
    return s.unsqueeze(-1)


def quantize(x: torch.Tensor, kv_cache_dtype: str, scale: Optional[Scale]) -> torch.Tensor:
    """x [..., D] (e.g. [T, Hkv, D], float) -> q [..., D] in ``storage_dtype(kv_cache_dtype)``.

    scale: None for "auto" (x is returned as it is); else a number or one-element tensor (per tensor) or a
    float tensor x.shape[:-1] (per token and head). Values past max * scale are clamped to +-max: never NaN or inf.
    """
    name = check_kv_cache_dtype(kv_cache_dtype)
    if name == "auto":
        if scale is not None:
            raise ValueError("kv_cache_dtype 'auto' stores the model's values as they are: pass scale=None")
        return x
    check_scale(scale, "quantize: scale")
    dtype = storage_dtype(name)
    return _quantize(x, dtype, _scale_for(scale, x, "quantize"))


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """The body, on a checked scale that broadcasts over x: clamp onto the range, then cast (int8: round first)."""
    y = x.to(SCALE_DTYPE) / scale                                    # [..., D] in float32
    if dtype == torch.int8:
        return y.clamp(-INT8_MAX, INT8_MAX).round().to(torch.int8)  # round half to even, as torch.round does
    m = torch.finfo(dtype).max
    return y.clamp(-m, m).to(dtype)                                  # the cast rounds to nearest even


def dequantize(q: torch.Tensor, scale: Optional[Scale], out_dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] (quantized, or the model's dtype for "auto") -> q * scale [..., D] in out_dtype.

    scale: None for an unquantized q; else a number or one-element tensor, or a float tensor q.shape[:-1]."""
    if q.dtype not in quantized_dtypes():
        if scale is not None:
            raise ValueError(f"dequantize: q is {q.dtype}, not a quantized dtype: pass scale=None")
        return q.to(out_dtype)
    check_scale(scale, "dequantize: scale")
    return _dequantize(q, _scale_for(scale, q, "dequantize"), out_dtype)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (q.to(SCALE_DTYPE) * scale).to(out_dtype)


def quantized_dtypes() -> tuple:
    return tuple(d for d in (getattr(torch, n, None) for n in _TORCH_NAMES.values()) if isinstance(d, torch.dtype))


def calibrate_scale(x: torch.Tensor, kv_cache_dtype: str) -> float:
    """A per-tensor scale from one batch: amax(|x|) / max, so the batch's largest value lands on the range's edge.
    All zeros give 1.0 (zeros are exact at any scale); a non-finite value in x is a ValueError."""
    return scale_from_amax(float(x.detach().abs().max()) if x.numel() else 0.0, kv_cache_dtype)


def scale_from_amax(amax: float, kv_cache_dtype: str) -> float:
    """amax / max, 1.0 for an amax of 0; the one rule, for one batch (``calibrate_scale``) or for the largest
    amax over tensor-parallel ranks (``KVCache.calibrate``)."""
    if not math.isfinite(amax):
        raise ValueError(f"calibrate_scale: the batch holds a non-finite value ({amax}); no scale fits it")
    return amax / max_representable(kv_cache_dtype) if amax > 0 else 1.0


def token_head_scales(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """x [T, Hkv, D] -> scales [T, Hkv] float32: each (token, head)'s amax over D / max (1.0 where all zero)."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError("token_head_scales: x holds a non-finite value; no scale fits it")
    return _token_head_scales(x, max_representable(kv_cache_dtype))


def _token_head_scales(x: torch.Tensor, max_value: float) -> torch.Tensor:
    """The body, without the host sync of the check (the engine's store calls it every layer)."""
    amax = x.detach().abs().amax(dim=-1).to(SCALE_DTYPE)             # [T, Hkv]
    return torch.where(amax > 0, amax / max_value, torch.ones_like(amax))


def kv_cache_dtype_of(dtype: torch.dtype) -> str:
    """The kv_cache_dtype a pool of ``dtype`` was made for: "auto" for an unquantized one."""
    return next((n for n, attr in _TORCH_NAMES.items() if getattr(torch, attr, None) == dtype), "auto")


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str = "auto",
                    model_dtype: torch.dtype = torch.float32, scale_granularity: str = "per_tensor") -> int:
    """One token's K and V in every layer, in bytes, the scales' share included:
    2 * L * Hkv * (D * element size + scale bytes), where per (token, head) stores one float32 scale for each
    head's K and each head's V, and per tensor none per token (2 * L numbers for the whole cache). "auto" stores
    no scale whatever the granularity."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    check_scale_granularity(scale_granularity)
    elem = torch.empty((), dtype=storage_dtype(kv_cache_dtype, model_dtype)).element_size()
    scale = SCALE_DTYPE.itemsize if is_quantized(kv_cache_dtype) and scale_granularity == "per_token_head" else 0
    return 2 * num_layers * num_kv_heads * (head_dim * elem + scale)


# -- the command line (``python -m minibatch generate`` and ``serve``), vLLM's flag names ---------------------------
def add_arguments(p) -> None:
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES) + list(ALIASES),
                   help="the KV blocks' dtype: auto (the model's), fp8_e4m3 (fp8), fp8_e5m2 or int8")
    p.add_argument("--kv-scale-granularity", default="per_tensor", choices=list(SCALE_GRANULARITIES),
                   help="a quantized cache's scales: one per layer (1.0, or --calculate-kv-scales) or per (token, head)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="per_tensor: the first batch sets each layer's scales (amax / max), never updated")


def config_kwargs(args) -> dict:
    return dict(kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                scale_granularity=getattr(args, "kv_scale_granularity", "per_tensor"),
                calculate_kv_scales=getattr(args, "calculate_kv_scales", False))
