"""Tree attention (SpecInfer, Miao et al. 2024, §4.1): a token tree verified in one forward, in every backend.

The oracle knows nothing of masks or pages: every root-to-leaf path of a tree is an ordinary sequence (the
context, then the path's nodes at consecutive positions), so dense causal attention over that chain, on the
K/V gathered from the plain per-sequence tensors, is what each node on the path must get. Every node lies on
some path, so every row is checked. The batches mix trees with a prefill, a later chunk and decodes; block
sizes 4/8/16 with contexts that are not multiples of them, so trees cross block boundaries; block tables
drawn shuffled from a pool four times too big; NaN in every slot no sequence owns; signed random values.
"""
import random

import pytest
import torch

from minibatch.kv import backends
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.kv.kv_cache import KVCache
from minibatch.kv import tree


pytestmark = pytest.mark.usefixtures("one_thread")


def _has_kernels():
    try:
        import kernels  # noqa: F401
        return True
    except Exception:
        return False


needs_kernels = pytest.mark.skipif(not _has_kernels(), reason="kernels (Triton) not available")


def random_parents(n, rng):
    return [-1] + [rng.randrange(i) for i in range(1, n)]


SHAPES = {    # name -> parent list (the sequence's new tokens: root + drafts)
    "chain": tree.chain_parents(8),
    "star": [-1] + [0] * 11,
    "root_only": [-1],
    "random": random_parents(20, random.Random(1)),
    "random64": random_parents(64, random.Random(2)),
    "bushy": [-1, 0, 0, 0, 1, 1, 2, 3, 3, 4, 4, 6, 7, 9, 9, 10],
}


def make_step(seqs, H, Hkv, D, bs, seed=0, dtype=torch.float32, device="cpu"):
    """seqs: per sequence (context_len, parents or a number of new tokens). Returns the metadata (built with
    tree_parents), a NaN-filled paged cache holding every sequence's K/V (this step's too), the query, and the
    sequences' own contiguous K/V [L, Hkv, D] (float64 on the CPU) for the oracle."""
    g = torch.Generator().manual_seed(seed)
    ctx = [c for c, _ in seqs]
    new = [len(p) if isinstance(p, list) else p for _, p in seqs]
    parents = [p if isinstance(p, list) else None for _, p in seqs]
    need = [-(-(c + n) // bs) for c, n in zip(ctx, new)]
    num_blocks = 4 * sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[sum(need[:b]):sum(need[:b + 1])] for b in range(len(seqs))]
    kc = torch.full((num_blocks, bs, Hkv, D), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    K = [torch.randn(c + n, Hkv, D, generator=g).to(dtype) for c, n in zip(ctx, new)]
    V = [torch.randn(c + n, Hkv, D, generator=g).to(dtype) for c, n in zip(ctx, new)]
    for t, k, v in zip(tables, K, V):
        for p in range(k.shape[0]):
            kc[t[p // bs], p % bs], vc[t[p // bs], p % bs] = k[p].float(), v[p].float()
    q = torch.randn(sum(new), H, D, generator=g).to(dtype)
    tp = parents if any(p is not None for p in parents) else None
    md = AttentionMetadata.build(tables, ctx, new, bs, device=device, tree_parents=tp)
    return (md, kc.to(dtype).to(device), vc.to(dtype).to(device), q.to(device),
            [k.double() for k in K], [v.double() for v in V], parents)


def dense_causal(q, k, v, scale):
    """q [n, H, D] are the last n of the chain k, v [L, Hkv, D]: plain causal softmax attention, float64."""
    n, H, _ = q.shape
    k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))            # [L, H, D]
    L = k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale                         # [H, n, L]
    s = s.masked_fill(torch.arange(L)[None] > torch.arange(L - n, L)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def oracle(md, q, K, V, parents, scale):
    """Every row by dense causal attention on chains: an ordinary sequence is one; a tree is one per leaf."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    qsl = md.query_start_loc.tolist()
    for b, (k, v, par) in enumerate(zip(K, V, parents)):
        s, e = qsl[b], qsl[b + 1]
        c = k.shape[0] - (e - s)
        if par is None:
            out[s:e] = dense_causal(q[s:e].cpu(), k, v, scale)
            continue
        for leaf in set(range(len(par))) - set(par):
            path = [leaf]
            while path[-1] != 0:
                path.append(par[path[-1]])
            path = path[::-1]                                        # root .. leaf, node indices
            idx = torch.tensor(list(range(c)) + [c + i for i in path])   # the chain's cache indices
            rows = torch.tensor(path) + s
            got = dense_causal(q[rows].cpu(), k[idx], v[idx], scale)
            seen = ~out[rows].isnan()                                # nodes shared with an earlier path
            assert torch.allclose(out[rows][seen], got[seen])        # get one answer on every path
            out[rows] = got
    assert not out.isnan().any()
    return out


def attend(backend, md, kc, vc, q, scale):
    if backend == "loop":
        fn = backends.paged_attention_loop
    elif backend == "batched":
        fn = backends.paged_attention_batched
    else:
        import kernels
        fn = kernels.paged_attention
    return fn(q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc, scale, tree_bits=md.tree_bits)


def mixed(shape, c=13):
    """A tree after c context tokens, beside a prefill, a later chunk, decodes and a second, random tree."""
    return [(7, 1), (c, SHAPES[shape]), (0, 11), (9, 6), (0, random_parents(7, random.Random(c))), (30, 1)]


@pytest.mark.parametrize("backend", ["loop", "batched"])
@pytest.mark.parametrize("bs", [4, 8, 16])
@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_node_sees_its_path_as_a_chain(backend, shape, H, Hkv, bs):
    D = 16
    md, kc, vc, q, K, V, parents = make_step(mixed(shape, c=13 + bs), H, Hkv, D, bs, seed=bs + H + Hkv)
    out = attend(backend, md, kc, vc, q, D ** -0.5)
    assert out.shape == q.shape and not out.isnan().any()
    torch.testing.assert_close(out.double(), oracle(md, q, K, V, parents, D ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["loop", "batched"])
def test_trees_only_many_random_shapes(backend):
    """Batches of trees alone (no ordinary row) of random sizes up to 64 nodes, random contexts."""
    rng = random.Random(7)
    for trial in range(6):
        seqs = [(rng.randrange(0, 40), random_parents(rng.randrange(1, 65), rng)) for _ in range(rng.randrange(1, 4))]
        bs = rng.choice([4, 8, 16])
        md, kc, vc, q, K, V, parents = make_step(seqs, 4, 2, 8, bs, seed=trial)
        out = attend(backend, md, kc, vc, q, 0.3)
        torch.testing.assert_close(out.double(), oracle(md, q, K, V, parents, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["loop", "batched"])
@pytest.mark.parametrize("sizes", [(9,), (16, 16, 16)], ids=["one tree", "equal trees"])
def test_trees_of_one_size_fill_the_batch(backend, sizes):
    """Every row of the step in trees of one size: the batched backend reads the flat rows as [G, Q] in place
    (no gather or scatter of the query), tree bits included. Different shapes, contexts across block edges."""
    rng = random.Random(len(sizes))
    seqs = [(ctx, random_parents(n, rng)) for ctx, n in zip((21, 3, 40), sizes)]
    md, kc, vc, q, K, V, parents = make_step(seqs, 4, 2, 8, 8, seed=len(sizes))
    out = attend(backend, md, kc, vc, q, 0.3)
    torch.testing.assert_close(out.double(), oracle(md, q, K, V, parents, 0.3), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.interpreter
@pytest.mark.parametrize("bs, heads", [(4, (2, 2)), (16, (4, 2))])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_through_the_interpreter(dtype, shape, bs, heads):
    _triton_case(dtype, shape, bs, heads, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", ["random64", "bushy", "chain", "root_only"])
@pytest.mark.parametrize("bs", [4, 16])
def test_triton_kernel_on_the_gpu(dtype, shape, bs):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _triton_case(dtype, shape, bs, (8, 2), "cuda", D=64)


def _triton_case(dtype, shape, bs, heads, device, D=16):
    H, Hkv = heads
    md, kc, vc, q, K, V, parents = make_step(mixed(shape, c=2 * bs + 3), H, Hkv, D, bs, seed=3, dtype=dtype,
                                            device=device)
    out = attend("triton", md, kc, vc, q, D ** -0.5)
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.cpu().double(), oracle(md, q.cpu(), K, V, parents, D ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["loop", "batched",
                                     pytest.param("triton", marks=[needs_kernels, pytest.mark.interpreter])])
def test_a_long_prefill_beside_a_tree(backend):
    """Rows of a 100-token prefill (tree_bits -1) reach key offsets far past 64 from their own start: the mask's
    shift must stay within an int64 for them too."""
    seqs = [(0, 100), (13, SHAPES["bushy"]), (70, random_parents(20, random.Random(3)))]
    md, kc, vc, q, K, V, parents = make_step(seqs, 4, 2, 16, 16, seed=9)
    out = attend(backend, md, kc, vc, q, 0.25)
    torch.testing.assert_close(out.double(), oracle(md, q, K, V, parents, 0.25), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["loop", "batched",
                                     pytest.param("triton", marks=[needs_kernels, pytest.mark.interpreter])])
def test_a_chain_given_as_a_tree_is_exactly_the_causal_step(backend):
    seqs = [(11, tree.chain_parents(9)), (0, 5), (21, 1)]
    md, kc, vc, q, *_ = make_step(seqs, 4, 2, 16, 8, seed=5)
    plain = AttentionMetadata.build(md.block_tables.tolist(), [11, 0, 21], [10, 5, 1], 8)
    assert plain.tree_bits is None and md.tree_bits is not None
    assert torch.equal(md.positions, plain.positions)
    a, b = attend(backend, md, kc, vc, q, 0.25), attend(backend, plain, kc, vc, q, 0.25)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("backend, debug", [("loop", False), ("loop", True), ("batched", False), ("batched", True),
                                            pytest.param("triton", False, marks=[needs_kernels, pytest.mark.interpreter]),
                                            pytest.param("triton", True, marks=[needs_kernels, pytest.mark.interpreter])])
def test_paged_attention_stores_then_attends_with_the_tree(backend, debug):
    """Through PagedAttention and backends.get: the tree bits reach every backend, with and without checks."""
    seqs = [(5, SHAPES["bushy"]), (0, 4), (9, 1)]
    md, kc, vc, q, K, V, parents = make_step(seqs, 4, 2, 16, 4, seed=9)
    cache = KVCache(1, kc.shape[0], 4, 2, 16, dtype=torch.float32)
    cache.key_cache(0).fill_(float("nan"))
    cache.value_cache(0).fill_(float("nan"))
    for b, (c, _) in enumerate(seqs):                       # only the context is cached before the step
        for p in range(c):
            blk = md.block_tables[b, p // 4]
            cache.key_cache(0)[blk, p % 4], cache.value_cache(0)[blk, p % 4] = K[b][p].float(), V[b][p].float()
    new_k = torch.cat([k[c:] for k, (c, _) in zip(K, seqs)]).float()
    new_v = torch.cat([v[c:] for v, (c, _) in zip(V, seqs)]).float()
    out = PagedAttention(cache, md, backend=backend, debug=debug)(0, q, new_k, new_v)
    torch.testing.assert_close(out.double(), oracle(md, q, K, V, parents, 16 ** -0.5), atol=1e-5, rtol=1e-5)


def test_a_students_loop_without_tree_bits_still_runs_ordinary_steps(monkeypatch):
    """Exercise 2's paged_attention_torch has no tree_bits parameter; the engine patches it in for "loop"."""
    ref = backends.loop.paged_attention_loop

    def student(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
        return ref(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
    monkeypatch.setattr(backends.loop, "paged_attention_loop", student)
    md, kc, vc, q, K, V, parents = make_step([(6, 3), (0, 5), (12, 1)], 4, 4, 8, 4)
    cache = KVCache(1, kc.shape[0], 4, 4, 8, dtype=torch.float32)
    cache.key_cache(0).copy_(kc)
    cache.value_cache(0).copy_(vc)
    for debug in (False, True):
        out = PagedAttention(cache, md, backend="loop", debug=debug)(
            0, q, torch.cat([k[-n:] for k, n in zip(K, (3, 5, 1))]).float(),
            torch.cat([v[-n:] for v, n in zip(V, (3, 5, 1))]).float())
        torch.testing.assert_close(out.double(), oracle(md, q, K, V, parents, 8 ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("debug", [False, True])
def test_a_students_loop_without_tree_bits_stops_a_tree_step_clearly(monkeypatch, debug):
    """... and a tree step that reaches it stops before the call, saying what is missing, not a TypeError inside."""
    def student(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
        raise AssertionError("never called on a tree step")
    monkeypatch.setattr(backends.loop, "paged_attention_loop", student)
    md, kc, vc, q, K, V, parents = make_step([(6, SHAPES["bushy"]), (3, 1)], 4, 4, 8, 4)
    cache = KVCache(1, kc.shape[0], 4, 4, 8, dtype=torch.float32)
    n = q.shape[0]
    with pytest.raises(TypeError, match="student takes no tree_bits.*another attention backend"):
        PagedAttention(cache, md, backend="loop", debug=debug)(0, q, torch.zeros(n, 4, 8), torch.zeros(n, 4, 8))


def test_exercise_9s_direct_adapter_hands_tree_bits_to_the_general_kernel():
    """``kernels.paged_attention`` as ex9 patches it: a tree step, bits included, goes to the general kernel."""
    import exercises
    seen = []

    def general(*args, **kw):
        seen.append(kw.get("tree_bits"))
        return "general"
    adapter = exercises._decode_first(lambda *a: "student", general)
    md, kc, vc, q, K, V, parents = make_step([(5, SHAPES["bushy"]), (3, 1)], 4, 2, 16, 4, seed=11)
    args = (q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc, 0.25)
    assert adapter(*args, tree_bits=md.tree_bits) == "general" and seen[-1] is md.tree_bits
    md1 = make_step([(5, 1), (3, 1)], 4, 2, 16, 4, seed=11)[0]
    assert adapter(q[:2], kc, vc, md1.block_tables, md1.seq_lens, md1.query_start_loc, 0.25) == "student"


def test_build_positions_are_context_plus_depth_and_bits_come_from_the_tree():
    par = [-1, 0, 0, 1, 1, 2]
    md = AttentionMetadata.build([[0, 1, 5], [2], [3, 4]], [3, 0, 6], [6, 2, 1], 4, tree_parents=[par, None, [-1]])
    assert md.positions.tolist() == [3, 4, 4, 5, 5, 5] + [0, 1] + [6]
    assert md.tree_bits.dtype == torch.int64 and md.tree_bits.tolist() == tree.mask_bits(par) + [-1, -1, 1]
    assert md.tree_bits.tolist()[:6] == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]
    assert AttentionMetadata.build([[0], [1]], [1, 0], [2, 1], 4).tree_bits is None
    assert AttentionMetadata.build([[0], [1]], [1, 0], [2, 1], 4, tree_parents=[None, None]).tree_bits is None
    deep = tree.chain_parents(63)                                    # 64 nodes: bit 63 is the sign bit
    md = AttentionMetadata.build([list(range(20))], [5], [64], 4, tree_parents=[deep])
    assert md.tree_bits[-1].item() == -1 and md.positions.tolist() == list(range(5, 69))


def test_build_uses_the_tree_module_at_call_time(monkeypatch):
    """An exercise patches tree.positions / tree.mask_bits with a student's: build must call whatever is there."""
    monkeypatch.setattr(tree, "positions", lambda parents, c: [c + 100] * len(parents))
    monkeypatch.setattr(tree, "mask_bits", lambda parents: [7] * len(parents))
    md = AttentionMetadata.build([[0]], [1], [2], 4, tree_parents=[[-1, 0]])
    assert md.positions.tolist() == [101, 101] and md.tree_bits.tolist() == [7, 7]


@pytest.mark.parametrize("tree_parents, match", [
    ([[-1, 0]], "one entry .* per sequence"),                       # B = 2, one entry
    ("abc", "one entry .* per sequence"),
    ([[-1, 0, 0], None], r"tree_parents\[0\] has 3 nodes.*num_new = 2"),
    ([None, [0]], r"tree_parents\[1\].*root"),
    ([[-1, 1], None], r"tree_parents\[0\].*before its children"),
    ([None, [-1, -1]], r"tree_parents\[1\].*one root"),
])
def test_build_rejects_bad_trees_clearly(tree_parents, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build([[0], [1]], [0, 1], [2, 2], 4, tree_parents=tree_parents)


@pytest.mark.parametrize("backend", ["loop", "batched", pytest.param("triton", marks=[needs_kernels, pytest.mark.interpreter])])
def test_bad_tree_bits_raise_clear_errors(backend):
    md, kc, vc, q, *_ = make_step([(3, [-1, 0, 0]), (0, 70)], 2, 2, 8, 4)
    bits = md.tree_bits
    for bad, err in [(bits.int(), TypeError), (bits[:-1], TypeError), ([1, 3, 5], TypeError),
                     (torch.cat([torch.tensor([1, 3, 1]), bits[3:]]), ValueError),      # node 2 does not see itself
                     (torch.cat([bits[:3 + 64], torch.tensor([1 << 62]), bits[3 + 65:]]), ValueError)]:   # row 64
        md.tree_bits = bad
        with pytest.raises(err, match="tree_bits"):
            attend(backend, md, kc, vc, q, 0.1)


@needs_kernels
@pytest.mark.interpreter
def test_exercise_9s_adapter_passes_tree_steps_to_the_general_kernel(monkeypatch):
    """ex9 wraps backends.triton._triton_attend: decode-only steps go to the student's decode kernel, the rest (trees
    included) to the attend it wrapped, which reads the tree bits from the metadata."""
    import exercises
    import kernels
    calls = []

    def student_decode(*args):
        calls.append(len(args))
        return kernels.paged_decode(*args)
    monkeypatch.setattr(backends.triton, "_triton_attend", exercises._decode_first_in_engine(
        student_decode, backends.triton._triton_attend))
    for seqs in ([(5, SHAPES["bushy"]), (3, 1)], [(5, 1), (3, 1)]):
        md, kc, vc, q, K, V, parents = make_step(seqs, 4, 2, 16, 4, seed=11)
        cache = KVCache(1, kc.shape[0], 4, 2, 16, dtype=torch.float32)
        cache.key_cache(0).copy_(kc)
        cache.value_cache(0).copy_(vc)
        new_k = torch.cat([k[c:] for k, (c, _) in zip(K, seqs)]).float()
        new_v = torch.cat([v[c:] for v, (c, _) in zip(V, seqs)]).float()
        out = PagedAttention(cache, md, backend="triton")(0, q, new_k, new_v)
        torch.testing.assert_close(out.double(), oracle(md, q, K, V, parents, 16 ** -0.5), atol=1e-5, rtol=1e-5)
    assert len(calls) == 1                                   # the decode-only step, and only it
