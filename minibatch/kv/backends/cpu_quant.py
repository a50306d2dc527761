"""The C++ operator's store, and its quantized KV blocks (``kv/quant.py``): how it reads and writes fp8 and int8.

``cpu_kernel.SOURCE`` begins with this module's ``SOURCE``, a fragment of C++ in four parts:

* **Decode** (``LoadInt8``, ``LoadE4M3``, ``LoadE5M2``; ``Plain<T>`` for an unquantized cache): one stored byte
  -> a float, branch-free integer arithmetic that GCC vectorises. The kernel decodes one block at a time
  (``decode_block``: [block_size, D] floats, a scratch that stays in L1, shared by all the work item's query
  rows, a per-(token, head) scale folded in) and never makes a dequantized copy of the context. An fp8 number of e exponent and m mantissa
  bits (bias b) is, for a nonzero exponent field, a float32 whose exponent field is moved up by 127 - b and
  whose mantissa is the m bits shifted to the top: ``bits = (x & 0x7F) << (23 - m) + ((127 - b) << 23)``; with
  a zero exponent field it is a subnormal, ``mantissa * 2^(1 - b - m)``, computed as an int-to-float product
  (not as a float32 denormal, so a flush-to-zero mode cannot change it); the sign bit goes to bit 31 (so -0
  stays -0). That is torch's decode for every finite code (``tests/test_kv_quant_cpu.py`` checks all of
  them); the codes past the range (e4m3's NaN 0x7F, e5m2's inf and NaN) read as large finite numbers, and the
  store never writes them, since it clamps first.
* **Encode** (``store_quantized``, vLLM's ``cpu_attn_reshape_and_cache`` with its kv_cache_dtype): each row
  [Hkv, D] quantized on its way into its slot exactly as the torch store (``loop._quantize_rows``): per tensor
  with the layer's one scale; per (token, head) with the row's own amax over D / max (1.0 where all zero),
  written into the scale cache [num_blocks, block_size, Hkv] at the row's slot. Then ``y = x / scale``
  clamped to +-max and cast: int8 rounded half to even (``std::nearbyint``, as ``torch.round``), fp8 through
  c10's own conversion (``c10::Float8_e4m3fn(float)``, round to nearest even), the one torch's ``.to()``
  uses, so the bytes are torch's bit for bit, subnormals and signed zero included.

* **The store** ``minibatch::store_kv_cpu`` (``cpu.store``): each token's K and V row to its slot, -1 skipped;
  an unquantized row is one memcpy, a quantized cache's goes through the encode above.

The scales reach the kernel as ``scale_mode`` (0: none, 1: per tensor, 2: per token and head). Per tensor, the
K scale is folded into the scaled query and the V scale into the final 1/l: no multiply per element.

* **Through a half** (``fp8x16_through_half``, ``fp8x8_through_half``), where the CPU converts halves in
  hardware (x86's F16C, which every AVX2 CPU has): e5m2 *is* a half's top byte (5 exponent bits, bias 15), and
  e4m3's 7 magnitude bits shifted up by 7 are a half whose exponent field holds e4m3's, so the half reads the value
  / 2^(15 - 7). So 16 codes take a widening load, three integer ops on 16-bit lanes, one ``vcvtph2ps`` and one
  multiply (the block's scale, times 2^8 for e4m3): the same floats, bit for bit, as the scalar decode (both are
  exact, and the factors are powers of two), which ``decode_block`` still runs for a row's tail past a multiple of
  8 and on CPUs without F16C. e5m2's inf and NaN codes are moved one binade down, finite (the store never writes
  them).

What it costs (``python -m minibatch.bench attention --kv-dtypes``, batch-16 decode, one thread, a busy 2-core
Xeon with AVX-512): int8 reads a quarter of fp32's bytes and decodes in two vector instructions, 0.80x fp32's time
at context 1024 and 0.69x at 2048. fp8 through a half: 0.94x (0.94-0.99) at 1024, 0.82x (0.79-0.83) at 2048; the
scalar decode it replaced took about a dozen vector instructions per 16 values and 1.55x fp32's time. With
grouped-query heads the one decode per block serves all G heads.
"""
from __future__ import annotations

SOURCE = r"""
// Quantized KV blocks for minibatch's CPU operator (see cpu_quant.py).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#if defined(__F16C__) && defined(__SSE4_1__)
#include <immintrin.h>
#endif

namespace {

inline float bits_float(int32_t u) { return __builtin_bit_cast(float, u); }
inline int32_t float_bits(float f) { return __builtin_bit_cast(int32_t, f); }

// Decode: a Loader reads element d of a stored row as acc_t (cache_t: the stored element's C++ type).
template <typename T> struct Plain {                 // an unquantized cache: the model's dtype
  using cache_t = T;
  template <typename acc_t> static inline acc_t at(const T* p, int d) { return static_cast<acc_t>(p[d]); }
};
struct LoadInt8 {                                    // symmetric int8: the step count itself
  using cache_t = int8_t;
  template <typename acc_t> static inline acc_t at(const int8_t* p, int d) { return static_cast<acc_t>(p[d]); }
};
// fp8 with M mantissa bits and exponent bias BIAS (e4m3: 3, 7; e5m2: 2, 15), as the module docstring derives
template <int M, int BIAS> struct LoadFp8 {
  using cache_t = uint8_t;
  static constexpr int mantissa = M;
  template <typename acc_t> static inline acc_t at(const uint8_t* p, int d) {
    const int32_t x = p[d], mag = x & 0x7F;
    const int32_t normal = (mag << (23 - M)) + ((127 - BIAS) << 23);
    const int32_t sub = float_bits(static_cast<float>(mag) * bits_float((128 - BIAS - M) << 23));   // * 2^(1-b-m)
    const int32_t is_normal = -static_cast<int32_t>(mag >= (1 << M));   // all ones: the exponent field is not 0
    // a blend of bits, not a branch or a select of floats: GCC vectorises this loop only so
    return static_cast<acc_t>(bits_float((normal & is_normal) | (sub & ~is_normal) | ((x & 0x80) << 24)));
  }
};
using LoadE4M3 = LoadFp8<3, 7>;
using LoadE5M2 = LoadFp8<2, 15>;

#if defined(__F16C__) && defined(__SSE4_1__)
// Through a half: where the CPU converts halves in hardware (F16C), 8 fp8 codes at p become 8 half bit patterns
// in integer lanes, one vcvtph2ps makes them floats, and one multiply applies mul. e5m2 is a half's top byte (the
// same 5 exponent bits and bias 15); its inf/NaN codes, which the clamping store never writes, are moved down a
// binade so that they read finite. e4m3's 4 exponent bits sit in the half's exponent field as they are, so the
// half is the value / 2^(15 - 7), and the caller's mul carries the 2^8.
template <int M> inline __m256 fp8x8_through_half(const uint8_t* p, __m256 mul) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));   // 8 x u16
  __m128i h;
  if constexpr (M == 2) {
    h = _mm_slli_epi16(x, 8);
    const __m128i top = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7C00)), _mm_set1_epi16(0x7C00));
    h = _mm_sub_epi16(h, _mm_and_si128(top, _mm_set1_epi16(0x0400)));
  } else {
    h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7),
                     _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8));
  }
  return _mm256_mul_ps(_mm256_cvtph_ps(h), mul);
}
#if defined(__AVX512F__) && defined(__AVX2__)
template <int M> inline __m512 fp8x16_through_half(const uint8_t* p, __m512 mul) {           // the same, 16 wide
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));   // 16 x u16
  __m256i h;
  if constexpr (M == 2) {
    h = _mm256_slli_epi16(x, 8);
    const __m256i top = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7C00)), _mm256_set1_epi16(0x7C00));
    h = _mm256_sub_epi16(h, _mm256_and_si256(top, _mm256_set1_epi16(0x0400)));
  } else {
    h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7),
                        _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
  }
  return _mm512_mul_ps(_mm512_cvtph_ps(h), mul);
}
#endif
template <typename Ld> struct IsFp8 : std::false_type {};
template <int M, int B> struct IsFp8<LoadFp8<M, B>> : std::true_type {};
#endif

// One block's nk rows [D] (row t at src + t * stride) decoded into buf [nk, D] in acc_t by the Loader
// (cpu_quant.py), times row t's own scale where there is one per (token, head) (scale + t * Hkv).
template <typename Ld, typename acc_t>
void decode_block(const typename Ld::cache_t* src, int64_t stride, const float* scale, int Hkv, int nk, int D,
                  acc_t* buf) {
#if defined(__F16C__) && defined(__SSE4_1__)
  if constexpr (IsFp8<Ld>::value && std::is_same_v<acc_t, float>) {     // the same floats, bit for bit, faster
    constexpr float to_value = Ld::mantissa == 3 ? 256.0f : 1.0f;
    for (int t = 0; t < nk; ++t) {
      const float st = scale ? scale[t * Hkv] : 1.0f;
      const __m256 mul = _mm256_set1_ps(st * to_value);
      const uint8_t* row = src + t * stride;
      int d = 0;
#if defined(__AVX512F__) && defined(__AVX2__)
      const __m512 mul16 = _mm512_set1_ps(st * to_value);
      for (; d + 16 <= D; d += 16) _mm512_storeu_ps(buf + t * D + d, fp8x16_through_half<Ld::mantissa>(row + d, mul16));
#endif
      for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + t * D + d, fp8x8_through_half<Ld::mantissa>(row + d, mul));
      for (; d < D; ++d) buf[t * D + d] = Ld::template at<float>(row, d) * st;
    }
    return;
  }
#endif
  for (int t = 0; t < nk; ++t) {
    const acc_t st = scale ? static_cast<acc_t>(scale[t * Hkv]) : 1;
    const typename Ld::cache_t* row = src + t * stride;
#pragma omp simd
    for (int d = 0; d < D; ++d) buf[t * D + d] = Ld::template at<acc_t>(row, d) * st;
  }
}

// f(Loader{}) for a quantized cache's dtype; anything else is refused here, once.
template <typename F> void dispatch_quantized(at::ScalarType t, const char* who, F&& f) {
  switch (t) {
    case at::kChar: f(LoadInt8{}); break;
    case at::kFloat8_e4m3fn: f(LoadE4M3{}); break;
    case at::kFloat8_e5m2: f(LoadE5M2{}); break;
    default: TORCH_CHECK(false, who, ": a quantized cache is int8, float8_e4m3fn or float8_e5m2, got ", t);
  }
}

// Encode y = x / scale, already clamped to +-max, into one stored element.
struct EncInt8 {
  using cache_t = int8_t;
  static constexpr float max = 127.0f;
  static inline int8_t enc(float y) { return static_cast<int8_t>(std::nearbyint(y)); }   // half to even
};
struct EncE4M3 {
  using cache_t = uint8_t;
  static constexpr float max = 448.0f;
  static inline uint8_t enc(float y) { return c10::Float8_e4m3fn(y).x; }
};
struct EncE5M2 {
  using cache_t = uint8_t;
  static constexpr float max = 57344.0f;
  static inline uint8_t enc(float y) { return c10::Float8_e5m2(y).x; }
};

// Row t of x [T, Hkv, D] -> slot[t] of cache [slots, Hkv, D]; scale: one float (per tensor) or the scale cache
// [slots, Hkv] (per token and head), which receives each row's amax / max.
template <typename in_t, typename Enc>
void quantize_rows(const in_t* x, typename Enc::cache_t* cache, float* scale, bool per_token, const int64_t* slot,
                   int64_t T, int Hkv, int D) {
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0) continue;
    for (int h = 0; h < Hkv; ++h) {
      const in_t* src = x + (t * Hkv + h) * D;
      typename Enc::cache_t* dst = cache + (slot[t] * Hkv + h) * D;
      float s = scale[0];
      if (per_token) {                             // quant._token_head_scales: amax over D / max, 1 where all 0
        float amax = 0;
        for (int d = 0; d < D; ++d) amax = std::max(amax, std::abs(static_cast<float>(src[d])));
        s = amax > 0 ? amax / Enc::max : 1.0f;
        scale[slot[t] * Hkv + h] = s;
      }
      for (int d = 0; d < D; ++d)
        dst[d] = Enc::enc(std::min(std::max(static_cast<float>(src[d]) / s, -Enc::max), Enc::max));
    }
  }
}

void store_one(const at::Tensor& x, at::Tensor& cache, at::Tensor& scale, const int64_t* slot) {
  const int64_t T = x.size(0);
  const int Hkv = x.size(1), D = x.size(2);
  const bool per_token = scale.numel() != 1;
  float* s = scale.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "store_kv_cpu", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    switch (cache.scalar_type()) {
      case at::kChar:
        quantize_rows<scalar_t, EncInt8>(src, static_cast<int8_t*>(cache.data_ptr()), s, per_token, slot, T, Hkv, D);
        break;
      case at::kFloat8_e4m3fn:
        quantize_rows<scalar_t, EncE4M3>(src, static_cast<uint8_t*>(cache.data_ptr()), s, per_token, slot, T, Hkv, D);
        break;
      case at::kFloat8_e5m2:
        quantize_rows<scalar_t, EncE5M2>(src, static_cast<uint8_t*>(cache.data_ptr()), s, per_token, slot, T, Hkv, D);
        break;
      default: TORCH_CHECK(false, "store_kv_cpu: scales go with an int8 or fp8 cache, not ", cache.scalar_type());
    }
  });
}

// The quantizing store: key, value [T, Hkv, D] (any float dtype) into an int8 / fp8 cache, with their scales.
void store_quantized(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                     const at::Tensor& slot_mapping, at::Tensor& k_scale, at::Tensor& v_scale) {
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  for (const at::Tensor* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() &&
                (s->numel() == 1 || s->numel() == slots * key_cache.size(2)),
                "store_kv_cpu: a scale is one float32 (per tensor) or [num_blocks, block_size, Hkv] (per token, head)");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(slot[t] < slots, "store_kv_cpu: slot ", slot[t], " is past the cache's ", slots, " slots");
  store_one(key.contiguous(), key_cache, k_scale, slot);
  store_one(value.contiguous(), value_cache, v_scale, slot);
}

// The store (vLLM's cpu_attn_reshape_and_cache): row t's K and V [Hkv, D] go to slot slot_mapping[t], i.e. block
// slot / block_size, offset slot % block_size; slot -1 (a padding row) writes nowhere. One copy per row, in place:
// torch's index_copy_ needs the padding rows masked first, four small operators per layer instead of this loop.
void store_kv_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                  const at::Tensor& slot_mapping, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key_cache.dim() == 4 &&
              key_cache.sizes() == value_cache.sizes() && key.size(1) == key_cache.size(2) &&
              key.size(2) == key_cache.size(3), "store_kv_cpu: want key, value [T, Hkv, D] and caches "
              "[num_blocks, block_size, Hkv, D]");
  const bool quantized = k_scale.has_value() && k_scale->defined() && v_scale.has_value() && v_scale->defined();
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
              slot_mapping.is_contiguous() && slot_mapping.numel() == key.size(0) &&
              key_cache.scalar_type() == value_cache.scalar_type() && key.scalar_type() == value.scalar_type() &&
              (quantized || key.scalar_type() == key_cache.scalar_type()),
              "store_kv_cpu: want contiguous caches, an int64 slot_mapping [T] and one dtype (or a quantized cache "
              "and its scales)");
  if (quantized) return store_quantized(key, value, key_cache, value_cache, slot_mapping, *k_scale, *v_scale);
  const at::Tensor k = key.contiguous(), v = value.contiguous();
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), bytes = row * k.element_size();
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const char *ks = static_cast<const char*>(k.data_ptr()), *vs = static_cast<const char*>(v.data_ptr());
  char *kd = static_cast<char*>(key_cache.data_ptr()), *vd = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0) continue;
    TORCH_CHECK(slot[t] < slots, "store_kv_cpu: slot ", slot[t], " is past the cache's ", slots, " slots");
    std::memcpy(kd + slot[t] * bytes, ks + t * bytes, bytes);
    std::memcpy(vd + slot[t] * bytes, vs + t * bytes, bytes);
  }
}

}  // namespace
"""
