"""Backend "cpu" on quantized KV blocks (kv/backends/cpu_quant.py, cpu_kernel.py, cpu.py; kv/quant.py).

* The C++ store writes the torch store's bytes bit for bit (``store_kv_torch``), and the same scales, for each
  dtype (fp8 e4m3, e5m2, int8) x granularity (per tensor, per (token, head)) x input dtype (fp32, bf16), on
  inputs chosen to catch a wrong encode: values past the range at a scale of 1.0 (clamped, never NaN or inf),
  tiny values (the formats' subnormals, and below them: flushed to zero), negative zero, int8's halves (round
  half to even), an all-zero row (its per-row scale is 1.0), padding slots (-1: nothing written).
* Every fp8 code decodes as torch decodes it (the operator's branch-free decode, through a one-position context).
* The operator equals a float64 oracle run on the dequantized blocks (fp32 queries: 1e-5; bf16: the output's own
  rounding, 2e-2), with GQA, context offsets, a decode, a verify chain, a token tree and a long prefill chunk
  (which the engine's hybrid hands to SDPA, with the scales), through the public function and ``PagedAttention``.
* The engine: greedy output on "cpu" equals "loop" for each kv_cache_dtype, and a prefix-cache hit equals the
  cold run on a quantized cache.
"""

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.kv import backends, quant
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.kv.backends import cpu, cpu_kernel
from minibatch.kv.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8")
MODES = [(d, g) for d in DTYPES for g in quant.SCALE_GRANULARITIES]


@pytest.fixture(scope="module")
def op(cpu_op):
    return cpu_op


def hard_rows(dtype, T=12, Hkv=2, D=16, seed=0):
    """[T, Hkv, D] in ``dtype``: normal values of mixed magnitude, then the rows that catch a wrong encode."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, Hkv, D, generator=g) * torch.logspace(-3, 3, T)[:, None, None]
    x[0, 0, :8] = torch.tensor([1e6, -1e6, 500.0, -449.0, 6e4, -7e4, 3e38, 127.6])     # past every range
    x[0, 1] = 0.0                                                                        # all zero: scale 1
    x[1, 0, :8] = torch.tensor([2.0 ** -8, -2.0 ** -9, 2.0 ** -10, 2.0 ** -11, 1e-7, -1e-30, 2.0 ** -15, 2.0 ** -17])
    x[1, 1, :8] = torch.tensor([-0.0, 0.0, 0.5, 1.5, 2.5, -2.5, -3.5, 126.5])            # signed zero; halves
    x[1, 1, 8] = 100.0                                         # per (token, head): its amax, so the halves stay halves
    return x.to(dtype)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype, granularity, per_tensor_scale",     # per tensor at 1.0 (clips) and at 0.37
                         [(d, g, s) for d, g in MODES for s in ((1.0, 0.37) if g == "per_tensor" else (None,))])
def test_the_cpp_store_is_bit_exact_with_the_torch_store(op, dtype, granularity, per_tensor_scale, in_dtype):
    N, bs, Hkv, D = 5, 4, 2, 16
    key, value = hard_rows(in_dtype), -hard_rows(in_dtype, seed=1)
    slots = torch.tensor([3, 17, -1, 0, 8, 19, -1, 4, 11, 2, 15, 6])      # two padding rows; blocks out of order
    runs = []
    for store in (backends.store_kv_torch, cpu.store):
        c = KVCache(1, N, bs, Hkv, D, kv_cache_dtype=dtype, scale_granularity=granularity)
        if granularity == "per_tensor":
            c.set_scales(0, per_tensor_scale, 2 * per_tensor_scale)
        store(key, value, c.key_cache(0), c.value_cache(0), slots, **c.layer_scales(0))
        runs.append(c)
    a, b = runs
    raw = torch.int8 if dtype == "int8" else torch.uint8
    assert torch.equal(a.kv.view(raw), b.kv.view(raw)), "the stored bytes differ"
    assert torch.equal(a.scales, b.scales)
    written = b.kv[0].float().reshape(2, -1, Hkv, D)[:, slots[slots >= 0]]
    assert bool(torch.isfinite(written).all())                           # clamped: never NaN or inf
    m = quant.max_representable(dtype)
    if granularity == "per_tensor":                                      # past the range: exactly +-max
        assert written[0, 0, 0, :2].tolist() == [m, -m]
    untouched = torch.ones(N * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert not bool(b.kv[0].reshape(2, -1, Hkv, D)[:, untouched].float().any())   # nothing else written
    if granularity == "per_token_head":
        assert b.scales[0, 0].reshape(-1, Hkv)[3, 1] == 1.0                      # the all-zero row's scale


@pytest.mark.parametrize("D", [256, 24, 13], ids=["16 wide", "16 + 8 wide", "8 wide + scalar tail"])
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_code_decodes_as_torch(op, dtype, D):
    """One position of context whose V row holds D codes: the output is that row decoded, exactly. Every code is
    read at every D, so each of the operator's decode paths (16 and 8 codes through a half where the CPU has F16C,
    the scalar tail, the scalar decode elsewhere) reads all 256."""
    st = quant.storage_dtype(dtype)
    codes = torch.arange(256, dtype=torch.uint8)
    one = torch.ones((), dtype=torch.float32)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)                          # noqa: E731
    kc = torch.zeros(1, 1, 1, D, dtype=torch.uint8).view(st)
    for start in range(0, 256, D):
        row = codes[start:start + D]
        row = torch.cat([row, codes[:D - len(row)]])                             # the last window wraps round
        vc = row.view(1, 1, 1, D).clone().view(st)
        out = op(torch.zeros(1, 1, D), kc, vc, i32([0]), i32(1), i32(0, 1), 1.0, None, one, one)[0, 0]
        want = row.view(st).float()
        finite = torch.isfinite(want)
        assert torch.equal(out[finite], want[finite]), start    # (-0 reads 0: the accumulator starts at +0)
        assert bool(torch.isfinite(out).all())            # the codes the clamping store never writes read finite


H, HKV, D, BS = 4, 2, 32, 4
CONTEXT = [9, 0, 13, 6, 3]             # cached before the step
NEW = [1, 12, 1, 4, 4]                 # a decode, a prefill longer than cpu.LONG_QUERY, a decode, a chain, a tree
TREE = [-1, 0, 0, 1]                   # sequence 4's new tokens


def quantized_step(dtype, granularity, q_dtype, seed=0):
    """A pool filled by the C++ store (the contexts, then the step's own K/V), the step's metadata and queries."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(CONTEXT, NEW)]
    need = [-(-L // BS) for L in lens]
    perm = torch.randperm(2 * sum(need) + 3, generator=g).tolist()
    tables = [perm[sum(need[:b]):sum(need[:b + 1])] for b in range(len(need))]
    cache = KVCache(1, len(perm), BS, HKV, D, kv_cache_dtype=dtype, scale_granularity=granularity)
    K = [torch.randn(L, HKV, D, generator=g) * (1 + torch.arange(L)[:, None, None] % 3) for L in lens]
    V = [2 * torch.randn(L, HKV, D, generator=g) for L in lens]
    if granularity == "per_tensor":
        cache.set_scales(0, *(quant.calibrate_scale(torch.cat(X), dtype) for X in (K, V)))
    md = AttentionMetadata.build(tables, [0] * len(lens), lens, BS)              # every position's slot
    cpu.store(torch.cat(K), torch.cat(V), cache.key_cache(0), cache.value_cache(0), md.slot_mapping,
              **cache.layer_scales(0))
    step = AttentionMetadata.build(tables, CONTEXT, NEW, BS, tree_parents=[None] * 4 + [TREE])
    q = torch.randn(sum(NEW), H, D, generator=g).to(q_dtype)
    return cache, tables, step, q, K, V


def oracle(cache, tables, md, q, scale):
    """float64 attention over the dequantized pool: causal with the context offset, and the tree's mask."""
    s = cache.scales[0].double()
    s = s[:, None, None, None, None] if cache.scale_granularity == "per_tensor" else s[..., None]
    pool = cache.kv[0].double() * s                                               # [2, N, BS, HKV, D]
    out, t = [], 0
    for b, table in enumerate(tables):
        L, n = CONTEXT[b] + NEW[b], NEW[b]
        slots = [table[p // BS] * BS + p % BS for p in range(L)]
        k, v = (pool[i].reshape(-1, HKV, D)[slots].repeat_interleave(H // HKV, dim=1) for i in (0, 1))
        sc = torch.einsum("qhd,khd->hqk", q[t:t + n].double(), k) * scale
        seen = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]      # [n, L]
        bits = md.tree_bits[t:t + n] if md.tree_bits is not None else torch.full((n,), -1)
        node = (torch.arange(L) - (L - n)).clamp(0, 63)
        seen &= (torch.arange(L) < L - n)[None, :] | ((bits[:, None] >> node[None, :]) & 1 == 1)
        out.append(torch.einsum("hqk,khd->qhd", sc.masked_fill(~seen, float("-inf")).softmax(-1), v))
        t += n
    return torch.cat(out)


@pytest.mark.parametrize("q_dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype, granularity", MODES)
def test_the_operator_equals_float64_on_the_dequantized_blocks(op, dtype, granularity, q_dtype, tol):
    cache, tables, md, q, K, V = quantized_step(dtype, granularity, q_dtype)
    scale = D ** -0.5
    want = oracle(cache, tables, md, q, scale)
    kc, vc, s = cache.key_cache(0), cache.value_cache(0), cache.layer_scales(0)
    public = cpu.paged_attention_cpu(q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc, scale,
                                     tree_bits=md.tree_bits, **s)
    assert public.dtype == q_dtype
    torch.testing.assert_close(public.double(), want, rtol=tol, atol=tol)
    # the engine's path: the step's K/V stored again (the same bytes in fp32; bf16's rounding may change a few,
    # so the oracle reads the pool again), then the long row through SDPA with the scales, the rest through
    # the operator
    k1, v1 = (torch.cat([X[b][CONTEXT[b]:] for b in range(len(NEW))]).to(q_dtype) for X in (K, V))
    engine = PagedAttention(cache, md, "cpu")(0, q, k1, v1)
    torch.testing.assert_close(engine.double(), oracle(cache, tables, md, q, scale), rtol=tol, atol=tol)
    if q_dtype == torch.float32:
        torch.testing.assert_close(public, engine, rtol=1e-5, atol=1e-5)


def test_paged_attention_cpu_refuses_a_quantized_cache_without_its_scales(op):
    cache, tables, md, q, _, _ = quantized_step("int8", "per_tensor", torch.float32)
    args = (q, cache.key_cache(0), cache.value_cache(0), md.block_tables, md.seq_lens, md.query_start_loc, 0.2)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        cpu.paged_attention_cpu(*args)
    with pytest.raises(ValueError, match="one granularity"):
        cpu.paged_attention_cpu(*args, k_scale=torch.ones(()), v_scale=torch.ones(cache.kv.shape[2:5]))


# -- the engine ------------------------------------------------------------------------------------------------------
PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
ROOMY = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
ENGINE_MODES = [("fp8_e4m3", "per_tensor"), ("fp8_e5m2", "per_token_head"), ("int8", "per_token_head")]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype, granularity", ENGINE_MODES)
def test_engine_greedy_on_cpu_equals_loop(op, target_model, dtype, granularity):
    q = dict(kv_cache_dtype=dtype, scale_granularity=granularity,
             calculate_kv_scales=granularity == "per_tensor")
    outs = {b: _tokens(LLM(target_model, **ROOMY, **q, attention_backend=b).generate(PROMPTS, GREEDY))
            for b in ("loop", "cpu")}
    assert outs["cpu"] == outs["loop"]


def test_a_prefix_hit_on_cpu_equals_the_cold_run(op, target_model):
    llm = LLM(target_model, **ROOMY, kv_cache_dtype="fp8_e4m3", scale_granularity="per_token_head")
    assert llm.llm_engine.config.attention_backend == "cpu"               # the default on a CPU reads fp8 now
    cold = _tokens(llm.generate(PROMPTS, GREEDY))
    hits = llm.llm_engine.allocator.hits
    warm = _tokens(llm.generate(PROMPTS, GREEDY))
    assert llm.llm_engine.allocator.hits > hits and warm == cold


def test_the_kv_dtypes_bench_prints_every_row(op, capsys):
    from minibatch.bench import attention
    attention.main(["--kv-dtypes", "--iters", "1", "--rounds", "1"])
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if "|" in ln and ln.split()[0].isdigit()]
    assert len(rows) == len(attention.KV_CONTEXTS) * len(attention.KV_MODES)
    assert all(r[-4] == "1.00" for r in rows if r[1] == "fp32")                 # fp32 is the baseline
