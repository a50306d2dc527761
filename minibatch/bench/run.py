"""Benchmarks: measured in one process, against a baseline, on the same model and workload.

    python -m minibatch.bench batching     [--workload longtail --num-requests 96 --max-num-seqs 32]
    python -m minibatch.bench speculative  [--ks 1,2,3,4,6,8 --batch-sizes 1,8]
    python -m minibatch.bench attention    Triton vs PyTorch paged attention (GB/s on a GPU)
    python -m minibatch.bench kv           KV memory holding tokens: contiguous vs paged
    python -m minibatch.bench peers        against Hugging Face transformers on the same weights (optional dep)
    python -m minibatch.bench online       latency against load (Poisson rates), static vs continuous, as a PNG
    python -m minibatch.bench serve        Poisson load on a running `python -m minibatch serve`

Timings are wall-clock on whatever device runs the model; both sides of every
ratio run in this process, one after the other, after a warm-up.
"""
from __future__ import annotations

import argparse
import time

import torch

from minibatch.engine.llm import LLM
from minibatch.bench.metrics import format_table, summarize
from minibatch.trace import TraceRecorder
from minibatch.model.weights import load_model
from minibatch.bench.workload import describe, make_workload


def run_workload(model, workload, temperature=0.0, **engine_kwargs):
    """Drive an engine through a workload on the real clock (arrivals honoured); return (summary, traces, outs)."""
    llm = LLM(model, **engine_kwargs)
    eng, rec = llm.llm_engine, TraceRecorder()
    eng.add_hook(rec)
    pending = sorted(workload, key=lambda r: r.arrival_time)
    t0, outs = time.perf_counter(), {}
    while pending or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_time <= now:
            r = pending.pop(0)
            eng.add_request(r.request_id, r.prompt, r.sampling_params(temperature=temperature),
                            priority=r.priority, arrival_time=t0 + r.arrival_time)
        if not eng.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0].arrival_time - now)))
            continue
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    wall = time.perf_counter() - t0
    metrics = [outs[r.request_id].metrics for r in workload]
    return summarize(metrics, rec.traces, wall), rec.traces, outs


def bench_batching(args) -> None:
    model = load_model("target", device=args.device)
    wl = make_workload(args.workload, num_requests=args.num_requests, seed=args.seed, arrival=args.arrival,
                       rate=args.rate)
    print(f"device: {model.device}; model: target ({model.num_params():,} parameters)")
    print(describe(wl))
    common = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, attention_backend=args.backend)
    run_workload(model, wl[:4], **common)                                   # warm-up
    rows, outputs = {}, {}
    for name in ("static", "continuous"):
        summary, _, outs = run_workload(model, wl, scheduling=name, **common)
        rows[name], outputs[name] = summary, outs
    same = all(outputs["static"][r.request_id].outputs[0].token_ids ==
               outputs["continuous"][r.request_id].outputs[0].token_ids for r in wl)
    print(format_table(rows, ratio=("continuous", "static")))
    ratio = rows["continuous"]["output_tokens_per_s"] / rows["static"]["output_tokens_per_s"]
    print(f"\ncontinuous / static throughput: {ratio:.2f}x; mean occupancy "
          f"{rows['static']['mean_occupancy']:.0%} (static) vs {rows['continuous']['mean_occupancy']:.0%} "
          f"(continuous); greedy outputs identical: {same}")


def bench_speculative(args) -> None:
    from minibatch.model.data import val_documents
    from minibatch.engine.sampler import SamplingParams
    from minibatch.spec_decode.stats import expected_speedup, expected_tokens_per_step
    model = load_model("target", device=args.device)
    draft = load_model("draft", device=model.device)
    print(f"device: {model.device}; target {model.num_params():,} parameters, draft {draft.num_params():,}")
    docs = val_documents(32, min_len=600, seed=11)
    prompts = [d[:160].decode("utf-8", "ignore") for d in docs]
    c = _cost_ratio(model, draft)
    print(f"draft/target cost per forward, c = {c:.2f} (measured, batch 1 decode step)")
    print(f"each row: best of {args.repeats} runs, alternating with plain decoding (base) on the same prompts;\n"
          f"formula = (1 - a^(k+1)) / (1 - a) tokens per target forward; predicted = formula / (c k + 1) "
          f"(Leviathan et al. 2023), with c = 0 for prompt lookup")
    print(f"{'entropy':<8}{'batch':>6}{'method':>8}{'k':>4}{'tok/s':>9}{'base':>8}{'speedup':>9}{'alpha':>7}"
          f"{'tok/fwd':>9}{'formula':>9}{'predicted':>11}")
    for temp, label in ((0.0, "low"), (1.0, "high")):
        for bs in args.batch_sizes:
            ps = prompts[:bs]
            sp = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0 if temp else None)
            plain = LLM(model, max_num_seqs=max(bs, 1))
            for method in ("draft", "ngram"):
                for k in args.ks:
                    llm = LLM(model, draft_model=draft, max_num_seqs=max(bs, 1),
                              speculative_config={"method": method, "num_speculative_tokens": k})
                    (base, _), (tps, outs) = _timed_pair(plain, llm, ps, sp, args.repeats)
                    spec = [o.outputs[0].spec for o in outs]
                    prop, acc = sum(s["proposed"] for s in spec), sum(s["accepted"] for s in spec)
                    per_fwd = sum(s["emitted"] for s in spec) / max(sum(s["num_steps"] for s in spec), 1)
                    alpha = acc / prop if prop else 0.0
                    cost = c if method == "draft" else 0.0
                    print(f"{label:<8}{bs:>6}{method:>8}{k:>4}{tps:>9.1f}{base:>8.1f}{tps / base:>9.2f}"
                          f"{alpha:>7.2f}{per_fwd:>9.2f}{expected_tokens_per_step(alpha, k):>9.2f}"
                          f"{expected_speedup(alpha, k, cost):>11.2f}")


def _timed_pair(a, b, prompts, params, repeats=3):
    """Output tokens/s of two engines on the same prompts: runs alternate (a, b, a, b, ...) so a slow spell
    of a shared machine hits both sides, and each keeps its best run (as timeit does: noise only slows)."""
    best, outs = [float("inf")] * 2, [None, None]
    for llm in (a, b):
        llm.generate(prompts[:1], params, use_tqdm=False)                  # warm-up
    for _ in range(repeats):
        for i, llm in enumerate((a, b)):
            t = time.perf_counter()
            outs[i] = llm.generate(prompts, params, use_tqdm=False)        # greedy / seeded: same every run
            best[i] = min(best[i], time.perf_counter() - t)
    n = [sum(len(o.outputs[0].token_ids) for o in out) for out in outs]
    return (n[0] / best[0], outs[0]), (n[1] / best[1], outs[1])


def _cost_ratio(model, draft, reps=50, rounds=5) -> float:
    """c = (draft decode step) / (target decode step), batch 1, through the engine. Rounds alternate the two
    models and each keeps its fastest round, so a slow spell of a shared machine does not skew the ratio."""
    from minibatch.engine.sampler import SamplingParams
    engines = []
    for m in (model, draft):
        eng = LLM(m, max_num_seqs=1).llm_engine
        eng.add_request("c", "def f(x):\n", SamplingParams(temperature=0, max_tokens=rounds * reps + 1))
        eng.step()                                                           # prefill
        engines.append(eng)
    best = [float("inf")] * 2
    for _ in range(rounds):
        for i, eng in enumerate(engines):
            t = time.perf_counter()
            for _ in range(reps):
                eng.step()
            best[i] = min(best[i], (time.perf_counter() - t) / reps)
    return best[1] / best[0]


# Benchmarks that live in modules of their own: python -m minibatch.bench NAME [their options]
OTHERS = {"attention": "minibatch.bench.attention", "kv": "minibatch.bench.kv_efficiency",
          "peers": "minibatch.bench.peers", "online": "minibatch.bench.online", "serve": "minibatch.bench.serve"}


def main(argv=None):
    import importlib
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OTHERS:
        importlib.import_module(OTHERS[argv[0]]).main(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["batching", "speculative", *OTHERS])
    ap.add_argument("--device", default=None)
    ap.add_argument("--workload", default="longtail")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--arrival", default="offline")
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--backend", default="batched", help="attention backend: batched, loop or triton")
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="speculative: timed runs per row, best kept")
    args = ap.parse_args(argv)
    with torch.no_grad():                      # inference only; the caller's grad mode comes back after
        (bench_batching if args.which == "batching" else bench_speculative)(args)

