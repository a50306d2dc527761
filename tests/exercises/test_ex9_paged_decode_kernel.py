"""Exercise 9, graded: the paged decode kernel (exercises/ex9_paged_decode_kernel.py).

The oracle is dense float64 attention over each sequence's keys and values kept
*contiguous*; the paged cache holds the same keys and values scattered over
shuffled physical blocks of a pool three times larger than needed, K and V
interleaved per block (so the layer views are strided). Every cache slot no
sequence owns is NaN, and so is the block every padding entry of the block
tables points at: a kernel that loads one (even with weight 0) shows NaN.
Lengths are not multiples of the block size; head layouts MHA, GQA and MQA.

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is decorated), so the shapes stay small;
float32 and float16 only (bf16 is unreliable in the interpreter).
"""
import math
import random

import pytest
import torch

import exercises

pytest.importorskip("triton", reason="exercise 9 needs Triton (Linux)")
pytestmark = pytest.mark.ex9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def make_batch(seq_lens, block_size, H, Hkv, D, dtype=torch.float32, seed=0, idx_dtype=torch.int32):
    """One decode query per sequence, and a paged cache holding each sequence's K/V at shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    n_blocks = [math.ceil(L / block_size) for L in seq_lens]
    num_blocks = 3 * sum(n_blocks) + 4                         # a pool much larger than needed
    storage = torch.full((num_blocks, 2, block_size, Hkv, D), float("nan"), dtype=dtype)
    key_cache, value_cache = storage[:, 0], storage[:, 1]      # strided views: K and V interleaved per block
    perm = torch.randperm(num_blocks, generator=g)
    spare = int(perm[-1])                                      # a block nobody owns: all NaN
    block_tables = torch.full((B, max(n_blocks) + 2), spare, dtype=idx_dtype)   # padding -> the NaN block
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
    query = torch.randn(B, H, D, generator=g).to(dtype)
    storage = storage.to(DEVICE)
    return dict(query=query.to(DEVICE), key_cache=storage[:, 0], value_cache=storage[:, 1],
                block_tables=block_tables.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=idx_dtype, device=DEVICE),
                keys=keys, values=values)


def dense(batch, scale):
    """float64 softmax(scale * q k^T) v per sequence, on its contiguous K/V; query head h reads kv head h // G."""
    query = batch["query"].cpu().double()
    out = torch.empty_like(query)
    for b, (K, V) in enumerate(zip(batch["keys"], batch["values"])):
        G = query.shape[1] // K.shape[1]
        K, V = (x.double().repeat_interleave(G, dim=1) for x in (K, V))      # [L, H, D]
        p = (torch.einsum("hd,lhd->hl", query[b], K) * scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", p, V)
    return out


ARGS = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")


def check(batch, scale, tol=1e-4):
    args = [batch[n] for n in ARGS]
    before = [a.clone() for a in args]
    got = exercises.get("paged_decode")(*args, scale)
    query = batch["query"]
    assert isinstance(got, torch.Tensor) and got.shape == query.shape, \
        f"want out {tuple(query.shape)}, got {tuple(getattr(got, 'shape', ()))}"
    assert got.dtype == query.dtype, f"out must have the query's dtype {query.dtype}, got {got.dtype}"
    for name, a, b in zip(ARGS, args, before):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), \
            f"the kernel changed its input {name}"
    nan = got.isnan()
    assert not nan.any(), (f"NaN in the output at {nan.nonzero()[:4].tolist()} ([sequence, head, d]): a slot past "
                           f"seq_len or a padding entry of the block table was read (0 x NaN is NaN), exp() "
                           f"overflowed (no running max), or an output was never stored")
    want = dense(batch, scale)
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol,
                               msg=lambda m: f"vs dense attention on the contiguous K/V: {m}")


def test_one_sequence_part_full_block():
    # 5 keys in one block of 8: the 3 slots after them are NaN
    check(make_batch([5], 8, 2, 2, 16, seed=1), 0.25)


def test_large_scores_need_the_running_max():
    # scale 20: scores in the hundreds, exp() without the running max overflows; over many blocks the max
    # grows, and the sums of the earlier blocks must be rescaled by exp(m_old - m_new). GQA, 2 heads per kv
    # head. (Second in the file: it catches most slips early, which keeps the honesty test's -x runs short.)
    check(make_batch([45, 29], 4, 4, 2, 16, seed=5), 20.0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_lengths_not_multiples_of_the_block_size(block_size):
    # one key (the new token alone), exactly one block, one past it, long ones across many blocks
    check(make_batch([1, 37, 9, 16, 17], block_size, 4, 4, 16, seed=block_size), 16 ** -0.5)


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_grouped_query_heads(heads):
    # query head h reads kv head h // (H // Hkv): 4 query heads per kv head, then all on one
    H, Hkv = HEADS[heads]
    check(make_batch([13, 30, 7], 8, H, Hkv, 16, seed=3), 0.3)


def test_head_dim_not_a_power_of_two():
    # D = 24 runs in BLOCK_D = 32 lanes: the last 8 must be masked on every load and store
    check(make_batch([19, 6], 8, 8, 2, 24, seed=4), 24 ** -0.5)


def test_scale_is_the_one_given():
    # not 1/sqrt(D): the scale multiplies q . k once
    check(make_batch([21, 11], 8, 4, 2, 16, seed=6), 1.7)


def test_float16():
    check(make_batch([26, 9], 8, 8, 2, 32, dtype=torch.float16, seed=7), 32 ** -0.5, tol=3e-3)


def test_int64_metadata_and_strided_query():
    batch = make_batch([33, 12], 16, 4, 2, 16, seed=8, idx_dtype=torch.int64)
    qkv = torch.randn(2, 3 * 4, 16, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    batch["query"] = qkv[:, 4:8]                               # a non-contiguous view, as from a qkv split
    check(batch, 0.2)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_batches(seed):
    rng = random.Random(seed)
    heads = rng.choice(list(HEADS))
    seq_lens = [rng.randrange(1, 33) for _ in range(rng.randrange(1, 4))]
    check(make_batch(seq_lens, rng.choice([4, 8, 16]), *HEADS[heads], 16, seed=10 + seed), rng.uniform(0.1, 1.0))
