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
from exercises.guarded import call

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
def check(batch, scale, tol=1e-4, inputs_unchanged=True):
    args = [batch[n] for n in ARGS]
    before = [a.clone() for a in args] if inputs_unchanged else []
    got = call(exercises.get("paged_decode"), *args, scale)
    query = batch["query"]
    assert isinstance(got, torch.Tensor) and got.shape == query.shape, \
        f"want out {tuple(query.shape)}, got {tuple(getattr(got, 'shape', ()))}"
    assert got.dtype == query.dtype, f"out must have the query's dtype {query.dtype}, got {got.dtype}"
    for name, a, b in zip(ARGS, args, before):          # (a cache of 4 GiB is checked by its own test)
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


# -- mistakes that the tests above cannot see ----------------------------------------------------------------
def far_batch(block_size, H, Hkv, D, dtype, seq_lens, seed):
    """Sequences whose blocks sit at the top of a cache of more than 2**32 elements: block * stride passes
    2**32, which an int32 offset wraps to a small offset inside the cache (untouched: zeros), a wrong block
    read every time (between 2**31 and 2**32 it would wrap to a negative address: a crash, or not). The
    storage comes from torch.empty and only the blocks used are written, so the 8 GiB of float16 are address
    space, not memory (on a GPU, memory)."""
    g = torch.Generator().manual_seed(seed)
    per = 2 * block_size * Hkv * D                            # K and V interleaved per block
    num_blocks = 2 ** 32 // per + 16
    storage = torch.empty(num_blocks, 2, block_size, Hkv, D, dtype=dtype, device=DEVICE)
    n_blocks = [math.ceil(L / block_size) for L in seq_lens]
    top = list(range(num_blocks - 1 - sum(n_blocks), num_blocks))
    random.Random(seed).shuffle(top)
    spare = top.pop()
    storage[sorted(top + [spare])] = float("nan")              # the blocks used, and the padding's: NaN first
    key_cache, value_cache = storage[:, 0], storage[:, 1]
    block_tables = torch.full((len(seq_lens), max(n_blocks) + 1), spare, dtype=torch.int32)
    keys, values = [], []
    for b, L in enumerate(seq_lens):
        block_tables[b, :n_blocks[b]] = torch.tensor([top.pop() for _ in range(n_blocks[b])], dtype=torch.int32)
        k, v = (torch.randn(L, Hkv, D, generator=g).to(dtype) for _ in range(2))
        pos = torch.arange(L)
        phys = block_tables[b, pos // block_size].long().to(DEVICE)
        key_cache[phys, (pos % block_size).to(DEVICE)] = k.to(DEVICE)
        value_cache[phys, (pos % block_size).to(DEVICE)] = v.to(DEVICE)
        keys.append(k)
        values.append(v)
    query = torch.randn(len(seq_lens), H, D, generator=g).to(dtype)
    return dict(query=query.to(DEVICE), key_cache=key_cache, value_cache=value_cache,
                block_tables=block_tables.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                                                                             device=DEVICE), keys=keys, values=values)


@pytest.mark.parametrize("config", ["mha_block16", "gqa_block8"])
def test_a_cache_past_two_to_the_32_elements(config):
    # int32 block tables and a block id near 2**32 / (block elements): compute the offset in int64
    block_size, H, Hkv = {"mha_block16": (16, 2, 2), "gqa_block8": (8, 4, 1)}[config]
    batch = far_batch(block_size, H, Hkv, 16, torch.float16, [20, 7], seed=block_size)
    check(batch, 0.25, tol=3e-3, inputs_unchanged=False)


@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_every_score_far_below_zero(heads):
    # each kv head's keys point away from its query heads: every score is about -900, and the softmax is still
    # well defined. A running max that starts at 0 (not -inf) underflows every exp(s - m) to 0: out = 0 / 0
    H, Hkv = HEADS[heads]
    batch = make_batch([11, 26], 4, H, Hkv, 16, seed=20)
    g = torch.Generator().manual_seed(21)
    for b, K in enumerate(batch["keys"]):
        u = torch.randn(Hkv, 16, generator=g)
        u = u / u.norm(dim=-1, keepdim=True)                                     # [Hkv, D] unit directions
        batch["query"][b] = (4 * u.repeat_interleave(H // Hkv, 0) + 0.1 * torch.randn(H, 16, generator=g)).to(DEVICE)
        K.copy_(-6 * u + 0.3 * torch.randn(K.shape, generator=g))
    check(restore(batch, 4), 40.0)


@pytest.mark.parametrize("seqs", [[9, 30], [17]])
def test_float16_products_that_overflow(seqs):
    # entries near 80: q . k near 0.64 * 80 * 80 * 32 = 131072, past float16's 65504, although the scaled score
    # (scale 1e-4) is small: compute q . k in float32
    batch = make_batch(seqs, 8, 4, 2, 32, dtype=torch.float16, seed=30)
    batch["query"] = (batch["query"].float().abs() * 80).half()
    batch["keys"] = [(K.float().abs() * 80).half() for K in batch["keys"]]
    check(restore(batch, 8), 1e-4, tol=3e-3)


@pytest.mark.parametrize("layout", ["heads_outside", "separate_pools"])
def test_a_value_cache_laid_out_unlike_the_key_cache(layout):
    # V's strides are V's own: here the value cache is a [num_blocks, Hkv, block_size, D] buffer seen through
    # a permuted view, or a pool of its own next to K's interleaved view
    batch = make_batch([19, 6], 8, 4, 2, 16, seed=40)
    v = batch["value_cache"]
    if layout == "heads_outside":
        batch["value_cache"] = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    else:
        batch["value_cache"] = v.contiguous()
    assert batch["value_cache"].stride() != batch["key_cache"].stride()
    check(batch, 0.3)


@pytest.mark.parametrize("D", [24, 12])
def test_the_output_is_written_only_inside_out(D):
    # a strided query (from a fused qkv) and a head_dim that is not a power of two: every store must land in
    # out, at out's strides, lanes d < head_dim only (the guards around out are checked after the call)
    batch = make_batch([10, 3, 21], 4, 4, 2, D, seed=D)
    qkv = torch.randn(3, 3 * 4, D, generator=torch.Generator().manual_seed(D)).to(DEVICE)
    batch["query"] = qkv[:, 8:12]
    check(batch, D ** -0.5)


def restore(batch, block_size):
    """``batch`` with its caches rewritten from its (changed) keys and values, block tables kept."""
    kc, vc = batch["key_cache"], batch["value_cache"]
    for b, (K, V) in enumerate(zip(batch["keys"], batch["values"])):
        pos = torch.arange(K.shape[0])
        phys = batch["block_tables"][b, pos // block_size].long().to(kc.device)
        kc[phys, (pos % block_size).to(kc.device)] = K.to(kc.device)
        vc[phys, (pos % block_size).to(kc.device)] = V.to(kc.device)
    return batch
