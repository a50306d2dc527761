"""Quantized KV (minibatch/kv/quant.py), the torch reference every kernel is held to.

* a round trip stays inside the bound its format allows, stated per dtype from the mantissa bits (and checked
  against torch.finfo), on values across the whole range, normals and subnormals, per tensor and per (token, head);
* values past the range are clamped, never NaN or inf (1e6 at scale 1.0), and e4m3 saturates at exactly 448;
* a zero, negative or non-finite scale is refused, as is an unknown kv_cache_dtype (the choices listed), and fp8
  where torch lacks the dtype names it;
* the pitfall of a scale of 1.0: small values flush to zero and large ones clip, where per (token, head) keeps both;
* bytes per token, the scales' share counted.
"""
import math

import pytest
import torch

from minibatch.kv import quant

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]
# (relative error, absolute error in units of the scale), from each format:
#   e4m3: m = 3 mantissa bits -> 2^-(3+1) relative; smallest normal 2^-6, subnormal step 2^-6 * 2^-3 = 2^-9 -> 2^-10
#   e5m2: m = 2               -> 2^-3;            smallest normal 2^-14, subnormal step 2^-16       -> 2^-17
#   int8: steps of one scale  -> 0;               half a step                                       -> 1/2
BOUNDS = {"fp8_e4m3": (2.0 ** -4, 2.0 ** -10), "fp8_e5m2": (2.0 ** -3, 2.0 ** -17), "int8": (0.0, 0.5)}
MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}


def spread(shape, seed=0):
    """Values whose magnitudes span 2^-20 .. 2^8 (log-uniform), both signs, some exact zeros: every binade."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(shape).uniform_(-20, 8, generator=g))
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    x = mag * sign
    x.view(-1)[:: 17] = 0.0
    return x


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_the_stated_bounds_are_the_formats(dtype):
    assert quant.round_trip_bound(dtype) == BOUNDS[dtype]
    assert quant.max_representable(dtype) == MAX[dtype]


@pytest.mark.parametrize("granularity", quant.SCALE_GRANULARITIES)
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_round_trip_stays_inside_the_formats_bound(dtype, granularity):
    x = spread((64, 4, 32), seed=1)                                         # [T, Hkv, D]
    if granularity == "per_tensor":
        scale = quant.calibrate_scale(x, dtype)
        s = torch.tensor(scale)
    else:
        scale = quant.token_head_scales(x, dtype)                           # [T, Hkv]
        s = scale[..., None]
    q = quant.quantize(x, dtype, scale)
    assert q.dtype == quant.storage_dtype(dtype) and q.shape == x.shape
    back = quant.dequantize(q, scale, torch.float64)
    rel, ab = BOUNDS[dtype]
    err = (back - x.double()).abs()
    bound = torch.maximum(rel * x.double().abs(), ab * s.double()) * (1 + 1e-6) + 1e-30
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3g}"
    assert bool((back[x == 0] == 0).all())                                  # zeros are exact
    assert float(err.max()) > 0                                             # and it is a lossy format


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_values_past_the_range_are_clamped_never_nan_or_inf(dtype):
    x = torch.tensor([1e6, -1e6, float("inf"), -float("inf"), 3.0, MAX[dtype] * 1.01])
    back = quant.dequantize(quant.quantize(x, dtype, 1.0), 1.0, torch.float32)
    assert bool(torch.isfinite(back).all())
    assert back.tolist()[:4] == [MAX[dtype], -MAX[dtype], MAX[dtype], -MAX[dtype]]
    assert back[4] == 3.0 and back[5] == MAX[dtype]
    # and under a scale: the clamp is at max * scale
    assert quant.dequantize(quant.quantize(x[:1], dtype, 0.5), 0.5, torch.float32).item() == MAX[dtype] * 0.5


def test_e4m3_saturates_at_448():
    x = torch.tensor([448.0, 449.0, 464.0, 500.0, 1e4])
    assert quant.quantize(x, "fp8_e4m3", 1.0).float().tolist() == [448.0] * 5


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -float("inf"), True, "1.0",
                                 torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, float("nan")]]),
                                 torch.tensor([[-2.0, 1.0]]), torch.tensor([[1, 2]])])
def test_a_bad_scale_is_refused(bad):
    x = torch.ones(1, 2, 4)
    with pytest.raises(ValueError, match="scale"):
        quant.quantize(x, "int8", bad)
    with pytest.raises(ValueError, match="scale"):
        quant.dequantize(torch.ones(1, 2, 4, dtype=torch.int8), bad, torch.float32)


def test_a_scale_of_the_wrong_shape_or_a_missing_one_is_refused():
    x = torch.ones(3, 2, 4)
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        quant.quantize(x, "fp8_e4m3", torch.ones(2, 3))
    with pytest.raises(ValueError, match="needs a scale"):
        quant.quantize(x, "fp8_e4m3", None)
    with pytest.raises(ValueError, match="scale=None"):
        quant.quantize(x, "auto", 1.0)
    assert quant.quantize(x, "auto", None) is x
    assert quant.dequantize(x, None, torch.float64).dtype == torch.float64


def test_an_unknown_kv_cache_dtype_lists_the_choices():
    for bad in ("fp16", "e4m3", None, 8):
        with pytest.raises(ValueError, match=r"kv_cache_dtype.*'auto', 'fp8_e4m3', 'fp8_e5m2', 'int8'"):
            quant.quantize(torch.ones(2, 2), bad, 1.0)
    assert quant.check_kv_cache_dtype("fp8") == "fp8_e4m3"                # vLLM's alias
    with pytest.raises(ValueError, match="'per_tensor', 'per_token_head'"):
        quant.check_scale_granularity("per_channel")


def test_fp8_without_its_torch_dtype_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch, "float8_e5m2")
    with pytest.raises(ValueError, match=r"fp8_e5m2.*torch\.float8_e5m2.*does not have"):
        quant.storage_dtype("fp8_e5m2")
    assert quant.storage_dtype("int8") == torch.int8                      # the others still work


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_per_token_head_keeps_what_a_scale_of_one_loses(dtype):
    """Small values (K/V entries of 1e-4 .. 1e-3) at per-tensor scale 1.0: e4m3 flushes them to zero or one
    subnormal step (2^-9 ~ 0.002) and int8 to zero; one scale per (token, head) keeps each to its format's relative
    precision. Large values (1e6 .. 1e7) at scale 1.0 clip at the range's edge (448, 57344, 127)."""
    g = torch.Generator().manual_seed(2)
    sign = torch.randint(0, 2, (16, 2, 32), generator=g) * 2 - 1
    small = torch.empty(16, 2, 32).uniform_(1e-4, 1e-3, generator=g) * sign

    def rel_err(x, scale):
        back = quant.dequantize(quant.quantize(x, dtype, scale), scale, torch.float64)
        return float(((back - x.double()).abs() / x.double().abs()).median())

    ones, per = rel_err(small, 1.0), rel_err(small, quant.token_head_scales(small, dtype))
    good = BOUNDS[dtype][0] if dtype != "int8" else 0.5 / 127 * 10   # int8: half a step of amax / 127, at amax / 10
    assert per <= good, per
    if dtype == "fp8_e5m2":                  # its normals reach down to 2^-14 ~ 6e-5: scale 1.0 still holds 1e-4
        assert ones <= BOUNDS[dtype][0]
    else:
        assert ones > 0.5 and ones > 10 * per, (ones, per)
    big = small * 1e10
    assert rel_err(big, 1.0) > 0.9 and rel_err(big, quant.token_head_scales(big, dtype)) <= good


def test_calibration_maps_the_batch_amax_onto_the_range_edge():
    x = torch.tensor([[0.5, -3.5], [1.0, 2.0]])
    assert quant.calibrate_scale(x, "fp8_e4m3") == 3.5 / 448
    assert quant.calibrate_scale(torch.zeros(3), "int8") == 1.0                  # zeros: any scale, 1.0
    assert quant.token_head_scales(torch.zeros(2, 1, 4), "int8").tolist() == [[1.0], [1.0]]
    with pytest.raises(ValueError, match="non-finite"):
        quant.calibrate_scale(torch.tensor([1.0, float("inf")]), "int8")
    with pytest.raises(ValueError, match="'auto' quantizes nothing"):
        quant.calibrate_scale(x, "auto")


def test_bytes_per_token_counts_the_scales_share():
    L, Hkv, D = 12, 12, 64                                                # GPT-2 small's shapes
    fp32 = quant.bytes_per_token(L, Hkv, D)
    assert fp32 == 2 * L * Hkv * D * 4
    assert quant.bytes_per_token(L, Hkv, D, "auto", torch.bfloat16) == fp32 // 2
    for dtype in QUANTIZED:
        assert quant.bytes_per_token(L, Hkv, D, dtype) == fp32 // 4                           # per tensor: none
        per = quant.bytes_per_token(L, Hkv, D, dtype, scale_granularity="per_token_head")
        assert per == 2 * L * Hkv * (D + 4)                                                    # + one fp32 each
        assert math.isclose(fp32 / per, 4 * D / (D + 4))                   # 3.76x at D = 64: 4x less the scales
    assert quant.bytes_per_token(L, Hkv, D, "auto", scale_granularity="per_token_head") == fp32   # auto: no scales
    with pytest.raises(ValueError, match="head_dim"):
        quant.bytes_per_token(L, Hkv, 0)
