"""Quantized KV blocks through the Triton kernels (kernels/kv_quant.py; store_kv, paged_attention, paged_decode,
flash_decode; the "triton" backend), run by the interpreter on a CPU.

* fp8 travels as uint8 bits (sm_80 has no e4m3 in Triton): the kernels' decoder gives torch's value for every
  finite code, and the encoder torch's cast (round to nearest even) for every representable value, every tie
  between two neighbours and the floats either side of it, subnormals included;
* ``store_kv`` writes the torch store's bytes exactly (``backends/loop.py``'s ``store_kv_torch``), codes and
  per-(token, head) scales, for each format and granularity; values past the range are clamped to +-max (never
  NaN or inf) and a padding slot (-1) writes nothing;
* each attention kernel equals a float64 oracle run on the dequantized blocks (codes times their scales), with
  GQA, a context offset, a token tree for ``paged_attention``, split and unsplit decodes; slots no sequence owns
  hold poison (scales of 1e30), so a kernel that reads one fails;
* the engine's greedy output on "triton" equals "loop"'s on an int8 per-(token, head) cache;
* on a GPU (marker gpu), the compiled kernels: the store's bytes and each kernel against the oracle.
The AOT compile of the quantized variants for sm_80 / sm_90 is in tests/test_kernel_compile.py.
"""
import math

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need Triton, which installs on Linux only")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
from kernels import kv_quant  # noqa: E402
from minibatch.kv import quant  # noqa: E402
from minibatch.kv.backends.loop import store_kv_torch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = pytest.mark.interpreter              # CPU tensors through the interpreter (with CUDA, the gpu test runs them)

FP8 = [("fp8_e4m3", 3, 7), ("fp8_e5m2", 2, 15)]                 # (kv_cache_dtype, mantissa bits, bias)
MODES = [(d, g) for d in ("fp8_e4m3", "fp8_e5m2", "int8") for g in quant.SCALE_GRANULARITIES]
H, HKV, D, BS = 4, 2, 24, 4                                      # GQA (2 query heads a KV head), D not 2^k
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}                 # the kernel's own rounding, by the query's dtype


# ----------------------------------------------------------------------------- fp8 bits
@triton.jit
def _decode_kernel(b_ptr, out_ptr, n, MANT: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + o, kv_quant.decode_fp8(tl.load(b_ptr + o, mask=o < n, other=0), MANT, BIAS), mask=o < n)


@triton.jit
def _encode_kernel(y_ptr, out_ptr, n, MANT: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + o, kv_quant.encode_fp8(tl.load(y_ptr + o, mask=o < n, other=0.0), MANT, BIAS), mask=o < n)


def _run(kernel, x, out_dtype, mant, bias):
    out = torch.empty(x.shape, dtype=out_dtype)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), MANT=mant, BIAS=bias, BLOCK=1024)
    return out


@CPU
@pytest.mark.parametrize("name,mant,bias", FP8)
def test_fp8_bits_decode_and_encode_as_torch_casts(name, mant, bias):
    dtype = quant.storage_dtype(name)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).float()
    finite = torch.isfinite(values)                 # e4m3's NaN, e5m2's inf / NaN: never written (clamped first)
    assert torch.equal(_run(_decode_kernel, codes, torch.float32, mant, bias)[finite], values[finite])
    grid = values[finite].unique()                  # every finite value, sorted; -0 and 0 are one
    ties = (grid[1:] + grid[:-1]) / 2               # exact in float32: two more bits than the format has
    inf = torch.tensor(float("inf"))
    y = torch.cat([grid, ties, torch.nextafter(ties, inf), torch.nextafter(ties, -inf),
                   torch.tensor([-0.0, 2.0 ** -30, -(2.0 ** -30)]),
                   torch.empty(4000).uniform_(-1, 1, generator=torch.Generator().manual_seed(0))
                   * torch.logspace(-8, math.log10(grid.max()), 4000).float()]).clamp(grid.min(), grid.max())
    got = _run(_encode_kernel, y, torch.uint8, mant, bias)
    want = y.to(dtype).view(torch.uint8)
    assert torch.equal(got, want), f"{name}: {y[got != want][:4].tolist()} -> {got[got != want][:4].tolist()}, " \
                                   f"torch {want[got != want][:4].tolist()}"


# ----------------------------------------------------------------------------- the store
def _store_inputs(name, granularity, T=11, N=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(T, HKV, D, generator=g) * torch.logspace(-7, 2, T)[:, None, None]   # subnormal codes, too
    value = torch.randn(T, HKV, D, generator=g) * 3
    key[0, 0] = 0.0                                  # an all-zero head: scale 1.0
    key[1, 1, :3] = torch.tensor([1e9, -1e9, 5.0])  # past the range at any per-tensor scale: clamped
    slots = torch.randperm(N * BS, generator=g)[:T]
    slots[4] = -1                                    # a padding row: stored nowhere
    dtype = quant.storage_dtype(name)
    if granularity == "per_tensor":
        scales = [torch.tensor([0.37]), torch.tensor([1.0])]            # 1.0: the clipping scale, for V
    else:
        scales = [torch.full((N, BS, HKV), 7.0) for _ in range(2)]      # unwritten slots keep 7.0
    caches = [torch.zeros(N, BS, HKV, D, dtype=dtype) for _ in range(2)]
    return key, value, caches, slots, scales


@CPU
@pytest.mark.parametrize("name,granularity", MODES)
def test_store_kv_writes_the_torch_stores_bytes(name, granularity):
    key, value, (kc, vc), slots, (ks, vs) = _store_inputs(name, granularity)
    kernels.store_kv(key, value, kc, vc, slots, k_scale=ks, v_scale=vs)
    key2, value2, (kc2, vc2), slots2, (ks2, vs2) = _store_inputs(name, granularity)
    store_kv_torch(key2, value2, kc2, vc2, slots2, k_scale=ks2, v_scale=vs2)
    for got, want in ((kc, kc2), (vc, vc2), (ks, ks2), (vs, vs2)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    dq = quant.dequantize(kc, ks if ks.numel() == 1 else ks, torch.float32)
    assert torch.isfinite(dq).all()                                          # clamped, never NaN or inf
    m = quant.max_representable(name)
    if granularity == "per_tensor":
        slot = int(slots[1])
        row = kc.view(-1, HKV, D)[slot, 1, :2].float()
        assert row.tolist() == [m, -m], "values past the range are stored as +-max"
    written = torch.zeros(kc.shape[0] * BS, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not kc.view(-1, HKV, D)[~written].float().any(), "a padding row (-1) or another slot was written"
    if granularity == "per_token_head":
        assert (ks.view(-1, HKV)[~written] == 7.0).all() and (ks.view(-1, HKV)[written] != 7.0).all()
        assert ks.view(-1, HKV)[int(slots[0]), 0] == 1.0                     # the all-zero head


@CPU
def test_store_kv_refuses_a_quantized_cache_without_scales():
    key, value, (kc, vc), slots, (ks, vs) = _store_inputs("int8", "per_tensor")
    with pytest.raises(TypeError, match="k_scale"):
        kernels.store_kv(key, value, kc, vc, slots)
    with pytest.raises(ValueError, match="positive and finite"):
        kernels.store_kv(key, value, kc, vc, slots, k_scale=torch.tensor([0.0]), v_scale=vs)
    with pytest.raises(TypeError, match="quantized cache"):
        kernels.store_kv(key, value, key.new_zeros(6, BS, HKV, D), key.new_zeros(6, BS, HKV, D), slots,
                         k_scale=ks, v_scale=vs)


# ----------------------------------------------------------------------------- attention
def make_batch(name, granularity, q_lens, seq_lens, dtype=torch.float32, seed=0, width=None):
    """A quantized pool filled by the torch store through shuffled block tables; the slots no sequence owns hold
    poison: scales of 1e30 (per token-head) and a large code. -> dict of the kernels' arguments and the oracle's."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-L // BS) for L in seq_lens]
    N = 2 * sum(need) + 3
    perm = torch.randperm(N, generator=g)
    width = width or max(need) + 1
    tables = torch.full((len(seq_lens), width), int(perm[-1]), dtype=torch.int32)   # padding: an unowned block
    sdt = quant.storage_dtype(name)
    kc, vc = (torch.full((N, BS, HKV, D), 0x7E, dtype=torch.uint8).view(sdt) if sdt != torch.int8 else
              torch.full((N, BS, HKV, D), 127, dtype=torch.int8) for _ in range(2))
    if granularity == "per_tensor":
        ks, vs = (torch.tensor([quant.calibrate_scale(torch.randn(64, generator=g) * a, name)]) for a in (1, 3))
    else:
        ks, vs = (torch.full((N, BS, HKV), 1e30) for _ in range(2))     # finite (the checks pass it), ruinous
    start = 0
    for b, L in enumerate(seq_lens):
        tables[b, :need[b]] = perm[start:start + need[b]].to(torch.int32)
        start += need[b]
        pos = torch.arange(L)
        slots = tables[b, pos // BS].long() * BS + pos % BS
        store_kv_torch(torch.randn(L, HKV, D, generator=g), 3 * torch.randn(L, HKV, D, generator=g), kc, vc,
                       slots, k_scale=ks, v_scale=vs)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    query = torch.randn(int(qsl[-1]), H, D, generator=g).to(dtype)
    return dict(query=query, key_cache=kc, value_cache=vc, block_tables=tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl, k_scale=ks, v_scale=vs)


def oracle(b, scale, tree_bits=None):
    """float64 attention over the dequantized blocks (codes times their scales), causal with the context offset;
    tree_bits [T]: row t sees this step's token i only if bit i is set (-1: causal)."""
    kd, vd = (quant.dequantize(b[c], b[s], torch.float64) for c, s in (("key_cache", "k_scale"),
                                                                         ("value_cache", "v_scale")))
    q, qsl = b["query"].double(), b["query_start_loc"].tolist()
    out = torch.zeros_like(q)
    for i, L in enumerate(b["seq_lens"].tolist()):
        s, e = qsl[i], qsl[i + 1]
        n = e - s
        pos = torch.arange(L)
        phys = b["block_tables"][i].long()[pos // BS]
        K, V = (x[phys, pos % BS].repeat_interleave(H // HKV, 1) for x in (kd, vd))     # [L, H, D]
        sc = torch.einsum("thd,khd->htk", q[s:e], K) * scale
        visible = pos[None, :] <= (L - n + torch.arange(n))[:, None]                    # [n, L]
        if tree_bits is not None:
            node = (pos - (L - n)).clamp(0, 63)
            bit = (tree_bits[s:e, None] >> node[None, :]) & 1
            visible &= (pos < L - n)[None, :] | (bit == 1)
        out[s:e] = torch.einsum("htk,khd->thd", sc.masked_fill(~visible, float("-inf")).softmax(-1), V)
    return out


def _check(out, want, dtype):
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = (out.double() - want).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.abs().max().item()), f"max error {err}"


@CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name,granularity", MODES)
def test_paged_attention_reads_quantized_blocks(name, granularity, dtype):
    # a decode with context, a prefill, a chunk after 7 cached tokens holding a token tree (parents -1, 0, 0, 1)
    b = make_batch(name, granularity, [1, 6, 4], [9, 6, 11], dtype)
    tree = torch.full((11,), -1, dtype=torch.int64)
    tree[7:] = torch.tensor([0b1, 0b11, 0b101, 0b1011])
    for bits in (None, tree):
        out = kernels.paged_attention(*(b[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                                                       "seq_lens", "query_start_loc")), 0.3, tree_bits=bits,
                                      k_scale=b["k_scale"], v_scale=b["v_scale"])
        _check(out, oracle(b, 0.3, bits), dtype)


@CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name,granularity", MODES)
@pytest.mark.parametrize("fn", ["paged_decode", "flash_decode"])
def test_decode_kernels_read_quantized_blocks(fn, name, granularity, dtype):
    # a wide table (24 blocks of 4): flash_decode splits the context over 2 programs per (sequence, KV head)
    b = make_batch(name, granularity, [1, 1, 1], [9, 37, 2], dtype, width=24)
    out = getattr(kernels, fn)(*(b[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")),
                               0.3, k_scale=b["k_scale"], v_scale=b["v_scale"])
    _check(out, oracle(b, 0.3), dtype)


@CPU
def test_flash_decode_split_plan_is_exercised():
    from kernels.flash_decode import PRODUCT_LANES, plan
    block_n = max(8, min(64, PRODUCT_LANES // (triton.next_power_of_2(H // HKV) * triton.next_power_of_2(D))))
    assert plan(3, HKV, 24 * BS, block_n)[0] > 1


# ----------------------------------------------------------------------------- the engine
@CPU
def test_engine_greedy_on_triton_equals_loop(target_model):
    from minibatch import LLM, SamplingParams
    prompts = ["def fib(n):\n    return", "The cat sat on the mat because"]
    params = SamplingParams(temperature=0, max_tokens=5)
    kw = dict(block_size=8, max_num_batched_tokens=32, kv_cache_dtype="int8", scale_granularity="per_token_head")
    outs = {be: [o.outputs[0].token_ids for o in LLM(target_model, attention_backend=be, **kw)
                 .generate(prompts, params, use_tqdm=False)] for be in ("loop", "triton")}
    assert outs["triton"] == outs["loop"]


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name,granularity", MODES)
def test_gpu_quantized_store_and_kernels(name, granularity, dtype):
    """The compiled kernels (the bits decoded and encoded by integer arithmetic, div_rn, the int8 rounding): the
    store's bytes equal the torch store's on the CPU, and every kernel the float64 oracle."""
    key, value, caches, slots, scales = _store_inputs(name, granularity)
    gpu = [x.cuda() for x in (key, value, *caches, slots, *scales)]
    kernels.store_kv(*gpu[:5], k_scale=gpu[5], v_scale=gpu[6])
    store_kv_torch(key, value, *caches, slots, k_scale=scales[0], v_scale=scales[1])
    for got, want in zip(gpu[2:4] + gpu[5:], caches + scales):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    tol = {torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    for q_lens, seq_lens, fns in (([1, 6, 4], [9, 6, 11], ["paged_attention"]),
                                  ([1, 1, 1], [9, 37, 2], ["paged_decode", "flash_decode"])):
        b = make_batch(name, granularity, q_lens, seq_lens, dtype, width=24)
        want = oracle(b, 0.3)
        g = {k: v.cuda() for k, v in b.items()}
        for fn in fns:
            args = [g[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
            if fn == "paged_attention":
                args.append(g["query_start_loc"])
            out = getattr(kernels, fn)(*args, 0.3, k_scale=g["k_scale"], v_scale=g["v_scale"]).cpu()
            assert torch.isfinite(out).all()
            err = (out.double() - want).abs().max().item()
            assert err <= tol * max(1.0, want.abs().max().item()), f"{fn}: max error {err}"
