"""Every figure of a run that the step traces hold, computed in one place.

Benchmarks (``bench/metrics.summarize``), renderers (``viz``), the lecture demo and the
server's live view all read a run through ``run_stats(traces)``, so a figure has one
definition. What it counts, per run:

* batch use: steps, tokens per step, occupancy (the share of the ``max_num_seqs``
  slots doing useful work; a static batch's finished members hold a slot and compute
  a thrown-away padding token, Orca §3) and the padding share;
* where the time went: steps that carry prompt tokens (a prefill, a chunk, a resumed
  sequence) and steps that only decode, each with its count and seconds. The slot model of
  batching counts decode steps only, so this split is what a comparison with it needs;
* the KV cache: the share of blocks in use (mean, peak), the prefix-cache hit rate
  (full blocks reused / full blocks looked up), preemptions;
* speculative decoding: drafts proposed and accepted, the acceptance rate α, the verify
  steps, and **tokens per target forward**. A verify step of k drafts with a accepted
  emits a + 1 tokens: the accepted drafts, then one token of the target's own, a *bonus*
  token when a = k and a *correction* token when a < k (Leviathan et al. 2023 §2.3).
  Beside it, the i.i.d. formula (1 - α^(k+1)) / (1 - α) at the measured α; and α by draft
  position (position i judged only when 1 .. i-1 were accepted; ``SpecStats.acceptance_by_position``).
  ``tokens_per_decode_forward`` counts every decode step of a sequence, with drafts or without (a
  proposer may find none), so it is what speculation bought per target forward over the whole run.

Two clocks. ``clock="wall"`` reads each step's measured ``duration`` (this machine); ``clock="simulated"``
reads its ``simulated_duration`` (``EngineConfig.simulate``: the step re-timed by ``minibatch.perf`` on a
GPU and a model we do not have). Every figure with seconds in it takes the clock, and says which
(``"clock"`` in the dicts). Per request (``request_stats``), on either clock, from the traces alone:

    TTFT = end of the step that gave its first token - arrival;  e2e = end of its last step - arrival;
    TPOT = (e2e - TTFT) / (output tokens - 1);  goodput = requests/s meeting TTFT <= slo["ttft"] and
    TPOT <= slo["tpot"] (DistServe, Zhong et al., OSDI 2024, Sec. 2: SLO attainment x request rate).
"""
from __future__ import annotations

import numpy as np

from minibatch.kv.tree import judged_depths
from minibatch.spec_decode.stats import SpecStats


def percentiles(xs, ps=(50, 90, 99)) -> dict:
    """{"p50": ..., "p90": ..., "p99": ...} of the numbers xs (linear interpolation, numpy's default).

    An empty xs gives None for every percentile: there is nothing to report, which is not 0.
    """
    xs = list(xs)
    if any(x is None for x in xs):
        raise ValueError("percentiles got None values; leave out the requests that have no value")
    if any(not 0 <= p <= 100 for p in ps):
        raise ValueError(f"percentiles must lie in [0, 100], got {list(ps)}")
    if not xs:
        return {f"p{p:g}": None for p in ps}
    vals = np.percentile(np.asarray(xs, dtype=float), list(ps))
    return {f"p{p:g}": float(v) for p, v in zip(ps, vals)}


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def spec_stats(traces) -> SpecStats:
    """The run's speculative counters, from the verify steps in the traces."""
    spec = SpecStats()
    for t in traces:
        for s in t.scheduled:
            if s.proposed:                          # a verify step: the accepted drafts + one target token
                spec.add(s.proposed, s.accepted, s.accepted + 1,
                         judged=judged_depths(s.draft_parents, s.accepted_path) if s.draft_parents else None)
    return spec


CLOCKS = ("wall", "simulated")


def step_times(traces, clock: str = "wall") -> list:
    """[(start, duration)] of each step on the clock: the engine's measured time or the simulated one."""
    if clock not in CLOCKS:
        raise ValueError(f"unknown clock {clock!r}; choose one of {list(CLOCKS)}")
    if clock == "wall":
        return [(t.time, t.duration) for t in traces]
    if any(t.simulated_duration is None for t in traces):
        raise ValueError("clock='simulated' needs traces with simulated_duration: run the engine with "
                         "simulate='HARDWARE:MODEL' (EngineConfig.simulate)")
    return [(t.simulated_time, t.simulated_duration) for t in traces]


def per_request(traces, clock: str = "wall", arrivals: dict | None = None) -> dict:
    """request id -> {"ttft", "tpot" (None for one token), "e2e", "output_tokens", "finished"} on the clock."""
    traces, arrivals = list(traces), dict(arrivals or {})
    first, last, n_out, seqs, finished = {}, {}, {}, {}, set()
    for t, (start, dur) in zip(traces, step_times(traces, clock)):
        for x in t.scheduled:
            if x.new_token_ids:
                first.setdefault(x.request_id, start + dur)
                n_out[x.request_id] = n_out.get(x.request_id, 0) + len(x.new_token_ids)
            last[x.request_id] = start + dur
            seqs.setdefault(x.request_id, set()).add(x.seq_id)
        finished.update(t.finished)
    out = {}
    for rid in first:
        arr = arrivals.get(rid, 0.0)
        out[rid] = {"ttft": first[rid] - arr, "e2e": last[rid] - arr, "output_tokens": n_out[rid],
                    "tpot": (last[rid] - first[rid]) / (n_out[rid] - 1) if n_out[rid] > 1 else None,
                    "finished": seqs[rid] <= finished}          # n > 1: when every sequence is
    return out


def request_stats(traces, clock: str = "wall", arrivals: dict | None = None, slo: dict | None = None) -> dict:
    """Throughput, TTFT / TPOT / e2e percentiles and goodput on one clock, from the traces.

    arrivals: request id -> arrival on the same clock (seconds since the engine started; missing: 0, an
    offline run). slo: {"ttft": s, "tpot": s} for goodput and SLO attainment."""
    traces, arrivals = list(traces), dict(arrivals or {})
    reqs, times = per_request(traces, clock, arrivals), step_times(traces, clock)
    done = [r for r in reqs.values() if r["finished"]]
    n_out = sum(r["output_tokens"] for r in reqs.values())
    span = (max(s + d for s, d in times) - min([0.0, *arrivals.values()])) if times else 0.0
    out = {"clock": clock, "num_finished": len(done), "output_tokens": n_out, "total_time": span,
           "output_tokens_per_s": n_out / span if span > 0 else None,
           "requests_per_s": len(done) / span if span > 0 else None}
    for name in ("ttft", "tpot", "e2e"):
        for p, v in percentiles([r[name] for r in reqs.values() if r[name] is not None]).items():
            out[f"{name}_{p}"] = v
    if slo is not None:
        bad = set(slo) - {"ttft", "tpot"}
        if bad or not slo:
            raise ValueError(f"slo takes keys 'ttft' and/or 'tpot' (seconds), got {sorted(slo)}")
        good = sum(1 for r in done if r["ttft"] <= slo.get("ttft", float("inf"))
                   and (r["tpot"] or 0.0) <= slo.get("tpot", float("inf")))
        out.update(slo_attainment=good / len(done) if done else None,
                   goodput=good / span if span > 0 else None)
    return out


def run_stats(traces, clock: str = "wall") -> dict:
    """One flat dict of the figures above (None where a run has nothing to say, e.g. no speculation)."""
    traces = list(traces)
    if not traces:
        return {"num_steps": 0}
    durations = [d for _, d in step_times(traces, clock)]
    used = [(t.num_blocks - t.num_free_blocks) / t.num_blocks for t in traces]
    last = traces[-1]                               # hits and queries are cumulative: the last trace has the totals
    useful = sum(len(t.scheduled) for t in traces)
    padding = sum(t.num_padding_slots for t in traces)
    s = {"num_steps": len(traces),
         "num_batched_tokens": sum(t.num_batched_tokens for t in traces),
         "mean_tokens_per_step": _mean(t.num_batched_tokens for t in traces),
         "generated_tokens": sum(len(x.new_token_ids) for t in traces for x in t.scheduled),
         "mean_occupancy": _mean(len(t.scheduled) / t.max_num_seqs for t in traces),
         "mean_padding_share": _mean(t.num_padding_slots / t.max_num_seqs for t in traces),
         "padding_slot_steps": padding,
         "useful_share_of_slots": useful / (useful + padding) if useful + padding else None,
         "kv_usage_mean": _mean(used), "kv_usage_peak": max(used),
         "prefix_cache_hits": last.prefix_cache_hits, "prefix_cache_queries": last.prefix_cache_queries,
         "prefix_cache_hit_rate": (last.prefix_cache_hits / last.prefix_cache_queries
                                   if last.prefix_cache_queries else None),
         "preemptions": sum(len(t.preempted) for t in traces), "clock": clock, "step_time": sum(durations)}
    with_prompt = [d for t, d in zip(traces, durations) if any(x.phase != "decode" for x in t.scheduled)]
    prompt_time = sum(with_prompt)
    s.update(prefill_steps=len(with_prompt), prefill_step_time=prompt_time,
             decode_only_steps=len(traces) - len(with_prompt),
             decode_only_time=sum(durations) - prompt_time)
    decode = [x for t in traces for x in t.scheduled if x.phase == "decode"]
    s["tokens_per_decode_forward"] = (sum(len(x.new_token_ids) for x in decode) / len(decode)) if decode else None
    spec = spec_stats(traces)
    if spec.proposed:
        s.update(speculative_method=last.speculative_method, spec_proposed=spec.proposed,
                 spec_accepted=spec.accepted, acceptance_rate=spec.acceptance_rate, verify_steps=spec.num_steps,
                 acceptance_by_position=spec.acceptance_by_position,                 # alpha_i, i = 1, 2, ...
                 tokens_per_verify_step=spec.mean_tokens_per_step,            # = tokens per target forward
                 expected_tokens_per_verify_step=spec.expected_tokens_per_step)
    return s
