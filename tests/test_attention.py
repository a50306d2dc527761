"""KV cache tensors, slot mapping, store, and the paged attention backends against a dense reference.

The grid follows vLLM's kernel tests: decode (1 query, long context), prefill, chunked prefill (queries
after earlier context), speculative verify (k + 1 queries), and all of them mixed; MHA, GQA and MQA;
block sizes 8/16/32; lengths that are not multiples of the block size; block tables drawn shuffled from a
pool four times larger than needed; every slot no sequence owns filled with NaN, so reading one shows.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from minibatch.kv.attention import BACKENDS, AttentionMetadata, PagedAttention
from minibatch.kv.backends import paged_attention_batched, paged_attention_loop, store_kv_torch
from minibatch.kv.block_allocator import BlockAllocator
from minibatch.kv.kv_cache import KVCache, block_table_tensor, slot_mapping
from minibatch.model.model import GPT, DenseAttention, get_config


def _has_triton_kernels():
    try:
        import kernels
    except Exception:
        return False
    return hasattr(kernels, "paged_attention") and hasattr(kernels, "store_kv")


pytestmark = pytest.mark.usefixtures("one_thread")


HAS_KERNELS = _has_triton_kernels()
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="kernels.paged_attention / store_kv not available")

# (q_len, seq_len) per sequence
CASES = {
    "decode": [(1, 37), (1, 5), (1, 64), (1, 1)],
    "prefill": [(7, 7), (16, 16), (23, 23)],
    "chunked": [(9, 29), (16, 48), (3, 11)],
    "verify": [(5, 30), (5, 22)],                  # every row in sequences of one q_len: read in place
    "one chunk": [(9, 29)],
    "equal chunks": [(4, 4), (4, 19), (4, 33)],
    "mixed": [(1, 37), (23, 23), (9, 29), (5, 30), (1, 1)],
}
HEADS = [(4, 4), (8, 2), (8, 1)]          # MHA, GQA, MQA
D = 32


def make_batch(case, H, Hkv, bs, seed=0, prefill_new=True):
    """Random signed K/V/Q; a shuffled pool; NaN in every slot no sequence owns.

    prefill_new: also write this step's (new) tokens' K/V into the cache (the raw attention functions
    expect them stored already; PagedAttention stores them itself).
    """
    g = torch.Generator().manual_seed(seed)
    spec = CASES[case]
    need = [-(-L // bs) for _, L in spec]
    num_blocks = 4 * sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    key_cache = torch.full((num_blocks, bs, Hkv, D), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    K = [torch.randn(L, Hkv, D, generator=g) for _, L in spec]
    V = [torch.randn(L, Hkv, D, generator=g) for _, L in spec]
    for (n, L), t, k, v in zip(spec, tables, K, V):
        for p in range(L if prefill_new else L - n):
            key_cache[t[p // bs], p % bs], value_cache[t[p // bs], p % bs] = k[p], v[p]
    q = torch.randn(sum(n for n, _ in spec), H, D, generator=g)
    return spec, tables, key_cache, value_cache, K, V, q


def reference(spec, K, V, q, H, Hkv):
    """Per sequence, on its contiguous K/V: SDPA with the causal-offset mask (query i at L - n + i)."""
    out, s = [], 0
    for (n, L), k, v in zip(spec, K, V):
        k, v = (x.repeat_interleave(H // Hkv, dim=1).transpose(0, 1) for x in (k, v))   # [H, L, D]
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]             # [n, L]
        out.append(F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1), k, v, attn_mask=mask)
                   .transpose(0, 1))
        s += n
    return torch.cat(out)


def metadata_tensors(spec, tables):
    bt = block_table_tensor([t + [-1] for t in tables])             # an extra padding column, never read
    seq_lens = torch.tensor([L for _, L in spec], dtype=torch.int32)
    qsl = torch.tensor([0] + [sum(n for n, _ in spec[:i + 1]) for i in range(len(spec))], dtype=torch.int32)
    return bt, seq_lens, qsl


@pytest.mark.parametrize("fn", [paged_attention_loop, paged_attention_batched], ids=["loop", "batched"])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("H, Hkv", HEADS)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_equals_dense_reference(fn, case, H, Hkv, bs):
    spec, tables, kc, vc, K, V, q = make_batch(case, H, Hkv, bs, seed=bs + H + Hkv)
    bt, seq_lens, qsl = metadata_tensors(spec, tables)
    out = fn(q, kc, vc, bt, seq_lens, qsl, 1 / math.sqrt(D))
    assert out.shape == q.shape and not out.isnan().any()
    torch.testing.assert_close(out, reference(spec, K, V, q, H, Hkv), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fn", [paged_attention_loop, paged_attention_batched], ids=["loop", "batched"])
def test_a_nan_in_a_slot_that_is_read_shows(fn):
    """The NaN fill above proves something only if reading a NaN slot would show."""
    spec, tables, kc, vc, K, V, q = make_batch("mixed", 8, 2, 8)
    bt, seq_lens, qsl = metadata_tensors(spec, tables)
    kc[tables[0][-1], (spec[0][1] - 1) % 8] = float("nan")           # sequence 0's last position
    out = fn(q, kc, vc, bt, seq_lens, qsl, 1 / math.sqrt(D))
    assert out[0].isnan().all() and not out[1:].isnan().any()


@pytest.mark.parametrize("fn", [paged_attention_loop, paged_attention_batched], ids=["loop", "batched"])
def test_scale_is_applied(fn):
    spec, tables, kc, vc, K, V, q = make_batch("chunked", 4, 4, 16)
    bt, seq_lens, qsl = metadata_tensors(spec, tables)
    out = fn(q, kc, vc, bt, seq_lens, qsl, 0.3)
    torch.testing.assert_close(out, reference(spec, K, V, q * 0.3 * math.sqrt(D), 4, 4), atol=1e-4, rtol=1e-4)


# -- through PagedAttention: store the new tokens, then attend, for every backend ---------------------
def run_backend(backend, case, H, Hkv, bs, seed=0):
    spec, tables, kc, vc, K, V, q = make_batch(case, H, Hkv, bs, seed=seed, prefill_new=False)
    cache = KVCache(1, kc.shape[0], bs, Hkv, D)
    cache.kv[0, 0], cache.kv[0, 1] = kc, vc
    md = AttentionMetadata.build(tables, [L - n for n, L in spec], [n for n, _ in spec], bs)
    k_new = torch.cat([k[L - n:] for (n, L), k in zip(spec, K)])
    v_new = torch.cat([v[L - n:] for (n, L), v in zip(spec, V)])
    out = PagedAttention(cache, md, backend)(0, q, k_new, v_new)
    torch.testing.assert_close(out, reference(spec, K, V, q, H, Hkv), atol=1e-4, rtol=1e-4)
    for (n, L), t, k in zip(spec, tables, K):                       # the new K landed in their slots
        for p in range(L - n, L):
            assert torch.equal(cache.kv[0, 0, t[p // bs], p % bs], k[p])


@pytest.mark.parametrize("backend", ["loop", "batched"])
@pytest.mark.parametrize("bs", [8, 32])
@pytest.mark.parametrize("H, Hkv", HEADS)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_backend_stores_then_attends(backend, case, H, Hkv, bs):
    run_backend(backend, case, H, Hkv, bs)


@needs_kernels
@pytest.mark.interpreter
@pytest.mark.parametrize("H, Hkv", HEADS)
@pytest.mark.parametrize("case, bs", [("mixed", 8), ("decode", 16), ("chunked", 32)])
def test_triton_backend_stores_then_attends(case, H, Hkv, bs):
    run_backend("triton", case, H, Hkv, bs)


def test_unknown_backend_lists_the_choices():
    cache = KVCache(1, 4, 4, 1, D)
    md = AttentionMetadata.build([[0]], [0], [1], 4)
    with pytest.raises(ValueError, match="triton"):
        PagedAttention(cache, md, "flash")
    assert BACKENDS == ("loop", "batched", "triton", "cpu")


def test_a_failed_call_leaves_the_cache_unchanged():
    cache = KVCache(2, 4, 4, 2, D, debug_nan=True)
    md = AttentionMetadata.build([[1, 3]], [3], [2], 4)
    attn = PagedAttention(cache, md, "loop", debug=True)      # per-layer checks are a debug switch: the model
    q, kv = torch.randn(2, 4, D), torch.randn(2, 2, D)
    before = cache.kv.clone()
    bad_calls = [(0, q, torch.randn(2, 1, D), kv),          # wrong kv heads
                 (0, q, kv, torch.randn(3, 2, D)),          # wrong T
                 (0, torch.randn(2, 3, D), kv, kv),         # 3 heads over 2 kv heads
                 (0, q.double(), kv, kv),                   # dtype
                 (2, q, kv, kv)]                            # no layer 2
    for args in bad_calls:
        with pytest.raises((ValueError, TypeError)):
            attn(*args)
    assert torch.equal(before.isnan(), cache.kv.isnan())   # nothing written
    with pytest.raises(ValueError, match="holds block 4, but the cache has 4 blocks"):
        PagedAttention(cache, AttentionMetadata.build([[1, 4]], [3], [2], 4), "loop")   # checked once, always


# -- validation of the raw functions -------------------------------------------------------------
@pytest.mark.parametrize("fn", [paged_attention_loop, paged_attention_batched], ids=["loop", "batched"])
def test_bad_attention_inputs_raise_clear_errors(fn):
    spec, tables, kc, vc, K, V, q = make_batch("mixed", 8, 2, 8)
    bt, sl, qsl = metadata_tensors(spec, tables)
    s = 1 / math.sqrt(D)
    bad_bt = bt.clone()
    bad_bt[0, 0] = kc.shape[0]
    cases = [((q.double(), kc, vc, bt, sl, qsl, s), TypeError, "must match"),
             ((q.to("meta"), kc, vc, bt, sl, qsl, s), TypeError, "must match"),
             ((q[:, :3], kc, vc, bt, sl, qsl, s), ValueError, "multiple"),
             ((q[:, :, :16], kc, vc, bt, sl, qsl, s), ValueError, "kv heads"),
             ((q, kc, vc[:, :, :1], bt, sl, qsl, s), ValueError, "key_cache and value_cache"),
             ((q, kc, vc, bad_bt, sl, qsl, s), ValueError, "outside"),
             ((q, kc, vc, bt, sl - 30, qsl, s), ValueError, "seq_lens"),
             ((q, kc, vc, bt, sl, qsl[:-1], s), ValueError, "query_start_loc"),
             ((q[:-1], kc, vc, bt, sl, qsl, s), ValueError, "T ="),
             ((q, kc, vc, bt[:, :3], sl, qsl, s), ValueError, "more blocks"),
             ((q, kc, vc, bt.float(), sl, qsl, s), TypeError, "int32"),
             ((q, kc, vc, bt, sl, qsl, float("nan")), TypeError, "scale")]
    for args, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn(*args)


def test_store_kv_torch_writes_exactly_its_slots():
    kc, vc = torch.full((3, 4, 2, D), float("nan")), torch.full((3, 4, 2, D), float("nan"))
    k, v = torch.randn(4, 2, D), torch.randn(4, 2, D)
    store_kv_torch(k, v, kc, vc, torch.tensor([9, -1, 0, 4]))
    assert torch.equal(kc[2, 1], k[0]) and torch.equal(kc[0, 0], k[2]) and torch.equal(vc[1, 0], v[3])
    written = {(2, 1), (0, 0), (1, 0)}
    for b in range(3):
        for o in range(4):
            assert kc[b, o].isnan().all() == ((b, o) not in written)


def test_store_kv_torch_rejects_bad_input_and_writes_nothing():
    kc, vc = torch.zeros(3, 4, 2, D), torch.zeros(3, 4, 2, D)
    k, v = torch.randn(2, 2, D), torch.randn(2, 2, D)
    cases = [((k, v, kc, vc, torch.tensor([1, 1])), "one slot"),
             ((k, v, kc, vc, torch.tensor([1, 12])), "outside"),
             ((k, v, kc, vc, torch.tensor([1, -2])), "outside"),
             ((k, v, kc, vc, torch.tensor([1])), "slot_mapping"),
             ((k, v[:, :1], kc, vc, torch.tensor([0, 1])), "value"),
             ((k.double(), v, kc, vc, torch.tensor([0, 1])), "float64"),
             ((k, v, torch.zeros(3, 4, 2, 2 * D)[..., :D], vc, torch.tensor([0, 1])), "contiguous")]
    for args, msg in cases:
        with pytest.raises((ValueError, TypeError), match=msg):
            store_kv_torch(*args)
    assert not kc.any() and not vc.any()


# -- the KV cache tensors and the slot mapping -------------------------------------------------------
def test_kv_cache_layout_and_views():
    c = KVCache(3, 5, 4, 2, 8)
    assert c.kv.shape == (3, 2, 5, 4, 2, 8) and c.dtype == torch.float32 and not c.kv.any()
    c.key_cache(1)[2, 3] = 1.0                         # views alias the one tensor
    c.value_cache(2)[0, 0] = 2.0
    assert c.kv[1, 0, 2, 3].eq(1).all() and c.kv[2, 1, 0, 0].eq(2).all() and c.kv.sum() == 16 + 32
    assert KVCache(1, 2, 4, 1, 8, debug_nan=True).kv.isnan().all()
    with pytest.raises(ValueError):
        c.key_cache(3)
    with pytest.raises(ValueError):
        KVCache(0, 5, 4, 2, 8)
    with pytest.raises(ValueError, match="power of two"):
        KVCache(1, 5, 6, 2, 8)
    with pytest.raises(ValueError, match="block_size"):
        slot_mapping([[0]], [0], [1], 0)


def test_copy_blocks_copies_every_layer_k_and_v_and_nothing_else():
    c = KVCache(2, 6, 4, 2, 8)
    c.kv.copy_(torch.randn_like(c.kv))
    before = c.kv.clone()
    c.copy_blocks([(1, 4), (3, 0)])
    assert torch.equal(c.kv[:, :, 4], before[:, :, 1]) and torch.equal(c.kv[:, :, 0], before[:, :, 3])
    for b in (1, 2, 3, 5):
        assert torch.equal(c.kv[:, :, b], before[:, :, b])
    c.copy_blocks([])
    for bad in ([(1, 6)], [(1, 2), (3, 2)], [(1, 2), (2, 3)], [(1,)]):
        with pytest.raises(ValueError):
            c.copy_blocks(bad)


def test_bytes_per_block_and_memory_budget():
    assert KVCache.bytes_per_block(4, 16, 4, 64, torch.float32) == 2 * 4 * 16 * 4 * 64 * 4
    assert KVCache.bytes_per_block(4, 16, 4, 64, torch.bfloat16) == 2 * 4 * 16 * 4 * 64 * 2
    per = KVCache.bytes_per_block(2, 8, 2, 16, torch.float32)
    c = KVCache.from_memory_budget(10 * per + per - 1, 2, 8, 2, 16, torch.float32, "cpu")
    assert c.num_blocks == 10 and c.kv.shape == (2, 2, 10, 8, 2, 16)
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.from_memory_budget(per - 1, 2, 8, 2, 16, torch.float32, "cpu")


def test_slot_mapping_and_block_table_tensor():
    sm = slot_mapping([[5, 2], [7]], starts=[3, 0], counts=[3, 2], block_size=4)
    assert sm.dtype == torch.int64 and sm.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 7 * 4 + 0, 7 * 4 + 1]
    with pytest.raises(ValueError, match="block table has 1"):
        slot_mapping([[7]], [3], [2], 4)               # position 4 needs a second block
    bt = block_table_tensor([[5, 2], [7], []])
    assert bt.dtype == torch.int32 and bt.tolist() == [[5, 2], [7, -1], [-1, -1]]


def test_attention_metadata_build():
    md = AttentionMetadata.build([[5, 2], [7], [1, 3, 4]], num_computed=[3, 0, 8], num_new=[3, 2, 1],
                                 block_size=4)
    assert md.slot_mapping.tolist() == [23, 8, 9, 28, 29, 16]
    assert md.seq_lens.tolist() == [6, 2, 9] and md.query_start_loc.tolist() == [0, 3, 5, 6]
    assert md.block_tables.tolist() == [[5, 2, -1], [7, -1, -1], [1, 3, 4]]
    assert (md.max_query_len, md.max_seq_len) == (3, 9)
    assert md.seq_lens.dtype == md.query_start_loc.dtype == md.block_tables.dtype == torch.int32
    with pytest.raises(ValueError):
        AttentionMetadata.build([[5]], [0], [0], 4)
    with pytest.raises(ValueError):
        AttentionMetadata.build([[5]], [0, 1], [1], 4)


# -- the model end to end: chunked prefill, decodes, a prefix-cache hit, a fork --------------------
def serve_like_an_engine(model, seqs, prompt_lens, chunks, admit_at, forks, backend, bs=8):
    """Feed every sequence through a BlockAllocator + KVCache + PagedAttention, step by step.

    seqs[i]: the whole token list (prompt, then the tokens "sampled" later, teacher-forced);
    chunks[i]: its prefill chunk size; admit_at[i]: the step it arrives; forks: {child: (parent, step)},
    a child holding the parent's prompt and its own continuation. Returns {seq: {position: logits}}.
    """
    cfg = model.config
    alloc = BlockAllocator(64, bs)
    cache = KVCache(cfg.n_layer, 64, bs, cfg.num_kv_heads, cfg.head_dim, debug_nan=True)
    logits, done, step = {i: {} for i in range(len(seqs))}, set(), 0
    computed = {}                                                     # seq -> tokens whose K/V is written
    while len(done) < len(seqs):
        for child, (parent, at) in forks.items():
            if at == step:
                alloc.fork(parent, child)
                computed[child] = computed[parent]
        for i in range(len(seqs)):
            if admit_at.get(i) == step:
                computed[i] = alloc.allocate(i, seqs[i][:prompt_lens[i]])
        batch, copies = [], []
        for i in range(len(seqs)):
            if i in done or not alloc.has_seq(i):
                continue
            c = computed[i]
            if c < prompt_lens[i]:                                   # a prefill chunk
                n = min(chunks[i], prompt_lens[i] - c)
            else:                                                    # a decode: a slot for one more token
                copies += alloc.append_slots(i, 1)
                n = 1
            batch.append((i, c, n))
        cache.copy_blocks(copies)                                    # copy-on-write before the forward
        md = AttentionMetadata.build([alloc.block_table(i) for i, _, _ in batch], [c for _, c, _ in batch],
                                     [n for _, _, n in batch], bs)
        ids = torch.tensor([t for i, c, n in batch for t in seqs[i][c:c + n]])
        pos = torch.tensor([p for i, c, n in batch for p in range(c, c + n)])
        with torch.no_grad():
            out = model(ids, pos, PagedAttention(cache, md, backend))
        row = 0
        for i, c, n in batch:
            for p in range(c, c + n):
                logits[i][p] = out[row]
                row += 1
            computed[i] = c + n
            alloc.mark_computed(i, c + n, seqs[i])
            if c + n == len(seqs[i]):
                done.add(i)
        alloc.check_invariants()
        step += 1
    return logits, alloc


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=[needs_kernels, pytest.mark.interpreter]),
                                     "loop", "batched"])
def test_model_logits_through_the_paged_cache_equal_the_dense_reference(backend):
    torch.manual_seed(0)
    model = GPT(get_config("target")).eval()
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()   # noqa: E731
    s0 = rand(25)
    seqs = [s0, rand(19), rand(9), s0[:16] + rand(9), s0[:21] + rand(4)]
    prompt_lens = [21, 16, 5, 23, 21]
    chunks = [8, 16, 3, 5, 21]
    admit_at = {0: 0, 1: 0, 2: 1, 3: 3}                  # seq 3 arrives when s0's first 2 blocks are cached
    forks = {4: (0, 3)}                                  # seq 4: parallel sample of seq 0 after its prompt
    if backend == "triton":                              # the interpreter is slow: fewer decode steps
        seqs = [s[:p + 1] for s, p in zip(seqs, prompt_lens)]
    got, alloc = serve_like_an_engine(model, seqs, prompt_lens, chunks, admit_at, forks, backend)
    assert alloc.hits >= 2                               # seq 3 did reuse s0's cached blocks
    with torch.no_grad():
        ref = model(torch.tensor([t for s in seqs for t in s]),
                    torch.tensor([p for s in seqs for p in range(len(s))]),
                    DenseAttention([len(s) for s in seqs])).split([len(s) for s in seqs])
    for i, s in enumerate(seqs):
        assert got[i], f"sequence {i} was never computed"
        for p, row in got[i].items():
            torch.testing.assert_close(row, ref[i][p], atol=1e-4, rtol=1e-4, msg=f"seq {i} position {p}")
    assert min(got[3]) == 16 and min(got[4]) == 21      # the cached prefix / the fork skipped computing
