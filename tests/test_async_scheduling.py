"""Asynchronous scheduling (engine/async_scheduler.py and the engine's batch queue), held to the synchronous engine.

In the shape of vLLM's tests/v1/e2e/test_async_sched_and_preempt.py: greedy and seeded outputs identical with async
on and off, under forced preemption (recompute and swap), penalties, chunked prefill, prefix hits and n > 1, on the
loop, cpu and triton backends; then each invariant of the placeholders on its own.
"""
from __future__ import annotations

import time

import pytest

from minibatch import LLM, SamplingParams
from minibatch.engine.async_scheduler import PLACEHOLDER
from minibatch.engine.config import EngineConfig
from minibatch.sampling.structured import StructuredOutputsParams
from minibatch.trace import TraceRecorder

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n        self.",
           "import os\nimport sys\ndef main():\n", "for i in range(10):\n", "x = [i * i for i in range("]
TIGHT = dict(block_size=8, num_gpu_blocks=20, max_num_seqs=6, max_num_batched_tokens=32)    # preempts, chunks
CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0),
    "seeded+penalties+stop": SamplingParams(max_tokens=24, temperature=0.9, seed=11, repetition_penalty=1.3,
                                            presence_penalty=0.2, stop=["\n\n"]),
    "seeded n=2": SamplingParams(max_tokens=16, temperature=0.8, seed=3, n=2),
}


def _run(model, params, prompts=PROMPTS, **kw):
    llm = LLM(model, **kw)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    outs = llm.generate(prompts, params)
    e = llm.llm_engine
    assert not e.has_unfinished_requests()
    e.allocator.check_invariants([])                    # no leaked block
    if e.host_pool is not None:
        e.host_pool.check_idle()
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], rec


@pytest.fixture(scope="module")
def sync_runs(target_model):
    return {name: _run(target_model, p, **TIGHT)[0] for name, p in CASES.items()}


@pytest.mark.parametrize("backend", ["loop", "cpu"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_async_equals_sync_under_preemption(target_model, sync_runs, backend, preemption):
    for name, params in CASES.items():
        toks, rec = _run(target_model, params, attention_backend=backend, async_scheduling=True,
                         preemption_mode=preemption, **TIGHT)
        assert toks == sync_runs[name], f"{name}: async changed the output ({backend}, {preemption})"
        moved = sum(len(t.preempted) + len(t.swapped_out) for t in rec.traces)
        assert moved > 0, "the pool is meant to force preemption"
        assert any(t.num_cached_tokens if hasattr(t, "num_cached_tokens") else t.prefix_cache_hits
                   for t in rec.traces), "the shared prefixes are meant to hit the prefix cache"


@pytest.mark.triton
def test_async_equals_sync_on_triton(target_model):
    params, prompts = SamplingParams(max_tokens=8, temperature=0.0), PROMPTS[:3]
    small = dict(block_size=8, max_num_seqs=3, max_num_batched_tokens=32)
    ref, _ = _run(target_model, params, prompts, **small)
    toks, _ = _run(target_model, params, prompts, attention_backend="triton", async_scheduling=True, **small)
    assert toks == ref


def test_the_forward_overlaps_the_next_schedule(target_model):
    """The trace's spans: under async, step N+1 is scheduled before step N's forward has ended."""
    _, rec = _run(target_model, CASES["greedy"], async_scheduling=True)
    t = rec.traces
    overlapped = sum(t[i + 1].schedule_span[0] < t[i].forward_span[1] for i in range(len(t) - 1))
    assert overlapped >= len(t) // 2, [(x.schedule_span, x.forward_span) for x in t[:4]]
    _, rec = _run(target_model, CASES["greedy"])
    t = rec.traces
    assert all(t[i + 1].schedule_span[0] >= t[i].forward_span[1] for i in range(len(t) - 1))   # sync: in turn


@pytest.mark.parametrize("backend", ["loop", "cpu"])
def test_greedy_steps_chain_on_the_model_thread(target_model, sync_runs, backend, monkeypatch):
    """Greedy steps that need no sequence to sample are taken on the model's thread and the next step is queued
    behind them, its placeholders filled there (Engine._fill_from): most steps go that way, under preemption,
    chunked prefill and prefix hits, and the tokens are the synchronous engine's. A step whose rows do need the
    CPU (seeded sampling, penalties) never chains."""
    from minibatch.engine.engine import LLMEngine
    fills, fill_from = [], LLMEngine._fill_from

    def counted(*args):
        got = fill_from(*args)
        fills.append(got)
        return got
    monkeypatch.setattr(LLMEngine, "_fill_from", staticmethod(counted))
    toks, rec = _run(target_model, CASES["greedy"], attention_backend=backend, async_scheduling=True, **TIGHT)
    assert toks == sync_runs["greedy"]
    chained = [f for f in fills if f]
    assert len(chained) >= len(rec.traces) // 2, (len(chained), len(rec.traces))
    assert sum(len(f) for f in chained) > 2 * len(chained)          # batches of several placeholders each
    fills.clear()
    toks, _ = _run(target_model, CASES["seeded+penalties+stop"], async_scheduling=True, **TIGHT)
    assert toks == sync_runs["seeded+penalties+stop"] and not fills


def test_the_update_span_holds_the_sampling(target_model, monkeypatch):
    """Under async the sampler runs on the CPU after the forward (ModelRunner.finish): it is in the step's update
    span, so the CPU lane shows it (it once fell between the spans, drawn as idle)."""
    from minibatch.engine.model_runner import ModelRunner
    calls, finish = [], ModelRunner.finish

    def timed(self, *a):
        start = time.perf_counter()
        result = finish(self, *a)
        calls.append((start, time.perf_counter()))
        return result
    monkeypatch.setattr(ModelRunner, "finish", timed)
    llm = LLM(target_model, async_scheduling=True, block_size=8)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=6, temperature=0.0))
    t0 = llm.llm_engine.t0
    for t in rec.traces:
        lo, hi = t.update_span
        assert any(lo <= s - t0 and e - t0 <= hi for s, e in calls), (t.step, t.update_span)


def test_placeholders_are_counted_resolved_and_never_cached(target_model):
    llm = LLM(target_model, async_scheduling=True, block_size=4)
    e = llm.llm_engine
    for i, p in enumerate(PROMPTS[:3]):
        e.add_request(str(i), p, SamplingParams(max_tokens=12))
    seen = 0
    while e.has_unfinished_requests():
        e.step()
        for seq in e.scheduler.running:            # a step is in flight: each of its sampled rows holds one
            assert seq.num_output_placeholders <= 1
            assert seq.token_ids.count(PLACEHOLDER) == seq.num_output_placeholders
            assert PLACEHOLDER not in seq.output_token_ids
            seen += seq.num_output_placeholders
        for entry in e.allocator.snapshot()["entries"].values():
            assert PLACEHOLDER not in entry.tokens, "the prefix cache registered a placeholder"
    assert seen > 0


def test_max_tokens_is_never_scheduled_again_and_a_late_stop_drops_its_token(target_model):
    _, rec = _run(target_model, SamplingParams(max_tokens=3), PROMPTS[:2], async_scheduling=True)
    rows = {}
    for t in rec.traces:
        for s in t.scheduled:
            rows[s.seq_id] = rows.get(s.seq_id, 0) + 1
    assert all(n == 3 for n in rows.values()), rows       # the prefill's row + 2 decodes: never a 4th
    stop = SamplingParams(max_tokens=30, temperature=0.0, stop=["("])
    sync, _ = _run(target_model, stop, PROMPTS)
    late, rec = _run(target_model, stop, PROMPTS, async_scheduling=True)
    assert late == sync and sum(r == "stop" for o in late for _, r in o) >= 2
    done, late_rows = set(), []
    for t in rec.traces:
        late_rows += [s for s in t.scheduled if s.seq_id in done]      # scheduled before its stop was known
        done |= set(t.finished)
    assert late_rows, "no sequence was in flight when it stopped: the test checks nothing"
    assert all(s.new_token_ids == [] for s in late_rows), "a dropped row's token was emitted"


def test_abort_with_a_step_in_flight(target_model):
    llm = LLM(target_model, async_scheduling=True)
    e = llm.llm_engine
    for i, p in enumerate(PROMPTS[:3]):
        e.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0.0))
    e.step()
    e.step()
    assert e._in_flight is not None
    e.abort_request("1")
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            outs[o.request_id] = o
    assert "1" not in outs and set(outs) == {"0", "2"}
    e.allocator.check_invariants([])
    ref = LLM(target_model).generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0.0))
    assert [outs["0"].outputs[0].token_ids, outs["2"].outputs[0].token_ids] == [r.outputs[0].token_ids for r in ref]


def test_structured_outputs_wait_for_the_previous_grammar(target_model):
    so = SamplingParams(max_tokens=24, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}\(\d\)"))
    prompts = PROMPTS[:3]
    assert _run(target_model, so, prompts, async_scheduling=True)[0] == _run(target_model, so, prompts)[0]


def test_an_error_in_a_forward_is_that_steps_error(target_model, monkeypatch):
    llm = LLM(target_model, async_scheduling=True)
    e, calls = llm.llm_engine, []
    real = e.model_runner.launch

    def launch(out, prepared, ids):
        calls.append(len(ids))
        if len(calls) == 3:
            raise RuntimeError("forward 3 failed")
        return real(out, prepared, ids)

    monkeypatch.setattr(e.model_runner, "launch", launch)
    e.add_request("a", PROMPTS[0], SamplingParams(max_tokens=10))
    e.step()                                     # launches step 1
    e.step()                                     # step 1's outputs; launches step 2
    e.step()                                     # step 2's outputs; launches step 3 (which fails on its thread)
    with pytest.raises(RuntimeError, match="forward 3 failed"):
        e.step()                                 # the call that waits for step 3 raises its error


@pytest.mark.parametrize("kw, what", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(scheduling="static"), "scheduling='static'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size > 1"),
    (dict(disaggregated=True), "disaggregated=True"),
])
def test_unsupported_configurations_are_refused(kw, what):
    with pytest.raises(ValueError, match="async_scheduling=True cannot go with " + what.replace("(", r"\(")):
        EngineConfig(async_scheduling=True, **kw)


def test_async_with_the_radix_cache_and_lpm(target_model, sync_runs):
    toks, _ = _run(target_model, CASES["greedy"], async_scheduling=True, prefix_cache="radix", policy="lpm", **TIGHT)
    assert toks == sync_runs["greedy"]
