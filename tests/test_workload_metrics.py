"""Workloads are reproducible and respect their caps; metrics give exactly the numbers worked out by hand."""
import numpy as np
import pytest

from minibatch.engine.outputs import RequestMetrics
from minibatch.bench.metrics import (add_ratio_row, critical_path_bound, format_table, percentiles, slot_bound,
                                     summarize)
from minibatch.sampling.sampler import SamplingParams
from minibatch.trace import SeqStep, StepTrace
from minibatch.bench.workload import PREAMBLE, WORKLOADS, WorkloadRequest, describe, make_workload

# -- workloads -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_same_seed_same_workload_other_seed_differs(name):
    a = make_workload(name, 24, seed=3, arrival="poisson", rate=2.0)
    b = make_workload(name, 24, seed=3, arrival="poisson", rate=2.0)
    c = make_workload(name, 24, seed=4, arrival="poisson", rate=2.0)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert [r.max_tokens for r in a] != [r.max_tokens for r in c]
    assert [r.arrival_time for r in a] != [r.arrival_time for r in c]


def test_arrival_process_changes_only_arrival_times():
    off, poi = make_workload("longtail", 16, seed=1), make_workload("longtail", 16, seed=1, arrival="poisson", rate=3)
    assert [(r.prompt, r.max_tokens) for r in off] == [(r.prompt, r.max_tokens) for r in poi]
    assert all(r.arrival_time == 0.0 for r in off) and all(r.arrival_time > 0 for r in poi)


CAP_CASES = [(name, prompt_len, max_len) for name in WORKLOADS
             for prompt_len, max_len in [((32, 192), 512), ((60, 120), 128), ((50, 50), 200)]
             if name != "shared-prefix" or len(PREAMBLE) + prompt_len[1] < max_len]     # room for the preamble


@pytest.mark.parametrize("name,prompt_len,max_len", CAP_CASES)
def test_lengths_respect_the_caps(name, prompt_len, max_len):
    wl = make_workload(name, 60, seed=0, prompt_len=prompt_len, max_len=max_len)
    fixed = len(PREAMBLE) if name == "shared-prefix" else 0
    assert len({r.request_id for r in wl}) == len(wl)
    for r in wl:
        n = len(r.prompt.encode("utf-8"))
        assert r.num_prompt_tokens == n
        assert prompt_len[0] <= n - fixed <= prompt_len[1], (n, prompt_len)
        assert 1 <= r.max_tokens and n + r.max_tokens <= max_len


def test_the_context_cap_actually_binds():
    # Short context, long prompts: the long tail must be cut at max_len, not run past the model's context.
    wl = make_workload("longtail", 200, seed=0, prompt_len=(100, 120), max_len=160)
    assert any(r.num_prompt_tokens + r.max_tokens == 160 for r in wl)


def test_longtail_is_long_tailed_and_uniform_is_not():
    out = np.array([r.max_tokens for r in make_workload("longtail", 400, seed=0)])
    med = np.median(out)
    assert out.mean() > 1.3 * med and out.max() > 5 * med and (out < med / 2).sum() > 40
    uni = np.array([r.max_tokens for r in make_workload("uniform", 400, seed=0, output_len=(20, 60))])
    assert uni.min() >= 20 and uni.max() <= 60 and abs(uni.mean() - 40) < 3


def test_poisson_gaps():
    t = np.array([r.arrival_time for r in make_workload("uniform", 2000, seed=7, arrival="poisson", rate=5.0)])
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert (gaps > 0).all()
    assert abs(gaps.mean() - 0.2) < 0.02                     # 1 / rate
    assert 0.85 < gaps.std() / gaps.mean() < 1.15            # exponential: std = mean


def test_shared_prefix_prompts_share_the_preamble():
    wl = make_workload("shared-prefix", 32, seed=2)
    assert all(r.prompt.startswith(PREAMBLE) for r in wl)
    assert len({r.prompt[len(PREAMBLE):] for r in wl}) > 16, "the snippets after the preamble differ"
    own = make_workload("shared-prefix", 4, seed=2, preamble="# header\n")
    assert all(r.prompt.startswith("# header\n") and not r.prompt.startswith(PREAMBLE) for r in own)


def test_priorities_and_sampling_params():
    wl = make_workload("uniform", 40, seed=0, num_priorities=3)
    assert {r.priority for r in wl} == {0, 1, 2}
    sp = wl[0].sampling_params(temperature=0.7, seed=5, top_k=4)
    assert isinstance(sp, SamplingParams)
    assert (sp.max_tokens, sp.temperature, sp.seed, sp.top_k) == (wl[0].max_tokens, 0.7, 5, 4)
    assert wl[0].sampling_params().greedy


@pytest.mark.parametrize("kw,err,match", [
    (dict(name="bursty"), ValueError, "unknown workload"),
    (dict(name="uniform", median=3), TypeError, "no option"),
    (dict(arrival="poisson"), ValueError, "rate"),
    (dict(rate=2.0), ValueError, "rate only applies"),
    (dict(arrival="closed-loop"), ValueError, "arrival"),
    (dict(prompt_len=(100, 20)), ValueError, "prompt_len"),
    (dict(prompt_len=(32, 600)), ValueError, "prompt_len"),
    (dict(num_requests=0), ValueError, "num_requests"),
    (dict(name="uniform", output_len=(0, 5)), ValueError, "output_len"),
])
def test_bad_workload_arguments(kw, err, match):
    with pytest.raises(err, match=match):
        make_workload(**kw)


def test_describe_reports_the_numbers():
    wl = [WorkloadRequest(f"r{i}", "x" * n, m, t) for i, (n, m, t) in
          enumerate([(10, 5, 0.0), (20, 5, 1.0), (30, 6, 2.0), (40, 100, 4.0)])]
    text = describe(wl)
    assert "4 requests" in text and "over 4.00 s" in text and "1.00 requests/s" in text
    assert "prompt tokens: mean 25.0, p50 25, p90 37, max 40" in text     # p90 of 10..40 = 37 (linear)
    assert "max_tokens): mean 29.0, p50 6, p90 72, max 100" in text       # p50 of 5,5,6,100 = 5.5 -> "6"
    assert "all arriving at t = 0" in describe(make_workload("uniform", 3))


# -- metrics -------------------------------------------------------------------------------------------------------

def test_request_metrics_properties():
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.0,
                       num_output_tokens=5)
    assert (m.queue_time, m.ttft, m.e2e_latency, m.tpot) == (0.5, 1.0, 3.0, 0.5)
    one = RequestMetrics(arrival_time=0.0, first_token_time=1.0, finished_time=1.0, num_output_tokens=1)
    assert one.tpot is None, "TPOT needs a second token"
    waiting = RequestMetrics(arrival_time=2.0)
    assert (waiting.queue_time, waiting.ttft, waiting.e2e_latency, waiting.tpot) == (None, None, None, None)


def test_percentiles():
    got = percentiles([4, 1, 3, 2])
    assert got == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert percentiles([7.0], ps=(0, 100)) == {"p0": 7.0, "p100": 7.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    with pytest.raises(ValueError, match="None"):
        percentiles([1.0, None])
    with pytest.raises(ValueError, match="0, 100"):
        percentiles([1.0], ps=(150,))


def hand_metrics():
    # (arrival, first scheduled, first token, finished, output tokens)
    rows = [(0.0, 0.0, 1.0, 3.0, 5), (0.0, 1.0, 2.0, 4.0, 3), (1.0, 1.0, 2.0, 2.0, 1), (2.0, 3.0, 5.0, 10.0, 11)]
    return [RequestMetrics(a, s, f, e, num_prompt_tokens=10, num_output_tokens=n, num_cached_tokens=2 * i)
            for i, (a, s, f, e, n) in enumerate(rows)]


def test_summarize_requests():
    s = summarize(hand_metrics(), wall_time=4.0)
    assert (s["num_requests"], s["num_finished"], s["output_tokens"], s["prompt_tokens"]) == (4, 4, 20, 40)
    assert s["cached_prompt_tokens"] == 0 + 2 + 4 + 6
    assert s["output_tokens_per_s"] == 5.0 and s["requests_per_s"] == 1.0
    # TTFT 1, 2, 1, 3 -> p50 1.5; e2e 3, 4, 1, 8 -> p50 3.5, p90 6.8; TPOT 0.5, 1.0, (none), 0.5 -> p50 0.5
    assert (s["ttft_p50"], s["e2e_p50"], s["tpot_p50"], s["queue_p50"]) == pytest.approx((1.5, 3.5, 0.5, 0.5))
    assert s["e2e_p90"] == pytest.approx(6.8) and s["tpot_p90"] == pytest.approx(0.9)
    derived = summarize(hand_metrics())                       # wall time = last finish - first arrival = 10
    assert derived["wall_time"] == 10.0 and derived["output_tokens_per_s"] == 2.0
    assert "mean_occupancy" not in derived, "no traces, no batch statistics"


def trace(step, n_sched, padding, free, hits, queries, preempted=(), tokens=8, spec=()):
    sched = [SeqStep(f"s{i}", f"s{i}", "decode", 1, 5, 4, 2) for i in range(n_sched)]
    for seq, (proposed, accepted) in zip(sched, spec):
        seq.proposed, seq.accepted = proposed, accepted
    return StepTrace(step=step, time=float(step), duration=0.1, scheduling="static", scheduled=sched, admitted=[],
                     preempted=list(preempted), finished=[], waiting=[], running=[], block_tables={}, num_blocks=10,
                     block_size=4, ref_counts=[0] * 10, cached_blocks=[], num_free_blocks=free,
                     num_batched_tokens=tokens, token_budget=32, max_num_seqs=4, num_padding_slots=padding,
                     prefix_cache_hits=hits, prefix_cache_queries=queries)


def test_summarize_traces():
    traces = [trace(0, 4, 0, free=6, hits=0, queries=4, tokens=10),
              trace(1, 2, 2, free=4, hits=2, queries=8, preempted=["a"], tokens=20),
              trace(2, 1, 3, free=8, hits=3, queries=12, preempted=["b", "c"], tokens=30)]
    s = summarize(hand_metrics(), traces, wall_time=4.0)
    assert s["num_steps"] == 3
    assert s["mean_occupancy"] == pytest.approx((4 / 4 + 2 / 4 + 1 / 4) / 3)
    assert s["mean_padding_share"] == pytest.approx((0 + 2 / 4 + 3 / 4) / 3)
    assert s["kv_usage_mean"] == pytest.approx(0.4) and s["kv_usage_peak"] == pytest.approx(0.6)
    assert s["prefix_cache_hit_rate"] == 0.25, "cumulative counters: the last trace's 3 / 12"
    assert s["preemptions"] == 3 and s["mean_tokens_per_step"] == 20
    assert "acceptance_rate" not in s, "no proposals, no speculative statistics"
    no_lookups = summarize(hand_metrics(), [trace(0, 1, 0, free=10, hits=0, queries=0)])
    assert no_lookups["prefix_cache_hit_rate"] is None


def test_summarize_splits_steps_with_prompt_tokens_from_decode_only_steps():
    traces = [trace(i, 2, 0, 5, 0, 0) for i in range(4)]
    for t, d in zip(traces, (0.5, 0.25, 0.125, 2.0)):
        t.duration = d
    traces[0].scheduled[1].phase = "prefill"                 # one prefill row beside a decode: a prompt step
    traces[3].scheduled[0].phase = "resumed"                 # a preempted sequence recomputing: a prompt step too
    s = summarize(hand_metrics(), traces)
    assert (s["prefill_steps"], s["decode_only_steps"]) == (2, 2)
    assert s["prefill_step_time"] == pytest.approx(2.5) and s["decode_only_time"] == pytest.approx(0.375)


def test_summarize_speculative_traces():
    traces = [trace(0, 3, 0, 5, 0, 0, spec=[(3, 2), (3, 3), (0, 0)]), trace(1, 1, 0, 5, 0, 0, spec=[(2, 0)])]
    s = summarize(hand_metrics(), traces)
    assert (s["spec_proposed"], s["spec_accepted"]) == (8, 5)
    assert s["acceptance_rate"] == 5 / 8
    assert s["tokens_per_verify_step"] == pytest.approx((3 + 4 + 1) / 3)    # accepted + 1 per verify
    a = 5 / 8                                                                 # the formula at that alpha, k = 3, 3, 2
    assert s["expected_tokens_per_verify_step"] == pytest.approx((2 * (1 + a + a**2 + a**3) + (1 + a + a**2)) / 3)


def test_summarize_bad_input():
    with pytest.raises(TypeError):
        summarize([{"arrival_time": 0.0}])
    with pytest.raises(TypeError):
        summarize(hand_metrics(), [{"step": 0}])
    with pytest.raises(ValueError, match="wall_time"):
        summarize(hand_metrics(), wall_time=0.0)


def test_format_table():
    rows = {"static": {"num_requests": 4, "output_tokens_per_s": 100.0, "ttft_p50": None, "mean_occupancy": 0.5},
            "continuous": {"num_requests": 4, "output_tokens_per_s": 250.0, "ttft_p50": 0.125,
                           "mean_occupancy": 0.875}}
    text = format_table(rows, ratio=("continuous", "static"))
    lines = text.splitlines()
    assert len(lines) == 2 + 3 and len({len(line) for line in lines}) == 1, "fixed width"
    assert lines[0].split() == ["run", "reqs", "out", "tok/s", "TTFT", "p50", "occupancy"]
    assert lines[2].split() == ["static", "4", "100", "-", "0.5"]
    assert lines[3].split() == ["continuous", "4", "250", "0.125", "0.875"]
    assert lines[4].split() == ["continuous/static", "1", "2.5", "-", "1.75"]
    assert add_ratio_row(rows, "continuous", "static")["continuous/static"]["output_tokens_per_s"] == 2.5
    only = format_table(rows, columns=["mean_occupancy"]).splitlines()
    assert only[0].split() == ["run", "occupancy"]
    with pytest.raises(ValueError, match="no row has"):
        format_table(rows, columns=["nonsense"])
    with pytest.raises(ValueError, match="no row"):
        format_table(rows, ratio=("continuous", "paged"))
    with pytest.raises(ValueError):
        format_table({})


def test_slot_and_critical_path_bounds():
    # two batches of two: static runs 6 + 2 steps; continuous keeps both slots busy: (6+1+1+2)/2 = 5 steps,
    # but the 6-token request alone needs 6
    lens = [6, 1, 1, 2]
    assert slot_bound(lens, 2) == (6 + 2) * 2 / 10
    assert critical_path_bound(lens, 2) == (6 + 2) / 6
    # many short requests: the critical path does not bind, and the two bounds agree up to rounding
    lens = [4, 1] * 8
    assert critical_path_bound(lens, 2) == 8 * 4 / 20 == slot_bound(lens, 2)
    # a single slot: static is already continuous
    assert slot_bound([3, 5, 2], 1) == critical_path_bound([3, 5, 2], 1) == 1.0
    for bad in (([], 2), ([3, 0], 2), ([3], 0)):
        with pytest.raises(ValueError, match="need output lengths"):
            slot_bound(*bad)
        with pytest.raises(ValueError, match="need output lengths"):
            critical_path_bound(*bad)
