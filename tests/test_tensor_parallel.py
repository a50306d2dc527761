"""Tensor parallelism (minibatch/distributed/): real worker processes on gloo, held equal to one process.

Few and small on purpose: each engine starts a worker process (a fresh interpreter, ~2 s on 2 cores)."""
from __future__ import annotations

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.distributed.parallel_linear import ColumnParallelLinear, RowParallelLinear
from minibatch.distributed.tp_engine import WorkerDied
from minibatch.distributed.tp_model import shard_gpt, shard_llama, tp_head_layout
from minibatch.model.weights import load_model
from minibatch.model.model import DenseAttention
from minibatch.trace import TraceRecorder

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n        self.",
           "import os\nimport sys\ndef main():\n", "for i in range(10):\n", "x"]


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("MINIBATCH_DIST_TIMEOUT", "20")     # a dead rank is an error within seconds, never a hang


def _recorded(llm) -> TraceRecorder:
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    return rec


def _preemptions(rec: TraceRecorder) -> int:
    return sum(len(t.preempted) for t in rec.traces)


def _tokens(llm, params, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_split_linear_layers_sum_to_the_whole():
    """Column slices concatenate, and row slices add up, to the unsplit layer (no process group: W = 1 sums
    by hand), including the fused q/k/v split at head boundaries."""
    torch.manual_seed(0)
    full = torch.nn.Linear(8, 12)
    x = torch.randn(5, 8)
    cols = [ColumnParallelLinear(full, r, 2, row_groups=3)(x) for r in range(2)]       # [5, 6] each: q, k, v slices
    y = full(x).view(5, 3, 4)                                                         # [T, q|k|v, out / 3]
    for r in range(2):
        assert torch.allclose(cols[r].view(5, 3, 2), y[:, :, 2 * r:2 * r + 2], atol=1e-6)
    row = [RowParallelLinear(full, r, 2) for r in range(2)]
    for layer in row:
        layer.world = 1                                        # no all-reduce: add the partial sums here
    part = [torch.nn.functional.linear(x[:, 4 * r:4 * r + 4], row[r].weight) for r in range(2)]
    assert torch.allclose(part[0] + part[1] + full.bias, full(x), atol=1e-6)


def test_bad_sizes_are_clear_errors_before_any_process_starts(target_model):
    with pytest.raises(ValueError, match=r"does not divide the model's 4 attention heads.*one of \[1, 2, 4\]"):
        LLM(target_model, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(target_model, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="drafts inside the target's KV cache"):
        LLM(target_model, tensor_parallel_size=2, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="does not divide"):
        shard_gpt(target_model, 0, 8)


def test_tp2_equals_tp1_mixed_batch_preemption_prefix_cache_and_logits(target_model):
    """A mixed batch (shared prefixes, so prefix-cache hits; a cache small enough to preempt), greedy and
    seeded sampling; then the raw logits of one forward within 1e-5."""
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0.8, seed=3, max_tokens=40)]
    kw = dict(max_num_seqs=6, num_gpu_blocks=14, block_size=8, max_num_batched_tokens=64)
    one = LLM(target_model, **kw)
    rec_one = _recorded(one)
    want = [_tokens(one, p) for p in params]
    assert one.llm_engine.allocator.hits > 0 and _preemptions(rec_one) > 0
    two = LLM(target_model, tensor_parallel_size=2, **kw)
    rec_two = _recorded(two)
    try:
        got = [_tokens(two, p) for p in params]
        assert got == want
        eng = two.llm_engine
        assert eng.kv_cache.kv.shape[-2] == target_model.config.n_head // 2        # rank 0 holds its heads only
        assert eng.allocator.hits == one.llm_engine.allocator.hits and _preemptions(rec_two) == _preemptions(rec_one)
        seqs = [list(p.encode()) for p in PROMPTS]
        ids = torch.tensor([t for s in seqs for t in s])
        pos = torch.tensor([i for s in seqs for i in range(len(s))])
        with torch.inference_mode():
            ref = target_model(ids, pos, DenseAttention([len(s) for s in seqs]))
            tp = eng.model(ids, pos, DenseAttention([len(s) for s in seqs]))
        # the all-reduce adds the two halves' partial sums in another order than one matmul does: float32
        # rounding, about 1 ulp of logits near 15 (1e-6), never more than 1e-5 relative
        assert ((tp - ref).abs() / ref.abs().clamp_min(1.0)).max().item() < 1e-5
    finally:
        two.llm_engine.shutdown()


# n-gram lookup runs on the driver alone and reads only tokens: Medusa (hidden states from the split model)
# and the draft model (a second, unsplit model beside it) are the cases that can break
@pytest.mark.parametrize("spec", [{"method": "medusa", "num_speculative_tokens": 2},
                                  {"method": "draft", "num_speculative_tokens": 3}], ids=lambda s: s["method"])
def test_tp2_speculation_equals_plain_greedy(target_model, spec):
    params = SamplingParams(temperature=0, max_tokens=24)
    want = _tokens(LLM(target_model, max_num_seqs=6), params)
    two = LLM(target_model, tensor_parallel_size=2, max_num_seqs=6, speculative_config=spec)
    try:
        assert _tokens(two, params) == want
        assert two.llm_engine.scheduler.running == []
    finally:
        two.llm_engine.shutdown()


def test_a_worker_killed_mid_run_stops_the_engine_naming_its_rank(target_model):
    llm = LLM(target_model, tensor_parallel_size=2, max_num_seqs=4)
    llm.generate(["def f():"], SamplingParams(temperature=0, max_tokens=3))
    proc = llm.llm_engine.tp_group.procs[0]
    proc.kill()
    proc.join(10)
    with pytest.raises(WorkerDied, match=r"rank 1 \(exit code -9\)"):
        llm.generate(["def g():"], SamplingParams(temperature=0, max_tokens=3))
    # the group is gone: a new engine in the same process starts cleanly
    again = LLM(target_model, tensor_parallel_size=2, max_num_seqs=4)
    try:
        assert len(again.generate(["x"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids) == 2
    finally:
        again.llm_engine.shutdown()


def test_the_heads_figure_matches_the_split(target_model):
    """The figure says what shard_gpt does: rank r's cache heads are r·H/W .. (r+1)·H/W - 1 of the full model."""
    from minibatch.viz.tensor_parallel import draw_tp_heads, head_owner
    drawn = draw_tp_heads(4, 4, 2)
    assert drawn["owners"][0] == [0, 0, 1, 1] and len(drawn["owners"]) == 4
    shard = shard_gpt(target_model, 1, 2)
    full_w = target_model.h[0].attn.c_attn.weight          # [3C, C]: q rows 0..C-1
    D = target_model.config.head_dim
    heads = [h for h in range(4) if head_owner(h, 4, 2) == 1]
    assert torch.equal(shard.h[0].attn.c_attn.weight[:2 * D], full_w[heads[0] * D:(heads[-1] + 1) * D])
    with pytest.raises(ValueError, match="do not divide"):
        head_owner(0, 4, 3)


# -- the Llama, by K/V groups (vLLM's rule: Hkv / W K/V heads a rank, or one replicated on W / Hkv ranks) ----------
@pytest.fixture(scope="module")
def llama():
    return load_model("llama", device="cpu")      # the shipped tiny Llama: 4 query heads, 2 K/V heads


def test_the_llama_heads_are_assigned_as_vllm_does_and_sizes_that_do_not_split_are_refused(llama):
    """(num_heads, num_kv_heads, num_kv_head_replicas) per rank, and the rows each rank's shard actually holds:
    rank r's query head(s) r·H/W .., and K/V head r // (W / Hkv) (replicas are consecutive ranks)."""
    assert [tp_head_layout(4, 2, w) for w in (1, 2, 4)] == [(4, 2, 1), (2, 1, 1), (1, 1, 2)]
    assert tp_head_layout(32, 8, 2) == (16, 4, 1) and tp_head_layout(64, 8, 16) == (4, 1, 2)
    D = llama.config.head_dim
    full = llama.layers[0].self_attn
    for world, kv_of_rank in ((2, [0, 1]), (4, [0, 0, 1, 1])):
        q_per_rank = 4 // world
        for r in range(world):
            part = shard_llama(llama, r, world).layers[0].self_attn
            assert torch.equal(part.q_proj.weight, full.q_proj.weight[r * q_per_rank * D:(r + 1) * q_per_rank * D])
            g = kv_of_rank[r]
            assert torch.equal(part.k_proj.weight, full.k_proj.weight[g * D:(g + 1) * D])
            assert torch.equal(part.v_proj.weight, full.v_proj.weight[g * D:(g + 1) * D])
            assert torch.equal(part.o_proj.weight, full.o_proj.weight[:, r * q_per_rank * D:(r + 1) * q_per_rank * D])
    for bad in (3, 8):                            # 3 divides neither; 8 would leave a rank without a query head
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={bad} does not split llama's 4 query heads "
                                             rf"and 2 K/V heads.*choose one of \[1, 2, 4\]"):
            LLM(llama, tensor_parallel_size=bad)


# A shared prefix (prefix-cache hits), a token budget of 32 (long prompts prefill in chunks) and a pool of 12
# blocks of 8 for 6 requests of ~42 + 16 tokens (preemption): every path the driver must replay on its workers.
SHARED = "import os\nimport sys\n\ndef main():\n"
LLAMA_PROMPTS = [SHARED + s for s in ("    ", "    x = ", "    for i in ", "    print(", "    return ", "    if ")]
LLAMA_KW = dict(max_num_seqs=6, num_gpu_blocks=12, block_size=8, max_num_batched_tokens=32)


def _chunked(rec: TraceRecorder) -> int:
    return sum(1 for t in rec.traces for s in t.scheduled
               if s.phase != "decode" and s.num_computed_before + s.num_tokens < s.num_prompt_tokens)


@pytest.fixture(scope="module")
def llama_one(llama):
    """One process: the tokens, the counts of each path taken, and the engine (its cache is the reference)."""
    one = LLM(llama, **LLAMA_KW)
    rec = _recorded(one)
    tokens = _tokens(one, SamplingParams(temperature=0, max_tokens=16), LLAMA_PROMPTS)
    counts = (one.llm_engine.allocator.hits, _preemptions(rec), _chunked(rec))
    assert min(counts) > 0, counts                # the workload takes every path, or the test below proves less
    return tokens, counts, one


@pytest.mark.parametrize("tp", [2, 4])
def test_the_llama_at_tp_2_and_4_equals_one_process(llama, llama_one, tp):
    """tp=2: a K/V head a rank; tp=4: each K/V head replicated on two ranks, one query head each. Greedy tokens
    equal one process's, through the same prefix hits, chunks and preemptions; rank 0's cache holds K/V head 0
    only, [layers, 2, blocks, block_size, 1, D], the one-process cache's head-0 slice (to float rounding: the
    all-reduces sum in another order). A rank holding another group's K/V, or the wrong replica, changes tokens."""
    want, counts, one = llama_one
    eng = LLM(llama, tensor_parallel_size=tp, **LLAMA_KW)
    rec = _recorded(eng)
    try:
        assert _tokens(eng, SamplingParams(temperature=0, max_tokens=16), LLAMA_PROMPTS) == want
        assert (eng.llm_engine.allocator.hits, _preemptions(rec), _chunked(rec)) == counts
        kv, ref = eng.llm_engine.kv_cache.kv, one.llm_engine.kv_cache.kv
        assert kv.shape == ref.shape[:4] + (1, llama.config.head_dim)
        torch.testing.assert_close(kv, ref[..., 0:1, :], atol=1e-4, rtol=1e-4)
    finally:
        eng.llm_engine.shutdown()
