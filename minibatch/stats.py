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
"""
from __future__ import annotations

from minibatch.spec_decode.stats import SpecStats
from minibatch.spec_decode.tree import judged_depths


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


def run_stats(traces) -> dict:
    """One flat dict of the figures above (None where a run has nothing to say, e.g. no speculation)."""
    traces = list(traces)
    if not traces:
        return {"num_steps": 0}
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
         "preemptions": sum(len(t.preempted) for t in traces)}
    with_prompt = [t for t in traces if any(x.phase != "decode" for x in t.scheduled)]
    prompt_time = sum(t.duration for t in with_prompt)
    s.update(prefill_steps=len(with_prompt), prefill_step_time=prompt_time,
             decode_only_steps=len(traces) - len(with_prompt),
             decode_only_time=sum(t.duration for t in traces) - prompt_time)
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
