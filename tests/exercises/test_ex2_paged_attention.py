"""Exercise 2, graded: paged attention (exercises/ex2_paged_attention.py).

The oracle is dense attention (torch's scaled_dot_product_attention) over each
sequence's keys and values kept *contiguous*, with the causal mask shifted by
the cached context. The paged cache holds the same keys and values, scattered
over shuffled physical blocks; every slot no sequence owns is NaN, so an
implementation that reads one (even with weight 0) fails.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import exercises

pytestmark = pytest.mark.ex2


def make_batch(specs, bs, H, Hkv, D, seed=0, dtype=torch.float32, extra_cols=0, index_dtype=torch.int32):
    """specs: (seq_len, q_len) per sequence. Returns the paged inputs and the contiguous K/V per sequence."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-L // bs) for L, _ in specs]
    N = sum(nblocks) + 3                                        # a few blocks nobody owns
    perm = torch.randperm(N, generator=g).tolist()               # physical blocks, shuffled
    key_cache = torch.full((N, bs, Hkv, D), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    tables = torch.full((len(specs), max(nblocks) + extra_cols), -1, dtype=index_dtype)
    ks, vs = [], []
    for b, ((L, _), nb) in enumerate(zip(specs, nblocks)):
        blocks = [perm.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(blocks)
        k = torch.randn(L, Hkv, D, generator=g).to(dtype)        # signed values, contiguous positions 0..L-1
        v = torch.randn(L, Hkv, D, generator=g).to(dtype)
        pos = torch.arange(L)
        slots = torch.tensor(blocks)[pos // bs] * bs + pos % bs
        key_cache.view(N * bs, Hkv, D)[slots] = k
        value_cache.view(N * bs, Hkv, D)[slots] = v
        ks.append(k)
        vs.append(v)
    q_lens = [n for _, n in specs]
    qsl = torch.tensor([0] + q_lens, dtype=index_dtype).cumsum(0).to(index_dtype)
    seq_lens = torch.tensor([L for L, _ in specs], dtype=index_dtype)
    query = torch.randn(sum(q_lens), H, D, generator=g).to(dtype)
    return (query, key_cache, value_cache, tables, seq_lens, qsl), ks, vs


def dense_oracle(query, ks, vs, specs, scale):
    """Per sequence: SDPA with query i at position L - n + i seeing positions 0..L - n + i."""
    outs, s = [], 0
    for (L, n), k, v in zip(specs, ks, vs):
        q = query[s:s + n].double().transpose(0, 1)                        # [H, n, D]
        G = q.shape[0] // k.shape[1]
        kk = k.double().repeat_interleave(G, dim=1).transpose(0, 1)        # [H, L, D]: head h -> kv head h // G
        vv = v.double().repeat_interleave(G, dim=1).transpose(0, 1)
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]  # [n, L]
        outs.append(F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1))
        s += n
    return torch.cat(outs)


def check(specs, bs, H, Hkv, D=8, scale=None, atol=2e-5, rtol=1e-4, **kw):
    inputs, ks, vs = make_batch(specs, bs, H, Hkv, D, **kw)
    scale = 1 / math.sqrt(D) if scale is None else scale
    got = exercises.get("paged_attention")(*inputs, scale)
    query = inputs[0]
    assert isinstance(got, torch.Tensor) and got.shape == query.shape, \
        f"want out {tuple(query.shape)}, got {tuple(getattr(got, 'shape', ()))}"
    assert got.dtype == query.dtype, f"out must have the query's dtype {query.dtype}, got {got.dtype}"
    assert not got.isnan().any(), ("NaN in the output: a slot past seq_len (or a masked one) leaked into the sum "
                                   "(0 x NaN is NaN), or exp() overflowed (subtract the row's max first)")
    want = dense_oracle(query, ks, vs, specs, scale).to(got.dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"vs dense attention: {m}")


def test_decode_one_sequence():
    # one query at position 6 sees all 7 positions; the last block is part-full (7 = 4 + 3)
    check([(7, 1)], bs=4, H=2, Hkv=2)


def test_prefill_is_causal():
    check([(6, 6)], bs=4, H=2, Hkv=2)


def test_chunk_after_cached_context():
    # a later prefill chunk: 4 queries at positions 7..10 see the 7 cached positions too
    check([(11, 4)], bs=4, H=2, Hkv=2)


def test_mixed_batch_with_gqa():
    # decode, full prefill, chunk, a one-token sequence, a speculative check (1 + 3 queries); 6 heads on 2 kv heads
    check([(9, 1), (5, 5), (13, 3), (1, 1), (6, 4)], bs=4, H=6, Hkv=2, seed=1)


def test_multi_query_attention_one_kv_head():
    check([(10, 2), (3, 3), (8, 1)], bs=3, H=4, Hkv=1, seed=2)


def test_scale_is_the_one_given():
    check([(9, 3), (4, 1)], bs=4, H=4, Hkv=2, scale=1.7, seed=3)


def test_block_size_one_int64_metadata_padded_tables():
    # block tables wider than needed (-1 padding), int64 metadata, one token per block
    check([(5, 2), (3, 1)], bs=1, H=2, Hkv=1, extra_cols=2, index_dtype=torch.int64, seed=4)


def test_float64_in_float64_out():
    check([(7, 3), (2, 1)], bs=2, H=4, Hkv=2, dtype=torch.float64, seed=5)


def test_large_scores_need_a_stable_softmax():
    # scale 40: scores in the hundreds, so exp() without subtracting the row's max overflows to inf (and
    # inf / inf is NaN); the scale is again not 1/sqrt(D). Decode, chunk and prefill rows, GQA.
    check([(12, 1), (9, 4), (5, 5)], bs=4, H=4, Hkv=2, scale=40.0, seed=6, atol=1e-4)


def test_float16_in_float16_out():
    # half precision in, half precision out (compute in float32 inside); a decode, a chunk and GQA
    check([(10, 1), (7, 3)], bs=4, H=4, Hkv=2, dtype=torch.float16, seed=7, atol=2e-3, rtol=2e-3)
