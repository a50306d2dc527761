"""Quantized KV blocks through the cache and the backends (kv/kv_cache.py, backends/loop.py, batched.py, cpu.py).

Two steps through ``PagedAttention`` on a quantized pool (fp8 e4m3, e5m2, int8; scales per tensor and per (token,
head)): first every sequence's context is prefilled, then a step of decodes, a chunk and a verify chain. Then:
* the pool holds exactly what ``quant.quantize`` makes of the K/V with the right scales (so the store quantized,
  and per (token, head) wrote each row's scale at its slot);
* each backend of QUANTIZED_BACKENDS ("loop", "batched", "cpu", "triton"; with and without debug checks) equals a float64
  oracle run on the dequantized blocks, to float32's tolerance (it dequantizes inside its loop, in float32);
* that answer is close to attention on the unquantized K/V (the format's error, not garbage).
And: blocks copied (copy-on-write, a tree's path) carry their scales; bytes per block count them; calibration sets
a layer's scales from its first batch only; bad combinations are refused with a clear error.
"""

import pytest
import torch

from minibatch.kv import backends, quant
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.kv.kv_cache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

H, HKV, D, BS = 4, 2, 16, 4
CONTEXT = [9, 0, 13, 6]                 # tokens cached before the step
NEW = [1, 5, 1, 4]                      # then: a decode, a prefill, a decode, a verify chain (1 + 3)
MODES = [(d, g) for d in ("fp8_e4m3", "fp8_e5m2", "int8") for g in quant.SCALE_GRANULARITIES]


def make_cache(dtype, granularity, seed=0):
    """The pool, block tables drawn shuffled from it, and each sequence's K, V [L, HKV, D] and step queries."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(CONTEXT, NEW)]
    need = [-(-L // BS) for L in lens]
    perm = torch.randperm(2 * sum(need) + 3, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    cache = KVCache(1, len(perm), BS, HKV, D, kv_cache_dtype=dtype, scale_granularity=granularity)
    K = [torch.randn(L, HKV, D, generator=g) for L in lens]
    V = [2 * torch.randn(L, HKV, D, generator=g) for L in lens]
    if granularity == "per_tensor":                                  # as if calibrated on these values
        cache.set_scales(0, *(quant.calibrate_scale(torch.cat(X), dtype) for X in (K, V)))
    q = torch.randn(sum(NEW), H, D, generator=g)
    return cache, tables, K, V, q


def run_step(cache, tables, K, V, q, backend, debug):
    """Prefill the contexts, then the step; returns the step's output [T, H, D] and its metadata."""
    ctx = [b for b, c in enumerate(CONTEXT) if c]
    md0 = AttentionMetadata.build([tables[b] for b in ctx], [0] * len(ctx), [CONTEXT[b] for b in ctx], BS)
    k0, v0 = (torch.cat([X[b][:CONTEXT[b]] for b in ctx]) for X in (K, V))
    attn = PagedAttention(cache, md0, backend, debug=debug)
    attn(0, torch.zeros(k0.shape[0], H, D), k0, v0)
    md = AttentionMetadata.build(tables, CONTEXT, NEW, BS)
    k1, v1 = (torch.cat([X[b][CONTEXT[b]:] for b in range(len(NEW))]) for X in (K, V))
    return PagedAttention(cache, md, backend, debug=debug)(0, q, k1, v1), md


def dequantized_pool(cache):
    """[2, num_blocks, BS, HKV, D] float64: every slot's K and V as stored, times its scale."""
    s = cache.scales[0].double()
    s = s[:, None, None, None, None] if cache.scale_granularity == "per_tensor" else s[..., None]
    return cache.kv[0].double() * s


def oracle(pool, tables, q, scale):
    """Causal attention with the context offset, in float64, over the pool's positions 0..L-1 of each sequence."""
    out, t = [], 0
    for b, table in enumerate(tables):
        L, n = CONTEXT[b] + NEW[b], NEW[b]
        slots = [table[p // BS] * BS + p % BS for p in range(L)]
        k, v = (pool[i].reshape(-1, HKV, D)[slots].repeat_interleave(H // HKV, dim=1) for i in (0, 1))  # [L, H, D]
        s = torch.einsum("qhd,khd->hqk", q[t:t + n].double(), k) * scale
        s = s.masked_fill(torch.arange(L)[None, None, :] > torch.arange(L - n, L)[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        t += n
    return torch.cat(out)


def plain(K, V, q, scale):
    """The same attention on the unquantized K/V."""
    return torch.cat([_one(K[b], V[b], q[sum(NEW[:b]):sum(NEW[:b + 1])], scale) for b in range(len(NEW))])


def _one(k, v, q, scale):
    L, n = k.shape[0], q.shape[0]
    k, v = (x.double().repeat_interleave(H // HKV, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(torch.arange(L)[None, None, :] > torch.arange(L - n, L)[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("debug", [False, True], ids=["engine path", "debug checks"])
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.interpreter) if b == "triton" else b
                                     for b in backends.QUANTIZED_BACKENDS])     # CPU tensors: the interpreter
@pytest.mark.parametrize("dtype, granularity", MODES)
def test_a_backend_equals_float64_on_the_dequantized_blocks(dtype, granularity, backend, debug):
    cache, tables, K, V, q = make_cache(dtype, granularity)
    assert cache.kv.dtype == quant.storage_dtype(dtype) and cache.dtype == cache.kv.dtype
    out, md = run_step(cache, tables, K, V, q, backend, debug)
    assert out.dtype == torch.float32
    # the store: every position's stored bytes are quantize(K, its scale), and per (token, head) that scale is
    # the row's own
    for b, table in enumerate(tables):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(CONTEXT[b] + NEW[b])])
        for i, X in enumerate((K[b], V[b])):
            stored = cache.kv[0, i].reshape(-1, HKV, D)[slots]
            if granularity == "per_tensor":
                s = cache.scales[0, i]
            else:
                s = cache.scales[0, i].reshape(-1, HKV)[slots]
                torch.testing.assert_close(s, quant.token_head_scales(X, dtype), rtol=0, atol=0)
            assert torch.equal(stored.float(), quant.quantize(X, dtype, s).float())
    scale = D ** -0.5
    torch.testing.assert_close(out.double(), oracle(dequantized_pool(cache), tables, q, scale), rtol=1e-5, atol=1e-5)
    # and the format's error, not garbage: near attention on the unquantized values, relative to the output's
    # largest entry, within twice the format's relative bound (int8: 0.03, 4x half a step of amax / 127)
    ref = plain(K, V, q, scale)
    tol = 2 * quant.round_trip_bound(dtype)[0] or 0.03
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < tol


def test_the_loop_and_batched_agree_on_a_quantized_step():
    outs = []
    for backend in ("loop", "batched"):
        cache, tables, K, V, q = make_cache("fp8_e4m3", "per_token_head", seed=3)
        outs.append(run_step(cache, tables, K, V, q, backend, False)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_copied_blocks_and_slots_carry_their_scales():
    cache, tables, K, V, q = make_cache("int8", "per_token_head")
    run_step(cache, tables, K, V, q, "loop", False)
    src = tables[0][0]
    dst = next(b for b in range(cache.num_blocks) if all(b not in t for t in tables))      # a block nobody owns
    cache.copy_blocks([(src, dst)])
    assert torch.equal(cache.kv[:, :, dst], cache.kv[:, :, src])
    assert torch.equal(cache.scales[:, :, dst], cache.scales[:, :, src]) and not bool((cache.scales[:, :, src] == 1).all())
    a, b = tables[2][0] * BS + 1, dst * BS + 3
    cache.copy_slots(torch.tensor([a]), torch.tensor([b]))
    assert torch.equal(cache.scales[0, :].reshape(2, -1, HKV)[:, b], cache.scales[0, :].reshape(2, -1, HKV)[:, a])
    assert torch.equal(cache.kv[0].reshape(2, -1, HKV, D)[:, b], cache.kv[0].reshape(2, -1, HKV, D)[:, a])


def test_bytes_per_block_count_the_scales_and_the_budget_holds_more_blocks():
    L, bs, Hkv, Dh = 2, 16, 4, 64
    fp32 = KVCache.bytes_per_block(L, bs, Hkv, Dh, torch.float32)
    assert fp32 == 2 * L * bs * Hkv * Dh * 4
    fp8 = KVCache.bytes_per_block(L, bs, Hkv, Dh, torch.float32, "fp8_e4m3", "per_token_head")
    assert fp8 == bs * quant.bytes_per_token(L, Hkv, Dh, "fp8_e4m3", torch.float32, "per_token_head")
    assert fp8 == 2 * L * bs * Hkv * (Dh + 4)
    budget = 100 * fp32
    big = KVCache.from_memory_budget(budget, L, bs, Hkv, Dh, kv_cache_dtype="fp8_e4m3",
                                     scale_granularity="per_token_head")
    assert big.num_blocks == budget // fp8 == 376                        # 4x the fp32 pool's 100, less the scales
    assert big.kv.numel() * big.kv.element_size() + big.scales.numel() * 4 <= budget


def test_calibration_sets_a_layers_scales_from_its_first_batch_only():
    cache = KVCache(1, 8, BS, HKV, D, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    k = torch.randn(4, HKV, D)
    md = AttentionMetadata.build([[0]], [0], [4], BS)
    PagedAttention(cache, md, "loop")(0, torch.randn(4, H, D), k, 2 * k)
    first = cache.scales[0].clone()
    want = [quant.calibrate_scale(k, "fp8_e4m3"), quant.calibrate_scale(2 * k, "fp8_e4m3")]
    assert torch.equal(first, torch.tensor(want, dtype=quant.SCALE_DTYPE))
    md = AttentionMetadata.build([[0, 1]], [4], [1], BS)
    big = 100 * torch.ones(1, HKV, D)
    PagedAttention(cache, md, "loop")(0, torch.randn(1, H, D), big, big)
    assert torch.equal(cache.scales[0], first)                         # stale: the later, larger value clips
    stored = cache.kv[0, 0, 1, 0].float() * first[0]
    assert bool((stored < 100).all()) and bool(torch.isfinite(stored).all())


def test_bad_combinations_are_refused_clearly(monkeypatch):
    cache, tables, K, V, q = make_cache("fp8_e4m3", "per_tensor")
    md = AttentionMetadata.build(tables, CONTEXT, NEW, BS)
    with pytest.raises(ValueError, match="kv_cache_dtype.*choose one of"):
        KVCache(1, 4, BS, HKV, D, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        KVCache(1, 4, BS, HKV, D, kv_cache_dtype="int8", scale_granularity="per_token_head", calculate_kv_scales=True)
    with pytest.raises(ValueError, match="k_scale"):
        cache.set_scales(0, 0.0, 1.0)
    args = (q, cache.key_cache(0), cache.value_cache(0), md.block_tables, md.seq_lens, md.query_start_loc, 0.25)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):          # scales forgotten: no silent garbage
        backends.paged_attention_loop(*args)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        backends.paged_attention_cpu(*args)
    with pytest.raises(ValueError, match="positive and finite"):
        backends.paged_attention_batched(*args, k_scale=torch.tensor(0.0), v_scale=torch.tensor(1.0))

    def student(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
        raise AssertionError("never called with a quantized cache")
    monkeypatch.setattr(backends.loop, "paged_attention_loop", student)     # exercise 2's signature: no scales
    with pytest.raises(TypeError, match="k_scale"):
        PagedAttention(cache, md, "loop")(0, q, torch.cat([k[c:] for k, c in zip(K, CONTEXT)]),
                                          torch.cat([v[c:] for v, c in zip(V, CONTEXT)]))


@pytest.mark.parametrize("granularity", quant.SCALE_GRANULARITIES)
def test_a_tree_step_over_quantized_blocks_is_one_answer_everywhere(granularity):
    """A token tree (sequence 3's four new tokens: root, two children, a grandchild) over quantized blocks: "loop",
    "batched" and exercise 2's route in a student release (``exercises.attention_through``: one decode per row,
    the rows' scales gathered with them) agree."""
    import exercises
    outs = []
    for backend in ("loop", "batched"):
        cache, tables, K, V, q = make_cache("int8", granularity, seed=5)
        ctx = [b for b, c in enumerate(CONTEXT) if c]
        md0 = AttentionMetadata.build([tables[b] for b in ctx], [0] * len(ctx), [CONTEXT[b] for b in ctx], BS)
        k0, v0 = (torch.cat([X[b][:CONTEXT[b]] for b in ctx]) for X in (K, V))
        PagedAttention(cache, md0, backend)(0, torch.zeros(k0.shape[0], H, D), k0, v0)
        md = AttentionMetadata.build(tables, CONTEXT, NEW, BS, tree_parents=[None, None, None, [-1, 0, 0, 1]])
        k1, v1 = (torch.cat([X[b][CONTEXT[b]:] for b in range(len(NEW))]) for X in (K, V))
        outs.append(PagedAttention(cache, md, backend)(0, q, k1, v1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    s = cache.layer_scales(0)
    through = exercises.attention_through(q, cache.key_cache(0), cache.value_cache(0), md.block_tables, md.seq_lens,
                                          md.query_start_loc, D ** -0.5, tree_bits=md.tree_bits, **s)
    torch.testing.assert_close(through, outs[0], rtol=1e-5, atol=1e-5)
    causal = PagedAttention(cache, AttentionMetadata.build(tables, CONTEXT, NEW, BS), "loop")(0, q, k1, v1)
    assert torch.allclose(causal[-3], outs[0][-3]) and not torch.allclose(causal[-2], outs[0][-2])   # node 2: its own
