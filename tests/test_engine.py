"""End to end: the engine's greedy (and seeded) output equals the reference, whatever the configuration."""
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.model.data import val_documents
from minibatch.sampling.reference import generate
from minibatch.trace import TraceRecorder

LENGTHS = [(5, 30), (37, 24), (64, 40), (100, 16), (23, 33), (70, 28)]   # (prompt bytes, max_tokens)
PREAMBLE = b"import os\nimport sys\n\n# shared header for prefix caching\n"  # 58 bytes: 3+ full blocks of 16


def _prompts():
    docs = [d for d in val_documents(12, min_len=400, seed=3)]
    ps = [list(docs[i][:n]) for i, (n, _) in enumerate(LENGTHS)]
    ps += [list(PREAMBLE + docs[7][:20]), list(PREAMBLE + docs[8][:35]), list(PREAMBLE + docs[9][:9])]
    return ps, [m for _, m in LENGTHS] + [20, 26, 12]


PROMPTS, MAX_TOKENS = _prompts()


@pytest.fixture(scope="module")
def greedy_refs(target_model):
    return [generate(target_model, p, SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(PROMPTS, MAX_TOKENS)]


def run(model, prompts=PROMPTS, params=None, **cfg):
    params = params or [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    prio = cfg.pop("_prio", None)
    llm = LLM(model, **cfg)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    outs = llm.generate(prompts, params, priority=prio, use_tqdm=False)
    a = llm.llm_engine.allocator
    a.check_invariants()
    assert a.num_free_blocks == a.num_blocks, "blocks leaked after every request finished"
    return outs, rec.traces, llm


CONFIGS = {
    "continuous-default": dict(),
    "static": dict(scheduling="static", max_num_seqs=4),
    "block-8": dict(block_size=8),
    "block-32": dict(block_size=32),
    "tiny-cache-preempts": dict(block_size=8, num_gpu_blocks=24, max_num_seqs=8),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "loop-backend": dict(attention_backend="loop"),
    "priority": dict(policy="priority", max_num_seqs=3, block_size=8, num_gpu_blocks=30, _prio=[3, 0, 2, 1, 0, 5, 1, 2, 4]),
    "prefill-first": dict(order="prefill-first", max_num_batched_tokens=48),
    "prefill-first-tiny-cache": dict(order="prefill-first", block_size=8, num_gpu_blocks=24, max_num_seqs=8),
    "two-seqs": dict(max_num_seqs=2),
    # SGLang's radix tree and its longest-prefix-match order, on a cache small enough to evict and preempt
    "radix-lpm-tiny-cache": dict(prefix_cache="radix", policy="lpm", block_size=8, num_gpu_blocks=24, max_num_seqs=8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_reference(name, target_model, greedy_refs):
    outs, traces, llm = run(target_model, **CONFIGS[name])
    for out, ref in zip(outs, greedy_refs):
        assert out.outputs[0].token_ids == ref, f"{name}: request {out.request_id} differs"
        assert out.outputs[0].finish_reason == "length" and out.finished
    budget, cap = llm.llm_engine.config.max_num_batched_tokens, llm.llm_engine.config.max_num_seqs
    assert all(t.num_batched_tokens <= budget and len(t.running) <= cap for t in traces)
    if name in ("tiny-cache-preempts", "prefill-first-tiny-cache", "radix-lpm-tiny-cache"):
        assert sum(len(t.preempted) for t in traces) >= 2, "this cache is meant to force preemption"
    if name == "chunked-prefill":
        assert any(s.phase == "prefill" and s.num_computed_before > 0 for t in traces for s in t.scheduled)
    if name == "two-seqs":
        # The preamble requests come in after the first one's prefill is done, so its 3 full
        # blocks are cached by then (a block is cached once computed, never before).
        assert traces[-1].prefix_cache_hits >= 6, "the shared preamble's blocks should be reused"
        assert any(s.num_computed_before >= 48 and s.phase == "prefill" for t in traces for s in t.scheduled)
    if name == "no-prefix-cache":
        assert traces[-1].prefix_cache_hits == 0


def test_priority_order_is_respected(target_model):
    prios = [3, 0, 2, 1, 0, 5, 1, 2, 4]
    outs, traces, _ = run(target_model, policy="priority", max_num_seqs=2, _prio=prios)
    first_step = {}
    for t in traces:
        for sid in t.admitted:
            first_step.setdefault(sid, t.step)
    order = sorted(range(len(prios)), key=lambda i: (prios[i], i))
    steps = [first_step[f"req-{i}"] for i in order]
    assert steps == sorted(steps), "requests must be admitted in (priority, arrival) order"


def test_seeded_sampling_equals_reference(target_model):
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40, max_tokens=m, seed=100 + i)
              for i, m in enumerate(MAX_TOKENS)]
    refs = [generate(target_model, p, sp)[0] for p, sp in zip(PROMPTS, params)]
    for cfg in (dict(), dict(block_size=8, num_gpu_blocks=24, max_num_seqs=8), dict(max_num_batched_tokens=16),
                dict(scheduling="static", max_num_seqs=4)):
        outs, _, _ = run(target_model, params=params, **cfg)
        assert [o.outputs[0].token_ids for o in outs] == refs, cfg


def test_parallel_sampling_forks_and_copies_on_write(target_model, greedy_refs):
    params = SamplingParams(temperature=0.9, max_tokens=12, n=3, seed=5)
    outs, traces, _ = run(target_model, prompts=[PROMPTS[1]], params=[params])
    got = [c.token_ids for c in outs[0].outputs]
    want = [generate(target_model, PROMPTS[1], SamplingParams(temperature=0.9, max_tokens=12, seed=5 + i))[0]
            for i in range(3)]
    assert got == want
    assert any(max(t.ref_counts) >= 3 for t in traces), "the forked sequences share the prompt's blocks"
    g, _, _ = run(target_model, prompts=[PROMPTS[0]], params=[SamplingParams(temperature=0, max_tokens=30, n=2)])
    assert [c.token_ids for c in g[0].outputs] == [greedy_refs[0]] * 2


def test_stop_strings(target_model, greedy_refs):
    ref = greedy_refs[2]
    stop = bytes(ref[5:8]).decode("utf-8", errors="ignore")
    if len(stop) < 2:
        pytest.skip("no clean stop string in this output")
    outs, _, _ = run(target_model, prompts=[PROMPTS[2]], params=[SamplingParams(temperature=0, max_tokens=40,
                                                                                 stop=[stop])])
    cut = bytes(ref).find(stop.encode())
    assert outs[0].outputs[0].token_ids == ref[:cut] and outs[0].outputs[0].finish_reason == "stop"


# -- bad input ---------------------------------------------------------------------------
def test_bad_requests_are_rejected_and_others_still_served(target_model, greedy_refs):
    llm = LLM(target_model, block_size=8, num_gpu_blocks=10)
    eng = llm.llm_engine
    eng.add_request("ok", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30))
    with pytest.raises(ValueError, match="context"):
        eng.add_request("long", [1] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="could never"):
        eng.add_request("huge", [1] * 90, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request("ok", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", "", SamplingParams())
    with pytest.raises(TypeError, match="prompt"):
        eng.add_request("bad", 42, SamplingParams())
    with pytest.raises(KeyError, match="nope"):
        eng.abort_request("nope")
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"] and done[0].outputs[0].token_ids == greedy_refs[0]


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(max_num_batched_tokens=4, block_size=8), ValueError, "smaller than one block"),
    (dict(num_gpu_blocks=0), ValueError, "num_gpu_blocks"),
    (dict(attention_backend="cuda-magic"), ValueError, "attention_backend"),
    (dict(scheduling="orca"), ValueError, "scheduling"),
    (dict(policy="lifo"), ValueError, "policy"),
    (dict(block_size=12), ValueError, "power of two"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(bogus_option=1), TypeError, "unknown LLM option"),
])
def test_bad_engine_settings(target_model, kwargs, err, match):
    with pytest.raises(err, match=match):
        LLM(target_model, **kwargs)


def test_abort_frees_blocks(target_model):
    llm = LLM(target_model, block_size=8)
    eng = llm.llm_engine
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=20))
    for _ in range(3):
        eng.step()
    eng.abort_request("r1")
    eng.allocator.check_invariants()
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step()})
    assert "r1" not in outs and eng.allocator.num_free_blocks == eng.allocator.num_blocks
    with pytest.raises(KeyError):
        eng.abort_request("r1")


def test_abort_of_parallel_sampling_before_its_fork(target_model):
    """n = 3, aborted while its prompt is still being prefilled: the request ends (no forks ever come)."""
    llm = LLM(target_model, block_size=8, max_num_batched_tokens=16)
    eng = llm.llm_engine
    eng.add_request("n3", PROMPTS[1], SamplingParams(temperature=0.8, n=3, seed=1, max_tokens=5))
    eng.step()                                             # a 16-token chunk: the prompt is not done yet
    eng.abort_request("n3")
    assert "n3" not in eng.requests and not eng.has_unfinished_requests()
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
    with pytest.raises(KeyError):
        eng.abort_request("n3")


def test_generate_with_one_bad_prompt_leaves_nothing_queued(target_model, greedy_refs):
    llm = LLM(target_model)
    with pytest.raises(ValueError, match="context"):
        llm.generate([PROMPTS[0], "x" * 600], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[0]), use_tqdm=False)
    assert len(out) == 1 and out[0].outputs[0].token_ids == greedy_refs[0]


@pytest.mark.interpreter
def test_triton_backend_equals_reference(target_model, greedy_refs):
    """The Triton kernels (through the interpreter on a CPU) in the whole engine: chunked prefill,
    a small cache that preempts, prefix hits and decode, token for token equal to the oracle."""
    pytest.importorskip("triton")
    pick = [0, 1, 6, 7]                                    # short, medium, and two sharing the preamble
    params = [SamplingParams(temperature=0, max_tokens=min(MAX_TOKENS[i], 12)) for i in pick]
    outs, traces, _ = run(target_model, prompts=[PROMPTS[i] for i in pick], params=params,
                          attention_backend="triton", block_size=8, num_gpu_blocks=16, max_num_seqs=3,
                          max_num_batched_tokens=32)
    for o, i, sp in zip(outs, pick, params):
        assert o.outputs[0].token_ids == greedy_refs[i][:sp.max_tokens], f"request {i} differs"
    assert any(s.phase == "prefill" and s.num_computed_before > 0 for t in traces for s in t.scheduled)
