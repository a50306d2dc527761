"""Backend "cpu"'s C++ operator: paged attention that reads the KV blocks where they lie, its source and its build.

Why. The "batched" backend copies every row's whole context out of the paged pool (``index_select`` into
[G, L, Hkv, D]) before ``scaled_dot_product_attention`` reads the copy again: on the CPU that copy was 38% of a
batch-16 decode step (issue 35). Decode attention reads each K/V byte once and does about 2 FLOPs with it, so
the copy, which writes every byte again and reads it back, triples the traffic of the step's most memory-bound
part. This operator reads each K/V row once,
in place, through the block table.

The ingredients are those of vLLM's CPU attention (``csrc/cpu/cpu_attn.cpp``, and ``csrc/cpu/attention.cpp``
before it), kept small here, without its ISA-specific tiles:

* one C++ kernel, its **work items** the pairs (sequence b, KV head kvh), spread over OpenMP threads
  (``#pragma omp parallel for collapse(2)``, as many threads as ``torch.get_num_threads()``);
* an item walks sequence b's **block table** block by block: position p lives in physical block
  ``block_tables[b, p // block_size]`` at offset ``p % block_size`` (``kv_cache.py``), read where it lies;
* the G = H / Hkv **query heads of one KV head** (grouped-query attention) are handled in the same item, so
  a K/V row, once in cache, serves all of them;
* an **online softmax** (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): per query row a
  running max m and sum l, and an fp32 accumulator rescaled by exp(m_old - m_new) when m grows, one
  block at a time; no [L] row of scores and no gathered copy is ever made;
* **causal with the context offset**: query i of sequence b sits at position ``seq_lens[b] - q_len_b + i``
  and sees positions 0..that; with a token tree, also only the nodes its ``tree_bits`` row names
  (``loop.paged_attention_loop`` reads the same mask the slow way). So one kernel serves decode, a
  prefill or a later chunk of one, a verification chain and a token tree.

Shapes (``cpu.paged_attention_cpu`` checks them; the engine's path trusts ``AttentionMetadata.build``):

    query           [T, H, D]                         fp32, bf16 (fp16, fp64), D contiguous
    key_cache       [num_blocks, block_size, Hkv, D]  one layer's keys (``KVCache.key_cache(l)``), contiguous:
    value_cache     [num_blocks, block_size, Hkv, D]  query's dtype, or int8 / fp8 (e4m3, e5m2) with scales
    block_tables    [B, max_blocks] int32             -1 past a sequence's blocks (never read)
    seq_lens        [B] int32                         context including this step's tokens
    query_start_loc [B+1] int32                       sequence b's rows are qsl[b] : qsl[b+1]
    tree_bits       [T] int64 or None                 bit j of row t: it sees this step's token j; -1: causal
    k_scale, v_scale [1] or [num_blocks, block_size, Hkv] float32, or None: a quantized cache's (kv/quant.py),
                     dequantized in the inner loops (``cpu_quant.py``), never as a copy of the context
    -> out          [T, H, D], query's dtype          accumulated in fp32 (fp64 for fp64)

What it costs. At decode each K/V byte is read once, in place: on the shipped target at batch 16 the
attention call is several times faster than "batched" (``python -m minibatch.bench attention --cpu``). A
long prefill chunk is another matter: here every (query, key) pair is a dot product, an exp and an axpy,
while "batched"'s ``scaled_dot_product_attention`` tiles the queries against the keys as matrix products, so
a 512-token prefill's attention is two to three times slower here. vLLM's kernel tiles that case too (AMX or
AVX-512 micro-kernels); this one stays the readable version.

The build. At first use ``torch.utils.cpp_extension.load_inline`` compiles ``SOURCE`` with ``-O3 -fopenmp``
(and ``-march=native`` where the compiler accepts it) into ``~/.cache/minibatch/torch_extensions``
(``TORCH_EXTENSIONS_DIR`` overrides it; ``CXX`` names the compiler); a later process loads the cached
library. The operator is registered with ``torch.library`` as ``minibatch::paged_attention_cpu``, with a fake
implementation (the output's shape and dtype) so that ``torch.compile`` can trace around it. Where there is
no compiler, no OpenMP or the build fails, ``load()`` says so in one warning and returns None, and
``backends.get("cpu")`` hands out "batched" instead. The Python entry points, and the
split of a step between this operator and SDPA, are ``cpu.py``'s.

The same library holds the backend's store, ``minibatch::store_kv_cpu`` (``cpu.store``; vLLM's
``cpu_attn_reshape_and_cache``; its source and the quantized blocks' decode and encode are ``cpu_quant.py``'s):
each token's K and V row copied to its slot, -1 skipped, in one loop; into a quantized cache each row is
quantized on the way, bit for bit as the torch store. Its schema
marks the caches written (``Tensor(a!)``), so a compiled decode step (``cuda_graph_mode="compile"``) calls it in
place rather than copying the cache.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from minibatch.kv.backends import cpu_quant

SOURCE = cpu_quant.SOURCE + r"""
// minibatch::paged_attention_cpu: paged attention reading the KV blocks in place (see cpu_kernel.py).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// q . k over D, in acc_t (fp32 for bf16/fp32); the pragma lets the compiler vectorise the reduction.
template <typename acc_t>
inline acc_t dot(const acc_t* q, const acc_t* k, int D) {
  acc_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < D; ++d) s += q[d] * k[d];
  return s;
}

template <typename scalar_t, typename Ld>              // Ld: how a stored element reads (Plain<scalar_t>, int8, fp8)
void paged_attention_kernel(
    const scalar_t* q, int64_t q_row, int64_t q_head,  // query [T, H, D]: strides of a row and of a head
    const typename Ld::cache_t* k_cache,               // [num_blocks, block_size, Hkv, D], contiguous
    const typename Ld::cache_t* v_cache,
    const int* block_tables, int W,                    // [B, W]
    const int* seq_lens, const int* query_start_loc,   // [B], [B + 1]
    const int64_t* tree_bits,                          // [T], or nullptr: plain causal
    scalar_t* out,                                     // [T, H, D], contiguous
    int B, int H, int Hkv, int D, int bs, double scale,
    const float* k_scale, const float* v_scale,        // scale_mode 1: [1]; 2: [num_blocks, block_size, Hkv]
    int scale_mode) {                                  // 0: no scales (an unquantized cache)
  using acc_t = at::opmath_type<scalar_t>;             // float for bf16 and fp32
  using cache_t = typename Ld::cache_t;
  const bool per_token = scale_mode == 2;
  constexpr bool decode = !std::is_same<cache_t, acc_t>::value;   // fp32 (fp64) blocks are read as they lie
  // per tensor: K's scale folded into the scaled query, V's into the final 1 / l (no multiply per element)
  const acc_t k_mul = scale_mode == 1 ? k_scale[0] : 1, v_mul = scale_mode == 1 ? v_scale[0] : 1;
  const acc_t NEG_INF = -std::numeric_limits<acc_t>::infinity();
  const acc_t sc = static_cast<acc_t>(scale);
  const int G = H / Hkv;                               // query heads per KV head (GQA)
  const int64_t pos_stride = (int64_t)Hkv * D;         // from one position to the next inside a block

  // Work item (b, kvh): sequence b's n queries x the G query heads that read KV head kvh.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int b = 0; b < B; ++b) {
    for (int kvh = 0; kvh < Hkv; ++kvh) {
      const int L = seq_lens[b];                       // context, this step's tokens included
      const int s0 = query_start_loc[b], n = query_start_loc[b + 1] - s0;
      const int ctx = L - n;                           // query i sits at position ctx + i
      const int R = n * G;                             // rows r = i * G + g: query i, head kvh * G + g
      std::vector<acc_t> qs(R * D), acc(R * D, 0), m(R, NEG_INF), l(R, 0), s(bs);
      std::vector<acc_t> kbuf(decode ? bs * D : 0), vbuf(decode ? bs * D : 0);
      for (int i = 0; i < n; ++i)                      // the scaled queries, in acc_t: [R, D]
        for (int g = 0; g < G; ++g) {
          const scalar_t* qrow = q + (s0 + i) * q_row + (kvh * G + g) * q_head;
          for (int d = 0; d < D; ++d) qs[(i * G + g) * D + d] = static_cast<acc_t>(qrow[d]) * sc * k_mul;
        }

      for (int blk = 0; blk * bs < L; ++blk) {         // logical block blk: positions j0 .. j0 + nk - 1
        const int j0 = blk * bs, nk = std::min(bs, L - j0);
        const int64_t phys = block_tables[b * W + blk], base = phys * bs * pos_stride + kvh * D;
        // K row of position j0 + t: K + t * rs, [D]. A cache of another dtype than acc_t (bf16, int8, fp8) is
        // decoded one block at a time, once for all the item's rows (never the whole context)
        const acc_t *K = reinterpret_cast<const acc_t*>(k_cache + base), *V = reinterpret_cast<const acc_t*>(v_cache + base);
        int64_t rs = pos_stride;
        if (decode) {
          const int64_t sb = phys * bs * Hkv + kvh;    // per token: position j0 + t's scale at sb + t * Hkv
          decode_block<Ld>(k_cache + base, pos_stride, per_token ? k_scale + sb : nullptr, Hkv, nk, D, kbuf.data());
          decode_block<Ld>(v_cache + base, pos_stride, per_token ? v_scale + sb : nullptr, Hkv, nk, D, vbuf.data());
          K = kbuf.data(), V = vbuf.data(), rs = D;
        }
        for (int i = 0; i < n; ++i) {
          const int pos = ctx + i;
          if (pos < j0) continue;                      // causal: the whole block lies after query i
          const int64_t bits = tree_bits ? tree_bits[s0 + i] : -1;
          for (int g = 0; g < G; ++g) {
            const int r = i * G + g;
            acc_t* a = &acc[r * D];
            // 1) the block's scores [nk]: -inf where query i may not look (later, or not its tree ancestor)
            acc_t mx = NEG_INF;
            for (int t = 0; t < nk; ++t) {
              const int j = j0 + t, node = j - ctx;    // node >= 0: this step's token number node
              const bool seen = j <= pos && (node < 0 || ((bits >> std::min(node, 63)) & 1));
              s[t] = seen ? dot(&qs[r * D], K + t * rs, D) : NEG_INF;
              mx = std::max(mx, s[t]);
            }
            if (mx == NEG_INF) continue;
            // 2) online softmax: a larger max rescales what is summed so far (exp(-inf) = 0 the first time)
            const acc_t m_new = std::max(m[r], mx), corr = std::exp(m[r] - m_new);
            l[r] *= corr;
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] *= corr;
            // 3) acc += p_t * V_t, l += p_t
            for (int t = 0; t < nk; ++t) {
              if (s[t] == NEG_INF) continue;
              const acc_t p = std::exp(s[t] - m_new);
              const acc_t* v = V + t * rs;
              l[r] += p;
#pragma omp simd
              for (int d = 0; d < D; ++d) a[d] += p * v[d];
            }
            m[r] = m_new;
          }
        }
      }
      for (int i = 0; i < n; ++i)                      // out[s0 + i, kvh * G + g] = acc / l
        for (int g = 0; g < G; ++g) {
          const int r = i * G + g;
          const acc_t inv = l[r] > 0 ? v_mul / l[r] : 0;   // l = 0 only for a row with no context (padding)
          scalar_t* o = out + ((int64_t)(s0 + i) * H + kvh * G + g) * D;
          for (int d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[r * D + d] * inv);
        }
    }
  }
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start_loc, double scale,
                               const std::optional<at::Tensor>& tree_bits,
                               const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "paged_attention_cpu: want query [T, H, D] and caches [num_blocks, block_size, Hkv, D]");
  const int T = query.size(0), H = query.size(1), D = query.size(2);
  const int bs = key_cache.size(1), Hkv = key_cache.size(2), B = seq_lens.size(0);
  TORCH_CHECK(key_cache.size(3) == D && H % Hkv == 0,
              "paged_attention_cpu: want the same D in query and caches, and H a multiple of Hkv");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_attention_cpu: caches must be contiguous");
  const bool quantized = k_scale.has_value() && k_scale->defined();
  TORCH_CHECK(quantized == (v_scale.has_value() && v_scale->defined()) &&
              key_cache.scalar_type() == value_cache.scalar_type() &&
              (quantized || query.scalar_type() == key_cache.scalar_type()),
              "paged_attention_cpu: query and caches must share a dtype, or the caches be quantized with both scales");
  int scale_mode = 0;                                  // see paged_attention_kernel
  if (quantized) {
    const int64_t rows = key_cache.size(0) * bs * Hkv;
    for (const at::Tensor* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && (s->numel() == 1 || s->numel() == rows),
                  "paged_attention_cpu: a scale is one float32 or [num_blocks, block_size, Hkv], contiguous");
    TORCH_CHECK(k_scale->numel() == v_scale->numel(), "paged_attention_cpu: k_scale and v_scale differ in shape");
    scale_mode = k_scale->numel() == 1 ? 1 : 2;
  }
  for (const at::Tensor* x : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(x->scalar_type() == at::kInt && x->is_contiguous(),
                "paged_attention_cpu: metadata must be contiguous int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && query_start_loc.size(0) == B + 1,
              "paged_attention_cpu: want block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1]");
  const bool tree = tree_bits.has_value() && tree_bits->defined();
  TORCH_CHECK(!tree || (tree_bits->scalar_type() == at::kLong && tree_bits->is_contiguous() && tree_bits->numel() == T),
              "paged_attention_cpu: tree_bits must be a contiguous int64 [T]");
  const at::Tensor q = query.stride(2) == 1 ? query : query.contiguous();   // rows and heads may be strided
  at::Tensor out = at::empty({T, H, D}, query.options());
  if (T == 0) return out;
  const float* ks = quantized ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = quantized ? v_scale->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    auto run = [&](auto loader) {                      // the kernel for this cache's Loader (cpu_quant.py)
      using Ld = decltype(loader);
      using cache_t = typename Ld::cache_t;
      paged_attention_kernel<scalar_t, Ld>(
          q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), static_cast<const cache_t*>(key_cache.data_ptr()),
          static_cast<const cache_t*>(value_cache.data_ptr()), block_tables.data_ptr<int>(), block_tables.size(1),
          seq_lens.data_ptr<int>(), query_start_loc.data_ptr<int>(), tree ? tree_bits->data_ptr<int64_t>() : nullptr,
          out.data_ptr<scalar_t>(), B, H, Hkv, D, bs, scale, ks, vs, scale_mode);
    };
    if (quantized) dispatch_quantized(key_cache.scalar_type(), "paged_attention_cpu", run);
    else run(Plain<scalar_t>{});
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minibatch, m) {
  m.def("paged_attention_cpu(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, Tensor? tree_bits=None, Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> Tensor");
  // (a!): the caches are written in place, which torch.compile must know to keep the write (and not copy them)
  // (per token and head the scale caches are written too)
  m.def("store_kv_cpu(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(minibatch, CPU, m) {
  m.impl("paged_attention_cpu", &paged_attention_cpu);
  m.impl("store_kv_cpu", &store_kv_cpu);
}
"""

_OP = None          # torch.ops.minibatch.paged_attention_cpu once built and loaded
_TRIED = False      # load() builds (or fails) once per process, and warns at most once


class Unavailable(RuntimeError):
    """Why the operator cannot be built here, in one line."""


def build_directory() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "minibatch" / "torch_extensions"
    return Path(root)


def _compiles(compiler: str, flags: list) -> bool:
    """Does ``compiler flags`` build a tiny OpenMP program? (-march=native and -fopenmp are probed this way.)"""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "probe.cpp")
        src.write_text("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        try:
            r = subprocess.run([compiler, *flags, str(src), "-o", str(Path(d, "probe"))],
                               capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
        return r.returncode == 0


def _cpu_signature() -> str:
    """A short hash of this CPU's feature flags: a library built with -march=native is only loaded on a CPU
    that has the instructions it was built for (a home directory may be shared between machines)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _build():
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise Unavailable(f"no C++ compiler: {compiler!r} not found (set CXX to one)")
    if not _compiles(compiler, ["-fopenmp"]):
        raise Unavailable(f"the compiler {compiler!r} does not build an OpenMP program (-fopenmp)")
    native = _compiles(compiler, ["-fopenmp", "-march=native"])
    cflags = ["-O3", "-fopenmp"] + (["-march=native"] if native else [])
    name = "minibatch_paged_attention_cpu" + (f"_{_cpu_signature()}" if native else "")
    directory = build_directory() / name
    directory.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load_inline
    try:
        load_inline(name, SOURCE, extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(directory),
                    is_python_module=False, no_implicit_headers=True)
    except Exception as e:                              # noqa: BLE001 - any build failure means "fall back"
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else type(e).__name__)
        raise Unavailable(f"the build failed ({why[:200]})") from e
    for op, fake in (("minibatch::paged_attention_cpu", _fake), ("minibatch::store_kv_cpu", _fake_store)):
        try:
            torch.library.register_fake(op)(fake)
        except RuntimeError:                            # registered already (the library was loaded before)
            pass
    return torch.ops.minibatch.paged_attention_cpu


def _fake(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, tree_bits=None,
          k_scale=None, v_scale=None):
    """What torch.compile sees: out has the query's shape and dtype (and is contiguous, as the kernel's is)."""
    return query.new_empty(query.shape)


def _fake_store(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    """The store returns nothing; its schema says it writes the caches (``Tensor(a!)``)."""
    return None


def load():
    """The operator ``torch.ops.minibatch.paged_attention_cpu``, compiled at the first call; or None where it cannot
    be built here, after one warning line that says why (the caller then uses "batched")."""
    global _OP, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            _OP = _build()
        except Unavailable as e:
            warnings.warn(f"attention backend 'cpu' is unavailable: {e}; using 'batched' instead",
                          RuntimeWarning, stacklevel=2)
    return _OP
