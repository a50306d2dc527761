"""Backend "cpu" (minibatch/kv/backends/cpu.py, cpu_kernel.py): the C++ operator that reads the KV blocks in place.

Against an independent float64 oracle (each sequence's K/V kept contiguous when the cache was filled, the
causal-offset and tree masks applied in float64), against ``paged_attention_loop`` (the teaching version, which
does its math in fp32) and against "batched", on every kind of step: pure decode (B = 17, ragged lengths
across block boundaries), chunked prefill, verify chains, token trees, mixed; MHA and GQA (H = 4 over Hkv = 1,
2); block tables drawn shuffled from a pool three times too large (non-contiguous block ids); every slot no
sequence owns filled with NaN; fp32 and bf16. Then through ``PagedAttention`` and the engine (greedy, token
for token against "batched"), and the fallback: where the operator cannot be built, one warning, "batched".

The compile (about 25 s the first time on a 2-core machine, then cached under ~/.cache/minibatch) happens once,
in the module-scoped ``op`` fixture.
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.kv import backends
from minibatch.kv.backends import cpu, cpu_kernel
from minibatch.kv.attention import AttentionMetadata, PagedAttention
from minibatch.kv.backends import paged_attention_batched, paged_attention_loop
from minibatch.kv.kv_cache import KVCache, block_table_tensor
from minibatch.kv.tree import mask_bits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def op(cpu_op):
    return cpu_op


TREE = [-1, 0, 0, 1, 1, 2]                 # root; two children; 1 has two, 2 has one
# Each sequence: (q_len, seq_len) or (parents, seq_len) for a token tree of len(parents) new tokens.
CASES = {
    "decode B=17": [(1, L) for L in (1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 100, 127, 128, 129, 200)],
    "prefill": [(7, 7), (16, 16), (33, 33)],
    "chunked prefill": [(9, 29), (16, 48), (3, 11), (17, 70)],
    "verify chains": [(4, 30), (4, 22), (4, 4), (4, 49)],             # 1 + k with k = 3
    "trees": [(TREE, 26), (1, 40), ([-1, 0, 1, 0, 3], 5), ([-1, 0, 1, 2], 33), (TREE, 6)],
    "mixed": [(1, 37), (23, 23), (9, 29), (5, 30), (TREE, 50), (1, 1)],
}
HEADS = [(4, 4), (4, 2), (4, 1)]            # MHA, GQA, MQA
DTYPES = {"fp32": (torch.float32, dict(atol=1e-5, rtol=1e-5)), "bf16": (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))}


def make_step(case, H, Hkv, bs, D=64, dtype=torch.float32, seed=0):
    """One step: q, caches (NaN where nobody owns a slot), tables, lengths, tree_bits; and the oracle's inputs."""
    g = torch.Generator().manual_seed(seed)
    spec = [(len(a) if isinstance(a, list) else a, L, a if isinstance(a, list) else None) for a, L in CASES[case]]
    need = [-(-L // bs) for _, L, _ in spec]
    num_blocks = 3 * sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for k in need:
        tables.append(perm[i:i + k])
        i += k
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables if len(t) > 1)    # ids not in a row
    kc = torch.full((num_blocks, bs, Hkv, D), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    K = [torch.randn(L, Hkv, D, generator=g).to(dtype) for _, L, _ in spec]
    V = [torch.randn(L, Hkv, D, generator=g).to(dtype) for _, L, _ in spec]
    for (_, L, _), t, k, v in zip(spec, tables, K, V):
        for p in range(L):
            kc[t[p // bs], p % bs], vc[t[p // bs], p % bs] = k[p], v[p]
    q = torch.randn(sum(n for n, _, _ in spec), H, D, generator=g).to(dtype)
    bits = [b for n, _, parents in spec for b in (mask_bits(parents) if parents else [-1] * n)]
    tree_bits = torch.tensor(bits, dtype=torch.int64) if any(p for _, _, p in spec) else None
    bt = block_table_tensor([t + [-1] for t in tables])                   # an extra -1 column, never read
    seq_lens = torch.tensor([L for _, L, _ in spec], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor([n for n, _, _ in spec]).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=q, kc=kc, vc=vc, bt=bt, sl=seq_lens, qsl=qsl, tree_bits=tree_bits, spec=spec, K=K, V=V,
                tables=tables)


def oracle(x, scale):
    """float64, per sequence, on its contiguous K/V: query i at L - n + i sees j <= that, and in a tree only
    the context and the nodes of its row's bits (its ancestors and itself)."""
    H = x["q"].shape[1]
    outs, s = [], 0
    for (n, L, parents), k, v in zip(x["spec"], x["K"], x["V"]):
        G = H // k.shape[1]
        k, v = (t.double().repeat_interleave(G, dim=1) for t in (k, v))            # [L, H, D]
        q = x["q"][s:s + n].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale                      # [H, n, L]
        j = torch.arange(L)
        mask = j[None, :] <= torch.arange(L - n, L)[:, None]                      # [n, L]
        if parents:
            row = torch.tensor(mask_bits(parents))                                 # [n]
            node = j - (L - n)
            mask &= (node < 0)[None, :] | (((row[:, None] >> node.clamp(0, 63)[None, :]) & 1) == 1)
        p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        s += n
    return torch.cat(outs)


def args(x):
    return x["q"], x["kc"], x["vc"], x["bt"], x["sl"], x["qsl"]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bs", [16, 8])
@pytest.mark.parametrize("H, Hkv", HEADS)
@pytest.mark.parametrize("case", list(CASES))
def test_equals_the_float64_oracle_the_loop_and_batched(op, case, H, Hkv, bs, dtype):
    dt, tol = DTYPES[dtype]
    x = make_step(case, H, Hkv, bs, dtype=dt, seed=bs + 7 * Hkv)
    scale = 64 ** -0.5
    out = cpu.paged_attention_cpu(*args(x), scale, tree_bits=x["tree_bits"])
    assert out.shape == x["q"].shape and out.dtype == dt and not out.isnan().any()
    torch.testing.assert_close(out.double(), oracle(x, scale), **tol)
    batched = paged_attention_batched(*args(x), scale, tree_bits=x["tree_bits"])
    torch.testing.assert_close(out.float(), batched.float(), **tol)
    if dt == torch.float32:
        loop = paged_attention_loop(*args(x), scale, tree_bits=x["tree_bits"])
        torch.testing.assert_close(out, loop, **tol)


@pytest.mark.parametrize("D", [24, 40, 128])
def test_head_dims_that_are_not_a_vector_multiple(op, D):
    x = make_step("mixed", 4, 2, 16, D=D, seed=D)
    out = cpu.paged_attention_cpu(*args(x), D ** -0.5, tree_bits=x["tree_bits"])
    torch.testing.assert_close(out.double(), oracle(x, D ** -0.5), atol=1e-5, rtol=1e-5)


def test_float64_in_is_float64_math(op):
    """With float64 inputs the kernel accumulates in float64 (opmath), so it meets the oracle at 1e-12."""
    x = make_step("mixed", 4, 2, 8, dtype=torch.float64, seed=3)
    out = cpu.paged_attention_cpu(*args(x), 0.125, tree_bits=x["tree_bits"])
    torch.testing.assert_close(out, oracle(x, 0.125), atol=1e-12, rtol=1e-12)


def test_a_nan_in_a_slot_that_is_read_shows(op):
    """The NaN fill proves something only if reading a NaN slot would show: poison sequence 0's last position."""
    x = make_step("mixed", 4, 2, 8)
    L = x["spec"][0][1]
    x["kc"][x["tables"][0][(L - 1) // 8], (L - 1) % 8] = float("nan")
    out = cpu.paged_attention_cpu(*args(x), 0.125, tree_bits=x["tree_bits"])
    assert out[0].isnan().all() and not out[1:].isnan().any()


def test_the_tree_mask_is_honoured(op):
    """A tree step differs from the same step without its mask on exactly the rows whose mask is not the causal
    one (a node whose ancestors are not all the nodes before it): the kernel reads tree_bits, row by row."""
    x = make_step("trees", 4, 2, 16)
    with_tree = cpu.paged_attention_cpu(*args(x), 0.125, tree_bits=x["tree_bits"])
    causal = cpu.paged_attention_cpu(*args(x), 0.125)
    differ = ((with_tree - causal).abs().amax((1, 2)) > 0).tolist()
    node = [i for n, _, _ in x["spec"] for i in range(n)]
    not_causal = [b != -1 and b != (1 << (i + 1)) - 1 for b, i in zip(x["tree_bits"].tolist(), node)]
    assert differ == not_causal and any(differ)


def test_strided_query_and_two_threads_give_the_same_bits(op):
    """The model hands q as a view of the fused qkv projection (rows strided); OpenMP's split over (sequence,
    KV head) keeps every item's arithmetic the same, so 2 threads give bit-identical output."""
    x = make_step("mixed", 4, 2, 16, seed=5)
    ref = cpu.paged_attention_cpu(*args(x), 0.125, tree_bits=x["tree_bits"])
    qkv = torch.randn(x["q"].shape[0], 3, *x["q"].shape[1:])
    qkv[:, 0] = x["q"]
    strided = qkv[:, 0]
    assert not strided.is_contiguous()
    torch.testing.assert_close(op(strided, x["kc"], x["vc"], x["bt"], x["sl"], x["qsl"], 0.125, x["tree_bits"]),
                               ref, atol=0, rtol=0)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = cpu.paged_attention_cpu(*args(x), 0.125, tree_bits=x["tree_bits"])
    finally:
        torch.set_num_threads(n)
    torch.testing.assert_close(two, ref, atol=0, rtol=0)


def test_bad_inputs_raise_clear_errors(op):
    x = make_step("mixed", 4, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        cpu.paged_attention_cpu(x["q"][:, :3], *args(x)[1:], 0.1)
    with pytest.raises(TypeError, match="must match"):
        cpu.paged_attention_cpu(x["q"].double(), *args(x)[1:], 0.1)
    with pytest.raises(RuntimeError, match="int32"):           # the operator itself checks what it reads
        op(x["q"], x["kc"], x["vc"], x["bt"].long(), x["sl"], x["qsl"], 0.1, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpp_store_writes_what_the_torch_store_writes(op, dtype):
    """store_kv_cpu (the "cpu" backend's store) against store_kv_torch: the same slots written, slot -1 skipped
    (a padding row), every other slot untouched; and a slot past the cache is an error, not a stray write."""
    g = torch.Generator().manual_seed(3)
    N, bs, Hkv, D, T = 6, 4, 2, 8, 9
    key, value = (torch.randn(T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([5, -1, 0, 23, 7, -1, 12, 1, 18])                       # distinct; two padding rows
    caches = [[torch.randn(N, bs, Hkv, D, generator=torch.Generator().manual_seed(4)).to(dtype) for _ in range(2)]
              for _ in range(2)]
    backends.store_kv_torch(key, value, *caches[0], slots)
    cpu.store(key, value, *caches[1], slots)
    for a, b in zip(*caches):
        assert torch.equal(a, b)
    assert torch.equal(caches[1][0].view(-1, Hkv, D)[23], key[3])                  # the last slot of the last block
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu.store(key[:1], value[:1], *caches[1], torch.tensor([N * bs]))
    torch.library.opcheck(torch.ops.minibatch.store_kv_cpu, (key, value, *caches[1], slots),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_the_fake_implementation_lets_torch_compile_trace_it(op):
    """torch.library's own checks (schema, fake tensor, autograd registration), then a fullgraph compile."""
    x = make_step("mixed", 4, 2, 8)
    call = (x["q"], x["kc"], x["vc"], x["bt"], x["sl"], x["qsl"], 0.125, x["tree_bits"])
    torch.library.opcheck(op, call, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    compiled = torch.compile(lambda *a: op(*a) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*call), 2 * op(*call))


# -- through PagedAttention: store this step's K/V, then attend ---------------------------------------------------
@pytest.mark.parametrize("debug", [False, True], ids=["engine path", "debug checks"])
@pytest.mark.parametrize("case", ["decode B=17", "chunked prefill", "trees", "mixed", "prefill"])
def test_paged_attention_stores_then_attends(op, case, debug):
    """The engine's "cpu" path splits a step (``cpu._cpu_attend``): rows of up to LONG_QUERY queries through
    the operator, longer ones through SDPA, into one output. "mixed" has both kinds in one step (and a tree);
    "prefill" only long rows; "decode B=17" none."""
    x = make_step(case, 4, 2, 16, seed=11)
    spec, bs = x["spec"], 16
    cache = KVCache(1, x["kc"].shape[0], bs, 2, 64, debug_nan=True)
    for (n, L, _), t, k, v in zip(spec, x["tables"], x["K"], x["V"]):           # the context only
        for p in range(L - n):
            cache.kv[0, 0, t[p // bs], p % bs], cache.kv[0, 1, t[p // bs], p % bs] = k[p], v[p]
    md = AttentionMetadata.build(x["tables"], [L - n for n, L, _ in spec], [n for n, _, _ in spec], bs,
                                 tree_parents=[p for _, _, p in spec] if x["tree_bits"] is not None else None)
    new_k = torch.cat([k[L - n:] for (n, L, _), k in zip(spec, x["K"])])
    new_v = torch.cat([v[L - n:] for (n, L, _), v in zip(spec, x["V"])])
    out = PagedAttention(cache, md, "cpu", debug=debug)(0, x["q"], new_k, new_v)
    torch.testing.assert_close(out.double(), oracle(x, 64 ** -0.5), atol=1e-5, rtol=1e-5)
    other = PagedAttention(cache, md, "batched")(0, x["q"], new_k, new_v)
    torch.testing.assert_close(out, other, atol=1e-5, rtol=1e-5)
    if not debug:
        long_rows = [b for b, (n, _, _) in enumerate(spec) if n > cpu.LONG_QUERY]
        seq_lens, group, _, _ = md.plan["cpu"]
        assert (group is not None) == bool(long_rows)
        assert [b for b in range(len(spec)) if seq_lens[b] == 0] == long_rows     # the operator skips them


# -- the engine: greedy, token for token ------------------------------------------------------------------------------
PROMPTS = ["def fibonacci(n):\n    ", "import torch\nclass Model", "The quick brown fox", "x = [1, 2, 3]\nfor i in",
           "# a comment\n" * 6 + "def main():"]


def _greedy(backend, **cfg):
    llm = LLM("target", attention_backend=backend, **cfg)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def calls(monkeypatch):
    """The operator's calls from the engine, as (query rows, max query length, a tree?): proof it ran."""
    seen, attend = [], cpu.attend
    monkeypatch.setattr(cpu, "attend", lambda q, kc, vc, md, s, **kw: seen.append(
        (q.shape[0], md.max_query_len, md.tree_bits is not None)) or attend(q, kc, vc, md, s, **kw))
    return seen


@pytest.mark.parametrize("cfg", [{}, dict(max_num_batched_tokens=24, block_size=8)], ids=["plain", "chunked"])
def test_engine_greedy_equals_batched(op, calls, cfg):
    got = _greedy("cpu", **cfg)
    assert got == _greedy("batched", **cfg)
    assert all(len(t) == 40 for t in got)
    assert (5, 1, False) in calls and any(q > 1 for _, q, _ in calls)      # batch-5 decodes and prefills


def test_engine_tree_speculation_equals_batched(op, calls):
    """EAGLE-2's dynamic trees: every verify step a tree through the operator's tree_bits."""
    spec = {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 6, "depth": 3, "topk": 2}
    assert _greedy("cpu", speculative_config=spec) == _greedy("batched", speculative_config=spec)
    assert any(tree for _, _, tree in calls)


# -- the fallback: no compiler, no OpenMP, a failed build -> one warning, then "batched" --------------------------
@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """cpu_kernel as before its first load(), building into an empty directory."""
    monkeypatch.setattr(cpu_kernel, "_TRIED", False)
    monkeypatch.setattr(cpu_kernel, "_OP", None)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def _fake_compiler(tmp_path, body):
    path = tmp_path / "fake-c++"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("kind", ["no compiler", "no OpenMP", "the build fails"])
def test_without_the_operator_cpu_says_so_once_and_uses_batched(fresh, monkeypatch, kind):
    cxx = {"no compiler": lambda: str(fresh / "no-such-c++"),
           "no OpenMP": lambda: _fake_compiler(fresh, 'echo "unrecognized option -fopenmp" >&2; exit 1'),
           # the probes (a tiny program) pass through to the real compiler; the operator's compile (-c) fails
           "the build fails": lambda: _fake_compiler(
               fresh, 'case "$*" in *" -c "*) echo "error: simulated failure" >&2; exit 1;; esac; exec c++ "$@"'),
           }[kind]()
    monkeypatch.setenv("CXX", cxx)
    want = {"no compiler": "no C++ compiler", "no OpenMP": "OpenMP", "the build fails": "build failed"}[kind]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = backends.get("cpu")
        second = backends.get("cpu")
    msgs = [str(w.message) for w in caught if "attention backend 'cpu'" in str(w.message)]
    assert len(msgs) == 1 and want in msgs[0] and "'batched'" in msgs[0] and "\n" not in msgs[0], msgs
    assert first == second == backends.get("batched")


def test_fallback_end_to_end_in_a_fresh_process(tmp_path):
    """A process with no compiler: LLM(attention_backend="cpu") runs (as "batched") and stderr has one line."""
    code = ("from minibatch import LLM, SamplingParams\n"
            "for _ in range(2):\n"
            "    llm = LLM('target', attention_backend='cpu')\n"
            "    out = llm.generate(['def f(x):'], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)\n"
            "print(out[0].outputs[0].token_ids)\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), TORCH_EXTENSIONS_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "attention backend 'cpu'" in ln]
    assert len(lines) == 1 and "no C++ compiler" in lines[0], r.stderr
    assert len(eval(r.stdout.strip().splitlines()[-1])) == 8


def test_the_cpu_bench_runs_and_agrees(op, capsys):
    """``python -m minibatch.bench attention --cpu``'s table, on one tiny configuration: it runs, and the two
    backends' answers agree (the last column)."""
    from minibatch.bench.attention import bench_cpu
    assert bench_cpu([(3, 40, 4, 2, 32, torch.float32)], iters=1, rounds=1)
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(row.split()[-1]) < 1e-5, row


# -- the default: "cpu" on a CPU where it builds ----------------------------------------------------------------------
def test_the_engine_picks_cpu_on_a_cpu_and_a_graph_safe_backend_for_eager_replay(op):
    from minibatch.engine.config import EngineConfig
    from minibatch.engine.engine import LLMEngine
    from minibatch.model.model import GPT, GPTConfig
    model = GPT(GPTConfig("tiny", n_layer=1, n_head=2, n_embd=32, n_ctx=64)).eval()
    shared = EngineConfig(block_size=4)
    assert LLMEngine(model, shared).config.attention_backend == "cpu"
    assert shared.attention_backend is None                    # the caller's config is not rewritten
    replay = LLMEngine(model, EngineConfig(block_size=4, cuda_graph_mode="eager-replay"))
    assert replay.config.attention_backend == "batched"        # a static batch needs a graph-safe backend
    assert LLMEngine(model, EngineConfig(block_size=4, attention_backend="loop")).config.attention_backend == "loop"
