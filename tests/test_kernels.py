"""Triton kernels (kernels/) against plain, obvious PyTorch references.

In the spirit of vLLM's kernel tests: a grid of query/context length mixes,
head layouts (MHA, GQA, MQA), block sizes and head sizes; block tables that
are shuffled and drawn from a pool much larger than needed; every cache slot
that belongs to no sequence (and every block-table padding entry's block)
filled with NaN, so a kernel that reads one shows NaN in its output; signed
random values. On a CPU the kernels run through the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), so shapes here stay small.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton", reason="the kernels need Triton, which installs on Linux only")
import kernels  # noqa: E402
from kernels.flash_decode import plan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------- helpers
def make_batch(q_lens, seq_lens, block_size, H, Hkv, D, dtype=torch.float32, device=DEVICE,
               seed=0, idx_dtype=torch.int32):
    """A flat batch plus a paged cache holding each sequence's K/V at shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    n_blocks = [math.ceil(L / block_size) for L in seq_lens]
    max_blocks = max(n_blocks + [1]) + 2                      # extra padding columns
    num_blocks = 3 * sum(n_blocks) + 4                        # pool much larger than needed
    # K and V interleaved per block: layer views [:, 0], [:, 1] are strided in dim 0.
    storage = torch.full((num_blocks, 2, block_size, Hkv, D), float("nan"), dtype=dtype)
    key_cache, value_cache = storage[:, 0], storage[:, 1]
    perm = torch.randperm(num_blocks, generator=g)
    spare = int(perm[-1])                                     # a block no sequence owns (all NaN)
    block_tables = torch.full((B, max_blocks), spare, dtype=idx_dtype)
    keys, values, start = [], [], 0
    for b, L in enumerate(seq_lens):
        block_tables[b, :n_blocks[b]] = perm[start:start + n_blocks[b]].to(idx_dtype)
        start += n_blocks[b]
        k = torch.randn(L, Hkv, D, generator=g).to(dtype)
        v = torch.randn(L, Hkv, D, generator=g).to(dtype)
        pos = torch.arange(L)
        phys = block_tables[b, pos // block_size].long()
        key_cache[phys, pos % block_size] = k
        value_cache[phys, pos % block_size] = v
        keys.append(k)
        values.append(v)
    qsl = torch.zeros(B + 1, dtype=idx_dtype)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    query = torch.randn(int(qsl[-1]), H, D, generator=g).to(dtype)
    storage = storage.to(device)                              # keep the strided layer views
    return dict(query=query.to(device), key_cache=storage[:, 0], value_cache=storage[:, 1],
                block_tables=block_tables.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=idx_dtype, device=device),
                query_start_loc=qsl.to(device), keys=keys, values=values)


def reference_attention(query, key_cache, value_cache, block_tables, seq_lens,
                        query_start_loc, scale):
    """Dense float64: gather each sequence's K/V position by position, then
    softmax(q k^T * scale, causal with the context offset) v."""
    T, H, D = query.shape
    block_size, Hkv = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    key_cache, value_cache, block_tables = key_cache.cpu(), value_cache.cpu(), block_tables.cpu()
    for b in range(seq_lens.shape[0]):
        s, e, L = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        pos = torch.arange(L)
        phys = block_tables[b].long()[pos // block_size]
        K = key_cache[phys, pos % block_size].double()             # [L, Hkv, D]
        V = value_cache[phys, pos % block_size].double()
        K, V = K.repeat_interleave(H // Hkv, 1), V.repeat_interleave(H // Hkv, 1)
        q = query[s:e].cpu().double()                                     # [q_len, H, D]
        scores = torch.einsum("thd,khd->htk", q, K) * scale
        q_pos = L - (e - s) + torch.arange(e - s)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        out[s:e] = torch.einsum("htk,khd->thd", scores.softmax(-1), V)
    return out


def dense_attention(batch, scale):
    """Dense float64 on the sequences' own contiguous K/V (batch["keys"], ["values"]): no cache at all."""
    query, qsl = batch["query"].cpu().double(), batch["query_start_loc"].cpu()
    H = query.shape[1]
    out = torch.zeros_like(query)
    for b, (K, V) in enumerate(zip(batch["keys"], batch["values"])):
        s, e, L = int(qsl[b]), int(qsl[b + 1]), K.shape[0]
        K, V = (x.double().repeat_interleave(H // x.shape[1], 1) for x in (K, V))
        scores = torch.einsum("thd,khd->htk", query[s:e], K) * scale
        q_pos = L - (e - s) + torch.arange(e - s)
        scores = scores.masked_fill(torch.arange(L)[None, :] > q_pos[:, None], float("-inf"))
        out[s:e] = torch.einsum("htk,khd->thd", scores.softmax(-1), V)
    return out


def run_both(batch, scale, **kw):
    args = [batch[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                               "seq_lens", "query_start_loc")]
    before = [a.clone() for a in args]
    out = kernels.paged_attention(*args, scale, **kw)
    for a, b in zip(args, before):                          # inputs are read, never written
        torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)
    ref = reference_attention(*args, scale)
    # the paged reference itself equals dense attention on the original K/V: the gather is right too
    torch.testing.assert_close(ref, dense_attention(batch, scale), atol=1e-9, rtol=1e-9)
    return out, ref


MIXES = {   # name: (q_lens, seq_lens)
    "decode": ([1, 1, 1], [37, 64, 9]),
    "prefill": ([5, 17, 1], [5, 17, 1]),
    "chunked_prefill": ([8, 13], [40, 77]),
    "mixed": ([1, 12, 4, 0, 9], [50, 30, 23, 16, 9]),     # decode, chunk, verify k=3, idle, prefill
}
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


# ----------------------------------------------------------------------------- paged_attention
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("mix", list(MIXES))
def test_paged_attention_matches_reference(mix, heads, block_size):
    (q_lens, seq_lens), (H, Hkv) = MIXES[mix], HEADS[heads]
    batch = make_batch(q_lens, seq_lens, block_size, H, Hkv, D=32, seed=block_size)
    out, ref = run_both(batch, 1 / math.sqrt(32))
    assert out.dtype == torch.float32 and out.shape == batch["query"].shape
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads", list(HEADS))
def test_paged_attention_block_size_64(heads):
    """The largest block size the issue names, on the mixed batch (sequences shorter than one block too)."""
    (q_lens, seq_lens), (H, Hkv) = MIXES["mixed"], HEADS[heads]
    batch = make_batch(q_lens, seq_lens, 64, H, Hkv, D=32, seed=64)
    out, ref = run_both(batch, 1 / math.sqrt(32))
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("D", [16, 24, 64, 128])      # 24: not a power of two, masked lanes
def test_paged_attention_head_sizes(D):
    batch = make_batch([1, 6, 3], [45, 20, 3], 16, 8, 2, D, seed=D)
    out, ref = run_both(batch, 1 / math.sqrt(D))
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)


def test_paged_attention_large_scores_need_the_running_max():
    # Scores in the hundreds: exp without subtracting the running max overflows,
    # and a max that grows tile after tile must rescale the earlier sums.
    batch = make_batch([1, 10], [70, 60], 8, 4, 2, 32, seed=3)
    out, ref = run_both(batch, 8.0)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)


def test_paged_attention_int64_metadata_and_strided_query():
    batch = make_batch([2, 9], [33, 9], 16, 4, 2, 32, seed=5, idx_dtype=torch.int64)
    T = batch["query"].shape[0]
    qkv = torch.randn(T, 3 * 4, 32, device=DEVICE)
    batch["query"] = qkv[:, 4:8]                           # a non-contiguous view, as from a qkv split
    out, ref = run_both(batch, 0.2)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)


def test_paged_attention_max_query_len():
    batch = make_batch([3, 1, 7], [3, 20, 30], 8, 4, 4, 16, seed=7)
    loose, ref = run_both(batch, 0.25, max_query_len=40)   # an upper bound is fine
    torch.testing.assert_close(loose.cpu().double(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="max_query_len"):
        run_both(batch, 0.25, max_query_len=6)


def test_paged_attention_float16():
    batch = make_batch([1, 9], [40, 25], 16, 8, 2, 32, dtype=torch.float16, seed=11)
    out, ref = run_both(batch, 1 / math.sqrt(32))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.cpu().double(), ref, atol=3e-3, rtol=3e-3)


def test_paged_attention_no_tokens():
    batch = make_batch([0, 0], [4, 0], 8, 4, 4, 16)
    out, _ = run_both(batch, 0.25)
    assert out.shape == (0, 4, 16)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=4),
       st.sampled_from([8, 16, 32]), st.sampled_from(list(HEADS)))
def test_paged_attention_random_mixes(seqs, block_size, heads):
    # (context already cached, new tokens) per sequence, any mix at all.
    q_lens = [q for _, q in seqs]
    seq_lens = [c + q for c, q in seqs]
    batch = make_batch(q_lens, seq_lens, block_size, *HEADS[heads], D=16, seed=sum(seq_lens))
    out, ref = run_both(batch, 0.3)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- paged_decode
@pytest.mark.parametrize("heads,block_size", [("mha", 8), ("gqa", 16), ("mqa", 32), ("gqa", 32)])
def test_paged_decode_matches_reference_and_general_kernel(heads, block_size):
    H, Hkv = HEADS[heads]
    batch = make_batch([1, 1, 1, 1], [1, 37, 50, 9], block_size, H, Hkv, D=24, seed=2)
    out, ref = run_both(batch, 0.2)
    dec = kernels.paged_decode(batch["query"], batch["key_cache"], batch["value_cache"],
                               batch["block_tables"], batch["seq_lens"], 0.2)
    torch.testing.assert_close(dec.cpu().double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dec, out, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- flash_decode
def widen(batch, extra):
    """The block table with `extra` more padding columns (its spare, all-NaN block): more splits, some empty."""
    bt = batch["block_tables"]
    return dict(batch, block_tables=torch.cat([bt, bt[:, -1:].expand(-1, extra)], 1).contiguous())


@pytest.mark.parametrize("heads,block_size,extra,D", [("mha", 8, 0, 24), ("gqa", 16, 12, 24), ("mqa", 32, 6, 24),
                                                      ("gqa", 8, 30, 64)])      # G x D = 256: 8 keys a tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_decode_matches_reference_and_general_kernel(heads, block_size, extra, D, dtype):
    H, Hkv = HEADS[heads]
    batch = widen(make_batch([1, 1, 1], [1, 37, 70], block_size, H, Hkv, D=D, seed=3, dtype=dtype), extra)
    splits, _ = plan(3, Hkv, batch["block_tables"].shape[1] * block_size, 16)
    out, ref = run_both(batch, 0.2)
    dec = kernels.flash_decode(batch["query"], batch["key_cache"], batch["value_cache"],
                               batch["block_tables"], batch["seq_lens"], 0.2)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(dec.cpu().double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(dec, out, atol=tol, rtol=tol)
    assert extra == 0 or splits > 2, "a widened table must split the context (and leave splits empty)"


def test_flash_decode_plan_by_hand():
    from kernels.flash_decode import plan
    # the docstring's figures for the target (4 KV heads, a 512-token table, 32 keys per tile)
    assert plan(1, 4, 512, 32) == (8, 64)        # 4 x 8 = 32 programs instead of 4
    assert plan(16, 4, 512, 32) == (2, 256)      # 64 x 2 = 128
    assert plan(32, 4, 512, 32) == (1, 512)      # a full wave already: one split, no combine launch
    assert plan(1, 1, 40, 16) == (1, 48)         # a short table: one split of whole tiles
    assert plan(2, 1, 200, 16) == (4, 64)


# ----------------------------------------------------------------------------- store_kv
def index_copy_reference(key, value, key_cache, value_cache, slot_mapping):
    kc, vc = key_cache.clone(), value_cache.clone()
    keep = slot_mapping >= 0
    flat_k = kc.reshape(-1, *kc.shape[2:])                     # a copy of the (strided) view
    flat_v = vc.reshape(-1, *vc.shape[2:])
    flat_k.index_copy_(0, slot_mapping[keep].long(), key[keep])
    flat_v.index_copy_(0, slot_mapping[keep].long(), value[keep])
    return flat_k.view(kc.shape), flat_v.view(vc.shape)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("Hkv,D", [(2, 32), (3, 24), (1, 64)])
def test_store_kv_matches_index_copy(Hkv, D, idx_dtype):
    g = torch.Generator().manual_seed(D)
    num_blocks, block_size, T = 12, 8, 20
    storage = torch.full((num_blocks, 2, block_size, Hkv, D), float("nan"), device=DEVICE)
    key_cache, value_cache = storage[:, 0], storage[:, 1]             # strided layer views
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[[3, 11, 12]] = -1                                          # padding: skipped
    key, value = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    ref_k, ref_v = index_copy_reference(key, value, key_cache.cpu(), value_cache.cpu(), slots)
    kernels.store_kv(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache,
                     slots.to(idx_dtype).to(DEVICE))
    torch.testing.assert_close(key_cache.cpu(), ref_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(value_cache.cpu(), ref_v, equal_nan=True, atol=0, rtol=0)
    assert int(torch.isnan(key_cache).any(-1).any(-1).sum()) == num_blocks * block_size - (T - 3)


def test_store_then_attend_equals_plain_causal_attention():
    # A whole prefill from scratch: store_kv fills the pages, paged_attention
    # reads them back, and the result is ordinary causal attention on k, v.
    H, Hkv, D, block_size, lens = 4, 2, 16, 8, [13, 5]
    g = torch.Generator().manual_seed(1)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, Hkv, Hkv))
    kc = torch.full((10, block_size, Hkv, D), float("nan"))
    vc = kc.clone()
    bt = torch.tensor([[7, 2, 9], [4, 0, 0]], dtype=torch.int32)
    slots = torch.cat([bt[b, torch.arange(L) // block_size].long() * block_size
                       + torch.arange(L) % block_size for b, L in enumerate(lens)])
    meta = [torch.tensor(x, dtype=torch.int32) for x in (lens, [0, 13, 18])]
    q_d, k_d, v_d, kc_d, vc_d, bt_d, slots_d, sl_d, qsl_d = (
        x.to(DEVICE) for x in (q, k, v, kc, vc, bt, slots, *meta))
    kernels.store_kv(k_d, v_d, kc_d, vc_d, slots_d)
    out = kernels.paged_attention(q_d, kc_d, vc_d, bt_d, sl_d, qsl_d, D ** -0.5)
    start = 0
    for L in lens:
        qs, ks, vs = (x[start:start + L].double().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(H // Hkv, 0), vs.repeat_interleave(H // Hkv, 0)
        want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        torch.testing.assert_close(out[start:start + L].cpu().double(), want.transpose(0, 1),
                                   atol=1e-4, rtol=1e-4)
        start += L


# ----------------------------------------------------------------------------- bad input
def _good():
    return make_batch([1, 4], [10, 4], 8, 4, 2, 16)


def _args(b):
    return [b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"],
            b["query_start_loc"], 0.25]


BAD_ATTENTION = {   # name: (mutation of the argument list, exception, message fragment)
    "dtype_mismatch": (lambda a: a.__setitem__(0, a[0].half()), TypeError, "must match"),
    "unsupported_dtype": (lambda a: [a.__setitem__(i, a[i].double()) for i in (0, 1, 2)], TypeError,
                          "unsupported"),
    "heads_not_divisible": (lambda a: a.__setitem__(0, a[0][:, :3]), ValueError, "multiple"),
    "head_dim_mismatch": (lambda a: a.__setitem__(0, a[0][..., :8]), ValueError, "head_dim"),
    "query_rank": (lambda a: a.__setitem__(0, a[0][0]), ValueError, "query must be"),
    "cache_shapes": (lambda a: a.__setitem__(2, a[2][:-1]), ValueError, "key_cache and value_cache"),
    "block_size_not_pow2": (lambda a: [a.__setitem__(i, a[i][:, :6]) for i in (1, 2)], ValueError,
                            "power of two"),
    "block_tables_float": (lambda a: a.__setitem__(3, a[3].float()), TypeError, "block_tables"),
    "seq_lens_float": (lambda a: a.__setitem__(4, a[4].float()), TypeError, "seq_lens"),
    "not_a_tensor": (lambda a: a.__setitem__(4, [10, 4]), TypeError, "seq_lens"),
    "batch_size_mismatch": (lambda a: a.__setitem__(3, a[3][:1]), ValueError, "rows"),
    "qsl_bad_end": (lambda a: a.__setitem__(5, a[5] - a[5].sign()), ValueError, "end at T"),
    "qsl_bad_start": (lambda a: a.__setitem__(5, a[5] + 1), ValueError, "start at 0"),
    "seq_shorter_than_query": (lambda a: a.__setitem__(4, a[4] - 3), ValueError, "seq_len <"),
    "too_few_block_columns": (lambda a: a.__setitem__(4, a[4] + 40), ValueError, "columns"),
    "block_id_out_of_range": (lambda a: a[3].__setitem__((0, 0), 10 ** 6), ValueError, "outside"),
    "negative_block_id": (lambda a: a[3].__setitem__((1, 0), -1), ValueError, "outside"),
    "scale_not_number": (lambda a: a.__setitem__(6, "0.25"), TypeError, "scale"),
    "scale_nan": (lambda a: a.__setitem__(6, float("nan")), TypeError, "scale"),
    "cache_on_another_device": (lambda a: a.__setitem__(1, a[1].to("meta")), ValueError, "device"),
    "block_tables_on_another_device": (lambda a: a.__setitem__(3, a[3].to("meta")), ValueError, "device"),
}


@pytest.mark.parametrize("case", list(BAD_ATTENTION))
def test_paged_attention_bad_input(case):
    mutate, exc, msg = BAD_ATTENTION[case]
    args = _args(_good())
    mutate(args)
    with pytest.raises(exc, match=msg):
        kernels.paged_attention(*args)


def test_paged_attention_non_decreasing_qsl():
    args = _args(make_batch([3, 2, 4], [3, 9, 4], 8, 4, 2, 16))
    args[5] = torch.tensor([0, 5, 3, 9], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="non-decreasing"):
        kernels.paged_attention(*args)


def test_paged_decode_bad_input():
    b = make_batch([1, 4], [10, 4], 8, 4, 2, 16)
    with pytest.raises(ValueError, match="one row per sequence"):
        kernels.paged_decode(b["query"], b["key_cache"], b["value_cache"], b["block_tables"],
                             b["seq_lens"], 0.25)
    b = make_batch([1, 1], [10, 4], 8, 4, 2, 16)
    with pytest.raises(TypeError, match="must match"):
        kernels.paged_decode(b["query"].half(), b["key_cache"], b["value_cache"],
                             b["block_tables"], b["seq_lens"], 0.25)


DECODE_SKIP = {"qsl_bad_end", "qsl_bad_start", "seq_shorter_than_query"}   # no query_start_loc to get wrong


@pytest.mark.parametrize("fn", ["paged_decode", "flash_decode"])
@pytest.mark.parametrize("case", [c for c in BAD_ATTENTION if c not in DECODE_SKIP] + ["empty_sequence"])
def test_decode_kernels_bad_input(fn, case):
    mutate, exc, msg = BAD_ATTENTION.get(case, (lambda a: a.__setitem__(4, a[4] - 4), ValueError, "seq_len <"))
    msg = {"query_rank": "want query"}.get(case, msg)
    args = _args(make_batch([1, 1], [10, 4], 8, 4, 2, 16))
    mutate(args)
    with pytest.raises(exc, match=msg):
        getattr(kernels, fn)(*args[:5], args[6])


def _store_args():
    kc = torch.zeros(4, 8, 2, 16, device=DEVICE)
    k = torch.randn(5, 2, 16, device=DEVICE)
    return [k, k.clone(), kc, kc.clone(), torch.arange(5, device=DEVICE)]


BAD_STORE = {
    "slot_out_of_range": (lambda a: a[4].__setitem__(2, 32), ValueError, "outside"),
    "slot_below_minus_one": (lambda a: a[4].__setitem__(2, -2), ValueError, "outside"),
    "duplicate_slot": (lambda a: a[4].__setitem__(2, 0), ValueError, "same slot"),
    "slot_float": (lambda a: a.__setitem__(4, a[4].float()), TypeError, "int32 or int64"),
    "slot_length": (lambda a: a.__setitem__(4, a[4][:3]), ValueError, "slot_mapping must be"),
    "dtype_mismatch": (lambda a: a.__setitem__(1, a[1].half()), TypeError, "one dtype"),
    "kv_shape_mismatch": (lambda a: a.__setitem__(1, a[1][:4]), ValueError, "differ"),
    "heads_mismatch": (lambda a: [a.__setitem__(i, a[i][:, :1]) for i in (0, 1)], ValueError,
                       "num_kv_heads"),
    "cache_rank": (lambda a: a.__setitem__(2, a[2][0]), ValueError, "key_cache and value_cache"),
    "key_on_another_device": (lambda a: a.__setitem__(0, a[0].to("meta")), ValueError, "device"),
}


@pytest.mark.parametrize("case", list(BAD_STORE))
def test_store_kv_bad_input_leaves_cache_unchanged(case):
    mutate, exc, msg = BAD_STORE[case]
    args = _store_args()
    mutate(args)
    before = [a.clone() for a in args[2:4]]
    with pytest.raises(exc, match=msg):
        kernels.store_kv(*args)
    for a, b in zip(args[2:4], before):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_gpu_long_context_decode_and_mixed(dtype, tol):
    q_lens = [1] * 12 + [64, 200, 4, 0]
    seq_lens = [1000 + 97 * i for i in range(12)] + [64, 1500, 2051, 33]
    batch = make_batch(q_lens, seq_lens, 16, 32, 8, 128, dtype=dtype, seed=42)
    out, ref = run_both(batch, 128 ** -0.5)
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("heads", [(4, 4), (32, 8)])
def test_gpu_flash_decode_long_context(dtype, tol, heads):
    seq_lens = [1, 17, 1000, 2051, 4000] + [300 + 97 * i for i in range(11)]
    for B in (1, 16):                                   # many splits, then few
        batch = make_batch([1] * B, seq_lens[-B:] if B == 1 else seq_lens, 16, *heads, 64, dtype=dtype, seed=B)
        out, ref = run_both(batch, 64 ** -0.5)
        dec = kernels.flash_decode(batch["query"], batch["key_cache"], batch["value_cache"],
                                   batch["block_tables"], batch["seq_lens"], 64 ** -0.5)
        torch.testing.assert_close(dec.cpu().double(), ref, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 64])
def test_gpu_float32_is_exact_enough(block_size):
    # float32 must not silently go through TF32 (10-bit mantissa) in tl.dot.
    batch = make_batch([1, 300, 7], [3000, 300, 900], block_size, 16, 2, 64, seed=9)
    out, ref = run_both(batch, 64 ** -0.5)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)
