"""Serving metrics: what a user feels (latency) and what the operator pays for (throughput, occupancy).

Per request (``RequestMetrics``, filled by the engine with ``time.perf_counter`` seconds):

    arrival ──queue──> first scheduled ──prefill──> first token ──decode──> finished
    |<──────────── TTFT ────────────────────────────>|<── (n-1) x TPOT ──>|
    |<──────────────────────────── e2e latency ──────────────────────────>|

TTFT (time to first token) is dominated by queueing and prefill; TPOT (time
per output token after the first) by how many other sequences share each
decode step. Per run (``summarize``): throughput, latency percentiles, and,
from the step traces, how well the batch and the KV cache were used:

* occupancy: the share of the ``max_num_seqs`` batch slots doing useful work
  in a step. A static batch keeps a slot for a finished member until the whole
  batch is done (``trace.num_padding_slots``); continuous batching hands the
  slot to the next request at once (Yu et al., Orca, 2022, Sec. 3);
* KV usage: the share of blocks in use, (num_blocks - num_free_blocks) / num_blocks;
* prefix-cache hit rate: full blocks reused / full blocks looked up;
* speculative decoding: proposed, accepted, acceptance rate alpha, and tokens
  per verify step beside what ``spec_decode.stats.expected_tokens_per_step`` predicts at that alpha
  (the trace figures come from ``minibatch.stats.run_stats``, their one definition).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from minibatch.engine.outputs import RequestMetrics
from minibatch.stats import percentiles, request_stats, run_stats  # noqa: F401 (percentiles: the one definition)
from minibatch.trace import StepTrace


def summarize(metrics: list, traces: Optional[list] = None, wall_time: Optional[float] = None,
              clock: str = "wall", arrivals: Optional[dict] = None) -> dict:
    """One flat dict per run: request counts, throughput, latency percentiles; batch and cache use from traces.

    wall_time: the run's duration in seconds; if None, from the first arrival to the last finish.
    clock="simulated": every figure with seconds in it comes from the traces' ``simulated_duration``
    (``minibatch.stats.request_stats``; arrivals: request id -> arrival on that clock), and ``wall_time``
    is the simulated run's length. The dict says which clock (``"clock"``).
    """
    if clock == "simulated":
        return _summarize_simulated(list(metrics), list(traces or []), arrivals)
    metrics, traces = list(metrics), list(traces or [])
    if any(not isinstance(m, RequestMetrics) for m in metrics):
        raise TypeError("summarize needs a list of RequestMetrics")
    if any(not isinstance(t, StepTrace) for t in traces):
        raise TypeError("traces must be StepTrace objects (TraceRecorder.load gives them from JSON)")
    if wall_time is not None and not wall_time > 0:
        raise ValueError(f"wall_time must be > 0 seconds, got {wall_time}")
    done = [m for m in metrics if m.finished_time is not None]
    if wall_time is None and done:
        wall_time = max(m.finished_time for m in done) - min(m.arrival_time for m in metrics)
        wall_time = wall_time if wall_time > 0 else None
    out_tokens = sum(m.num_output_tokens for m in metrics)
    s = {"num_requests": len(metrics), "num_finished": len(done),
         "prompt_tokens": sum(m.num_prompt_tokens for m in metrics), "output_tokens": out_tokens,
         "cached_prompt_tokens": sum(m.num_cached_tokens for m in metrics), "wall_time": wall_time,
         "output_tokens_per_s": out_tokens / wall_time if wall_time else None,
         "requests_per_s": len(done) / wall_time if wall_time else None}
    for name in ("ttft", "tpot", "e2e_latency", "queue_time"):
        values = [getattr(m, name) for m in metrics]
        short = name.split("_")[0]                                  # ttft, tpot, e2e, queue
        for p, v in percentiles([v for v in values if v is not None]).items():
            s[f"{short}_{p}"] = v
    s["preemptions"] = sum(len(t.preempted) for t in traces) if traces else sum(m.num_preemptions for m in metrics)
    if traces:
        s.update(_from_traces(traces))
    s["clock"] = "wall"
    return s


def _summarize_simulated(metrics: list, traces: list, arrivals: Optional[dict]) -> dict:
    if not traces or any(not isinstance(t, StepTrace) for t in traces):
        raise TypeError("clock='simulated' needs the run's StepTrace list")
    r = request_stats(traces, "simulated", arrivals)
    s = {"num_requests": len(metrics), "num_finished": r["num_finished"],
         "prompt_tokens": sum(m.num_prompt_tokens for m in metrics), "output_tokens": r["output_tokens"],
         "cached_prompt_tokens": sum(m.num_cached_tokens for m in metrics), "wall_time": r["total_time"],
         "output_tokens_per_s": r["output_tokens_per_s"], "requests_per_s": r["requests_per_s"]}
    s.update({k: v for k, v in r.items() if k.split("_")[0] in ("ttft", "tpot", "e2e")})
    s["preemptions"] = sum(len(t.preempted) for t in traces)
    s.update(_from_traces(traces, "simulated"))
    s["clock"] = "simulated"
    return s


def fcfs_schedule_steps(max_tokens: list, slots: int) -> int:
    """Decode steps of the ideal FCFS slot schedule: each length, in arrival order, goes to the slot that frees
    first (a greedy packing into ``slots`` slots), one token per slot per step, the drain included: the run
    ends when the last slot empties. The slot model's bound ignores that drain (it divides by sum / slots)."""
    import heapq
    _check_lengths(max_tokens, slots)
    free = [0] * min(slots, len(max_tokens))          # the step at which each slot next frees
    for n in max_tokens:
        heapq.heappush(free, heapq.heappop(free) + n)
    return max(free)


def fcfs_bound(max_tokens: list, slots: int) -> float:
    """Static batching's decode steps over the ideal FCFS slot schedule's: what continuous batching can reach on
    these lengths with its drain counted, in steps (each step costing the same)."""
    return static_steps(max_tokens, slots) / fcfs_schedule_steps(max_tokens, slots)


def _from_traces(traces: list, clock: str = "wall") -> dict:
    keep = ("num_steps", "mean_occupancy", "mean_padding_share", "mean_tokens_per_step", "kv_usage_mean",
            "kv_usage_peak", "prefix_cache_hit_rate", "spec_proposed", "spec_accepted", "acceptance_rate",
            "tokens_per_verify_step", "expected_tokens_per_verify_step", "prefill_steps", "prefill_step_time",
            "decode_only_steps", "decode_only_time")
    return {k: v for k, v in run_stats(traces, clock).items() if k in keep}


# -- a text table, one row per run --------------------------------------------------------------------------------

LABELS = {"num_requests": "reqs", "output_tokens_per_s": "out tok/s", "requests_per_s": "req/s",
          "ttft_p50": "TTFT p50", "ttft_p99": "TTFT p99", "tpot_p50": "TPOT p50", "tpot_p99": "TPOT p99",
          "e2e_p50": "e2e p50", "e2e_p99": "e2e p99", "mean_occupancy": "occupancy",
          "mean_tokens_per_step": "tok/step", "kv_usage_mean": "KV mean", "kv_usage_peak": "KV peak",
          "prefix_cache_hit_rate": "hit rate", "preemptions": "preempt", "acceptance_rate": "alpha",
          "tokens_per_verify_step": "tok/verify",
          "expected_tokens_per_verify_step": "formula", "num_steps": "steps", "wall_time": "wall s"}
DEFAULT_COLUMNS = ["num_requests", "wall_time", "output_tokens_per_s", "requests_per_s", "ttft_p50", "ttft_p99",
                   "tpot_p50", "e2e_p50", "e2e_p99", "num_steps", "mean_occupancy", "mean_tokens_per_step",
                   "kv_usage_mean", "kv_usage_peak", "prefix_cache_hit_rate", "preemptions", "acceptance_rate",
                   "tokens_per_verify_step", "expected_tokens_per_verify_step"]


def slot_bound(max_tokens: list, slots: int) -> float:
    """The slot model's continuous/static ratio: (sum over static batches of the longest member x slots) /
    sum of output tokens. It counts steps as if every step cost the same and continuous batching kept every
    slot busy to the end; requests batched in arrival order, ``slots`` at a time, as the static scheduler does."""
    _check_lengths(max_tokens, slots)
    return static_steps(max_tokens, slots) * slots / sum(max_tokens)


def critical_path_bound(max_tokens: list, slots: int) -> float:
    """The slot model's ratio with the longest request's critical path: continuous batching still needs at least
    max(longest, ceil(sum / slots)) decode steps, since one request decodes one token a step. Where a workload's
    longest request is long against sum / slots (few requests, a long tail), this bound, not ``slot_bound``,
    is what any scheduler can reach."""
    _check_lengths(max_tokens, slots)
    floor = max(max(max_tokens), -(-sum(max_tokens) // slots))
    return static_steps(max_tokens, slots) / floor


def static_steps(max_tokens: list, slots: int) -> int:
    """Static batching's decode steps: each batch of ``slots`` requests, in arrival order, runs its longest."""
    return sum(max(max_tokens[s:s + slots]) for s in range(0, len(max_tokens), slots))


def _check_lengths(max_tokens: list, slots: int) -> None:
    if not max_tokens or any(n < 1 for n in max_tokens) or slots < 1:
        raise ValueError(f"need output lengths >= 1 and slots >= 1, got {len(max_tokens)} lengths "
                         f"(min {min(max_tokens, default=None)}) and slots={slots}")


def add_ratio_row(rows: dict, a: str, b: str) -> dict:
    """rows plus a row "a/b" holding a's value over b's for every numeric column both have."""
    for name in (a, b):
        if name not in rows:
            raise ValueError(f"no row {name!r} to take a ratio of; rows are {list(rows)}")
    ratio = {}
    for col, x in rows[a].items():
        y = rows[b].get(col)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y != 0:
            ratio[col] = x / y
    return {**rows, f"{a}/{b}": ratio}


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return f"{v:.4g}"
    return str(v)


def format_table(rows: dict, columns: Optional[list] = None, ratio: Optional[tuple] = None) -> str:
    """A fixed-width table: one line per run (e.g. "static", "continuous"), one column per metric.

    columns: summary keys to show (default: DEFAULT_COLUMNS that any row has); ratio=(a, b) adds a row
    "a/b" (see add_ratio_row). Missing values print as "-".
    """
    if not isinstance(rows, dict) or not rows or any(not isinstance(r, dict) for r in rows.values()):
        raise ValueError("rows must be a non-empty dict: run name -> summary dict")
    if ratio is not None:
        rows = add_ratio_row(rows, *ratio)
    if columns is None:
        columns = [c for c in DEFAULT_COLUMNS if any(r.get(c) is not None for r in rows.values())]
    unknown = [c for c in columns if all(c not in r for r in rows.values())]
    if unknown:
        raise ValueError(f"no row has column(s) {unknown}")
    names = [str(n) for n in rows]
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows.values()]
    headers = [LABELS.get(c, c) for c in columns]
    w0 = max(len("run"), *(len(n) for n in names))
    widths = [max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(headers)]
    lines = ["  ".join(["run".ljust(w0)] + [h.rjust(w) for h, w in zip(headers, widths)])]
    lines.append("-" * len(lines[0]))
    for name, row in zip(names, cells):
        lines.append("  ".join([name.ljust(w0)] + [c.rjust(w) for c, w in zip(row, widths)]))
    clocks = sorted({str(r["clock"]) for r in rows.values() if r.get("clock")})
    if clocks:                          # every table says which clock its seconds are on
        lines.insert(0, f"clock: {' + '.join(clocks)}" + (" (simulated: minibatch.perf's cost model, not measured)"
                                                         if "simulated" in clocks else " (measured on this machine)"))
    return "\n".join(lines)
