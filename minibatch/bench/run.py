"""Benchmarks: measured in one process, against a baseline, on the same model and workload.

    python -m minibatch.bench batching     [--workload longtail --num-requests 96 --max-num-seqs 32 --prompt-len 32,192]
    python -m minibatch.bench speculative  [--methods draft,medusa --ks 1,2,3,4 --batch-sizes 1,8]
    python -m minibatch.bench trees        [--methods medusa,eagle --depth 4 --batch-sizes 1,8]  chains vs trees
    python -m minibatch.bench attention    Triton vs PyTorch paged attention (GB/s on a GPU)
    python -m minibatch.bench kv           KV memory holding tokens: contiguous vs paged; bytes and capacity per cache dtype
    python -m minibatch.bench kv-accuracy  what quantized KV blocks cost: bpb, KL, greedy agreement, K's outlier channels
    python -m minibatch.bench peers        against Hugging Face transformers on the same weights (optional dep)
    python -m minibatch.bench vllm         against vLLM's CPU build on the same weights (its own venv)
    python -m minibatch.bench online       latency against load (Poisson rates), static vs continuous, as a PNG
    python -m minibatch.bench serve        Poisson load on a running `python -m minibatch serve`
    python -m minibatch.bench disagg       colocated vs disaggregated prefill/decode: TTFT and TPOT under load
    python -m minibatch.bench profile      where a full-batch decode step's time goes, per attention backend
    python -m minibatch.bench calibrate    this machine's hardware profile for the simulated clock, measured
    python -m minibatch.bench validate     the simulated clock's predicted step times against measured ones
    python -m minibatch.bench preemption   swap against recompute per block size, both clocks (PagedAttention Fig. 19)
    python -m minibatch.bench offload      the prefix cache's host tier on a multi-turn chat, both clocks
    python -m minibatch.bench host-cpu     the CPU's time per step outside the forward (the clock's host profile)
    python -m minibatch.bench async        sync vs async scheduling on batching's workload; the time not overlapped
    python -m minibatch.bench prefix       fcfs / lpm / dfs-weight x hash / radix on few-shot prompts, both clocks

Timings are wall-clock on whatever device runs the model; both sides of every
ratio run in this process, one after the other, after a warm-up. ``--simulate h100:llama-3-8b`` (batching,
speculative, trees, online) times every step on a simulated GPU and model instead (``minibatch.perf``), and
says so above its tables.
"""
from __future__ import annotations

import argparse
import time

import torch

from minibatch.llm import LLM
from minibatch.bench.metrics import (critical_path_bound, fcfs_bound, fcfs_schedule_steps, format_table, slot_bound,
                                     static_steps, summarize)
from minibatch.trace import TraceRecorder
from minibatch.model.weights import load_model
from minibatch.bench.workload import describe, make_workload


def run_workload(model, workload, temperature=0.0, **engine_kwargs):
    """Drive an engine through a workload on the real clock (arrivals honoured); return (summary, traces, outs).

    With ``simulate=...`` the arrivals are honoured on the simulated clock instead (the engine's
    ``simulated_time``, moved forward to the next arrival when idle) and the summary is on that clock."""
    if engine_kwargs.get("simulate"):
        return _run_simulated(model, workload, temperature, **engine_kwargs)
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


def _run_simulated(model, workload, temperature=0.0, **engine_kwargs):
    llm = LLM(model, **engine_kwargs)
    eng, rec = llm.llm_engine, TraceRecorder()
    eng.add_hook(rec)
    pending, outs = sorted(workload, key=lambda r: r.arrival_time), {}
    while pending or eng.has_unfinished_requests():
        if not eng.has_unfinished_requests() and pending[0].arrival_time > eng.simulated_time:
            eng.simulated_time = pending[0].arrival_time          # idle: the clock jumps to the next arrival
        while pending and pending[0].arrival_time <= eng.simulated_time:
            r = pending.pop(0)
            eng.add_request(r.request_id, r.prompt, r.sampling_params(temperature=temperature), priority=r.priority)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    arrivals = {r.request_id: r.arrival_time for r in workload}
    metrics = [outs[r.request_id].metrics for r in workload]
    return summarize(metrics, rec.traces, clock="simulated", arrivals=arrivals), rec.traces, outs


def bench_models(args, names: list) -> None:
    """Two (or more) shipped models on the same workload, continuous batching, alternating rounds: the Llama
    against the GPT target at the same width (issue 34: its throughput within 10 %)."""
    models = {n: load_model(n, device=args.device) for n in names}
    wl = make_workload(args.workload, num_requests=args.num_requests, seed=args.seed, arrival=args.arrival,
                       rate=args.rate, **({"prompt_len": args.prompt_len} if args.prompt_len else {}))
    print(describe(wl))
    common = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, attention_backend=args.backend)
    for m in models.values():
        run_workload(m, wl[:4], **common)                                           # warm-up
    tps = {n: [] for n in names}
    for _ in range(args.repeats):                   # alternating: a slow spell of a shared machine hits every side
        for n, m in models.items():
            summary, _, _ = run_workload(m, wl, **common)
            tps[n].append(summary["output_tokens_per_s"])
    base = names[0]
    print(f"continuous batching, output tokens/s, best of {args.repeats} alternating rounds (min-max); "
          f"ratio of bests to {base} (per-round range)")
    for n, m in models.items():
        c = m.config
        rounds = [a / b for a, b in zip(tps[n], tps[base])]
        print(f"  {n:8s} {type(m).__name__:5s} {m.num_params():>10,} params, {c.n_head} q / {c.num_kv_heads} kv heads: "
              f"{max(tps[n]):7.0f} tok/s ({min(tps[n]):.0f}-{max(tps[n]):.0f})  {max(tps[n]) / max(tps[base]):.2f}x "
              f"({min(rounds):.2f}-{max(rounds):.2f})")


def bench_batching(args) -> None:
    if "," in args.model:
        return bench_models(args, args.model.split(","))
    model = load_model(args.model, device=args.device)
    wl = make_workload(args.workload, num_requests=args.num_requests, seed=args.seed, arrival=args.arrival,
                       rate=args.rate, **({"prompt_len": args.prompt_len} if args.prompt_len else {}))
    print(f"device: {model.device}; model: {args.model} ({type(model).__name__}, {model.num_params():,} parameters)")
    print(describe(wl))
    common = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, attention_backend=args.backend, simulate=args.simulate)
    if args.simulate:                   # the simulated clock is a function of the traces: one round says it all
        print(f"simulating {args.simulate}: every step re-timed by minibatch.perf's roofline; tokens from the tiny model")
        args.repeats = 1
    run_workload(model, wl[:4], **common)                                   # warm-up
    # Rounds alternate (static, continuous, static, ...), so a slow spell of a shared machine hits both sides;
    # each side keeps its best round (noise only slows), and the spread is the range of the per-round ratios.
    rows, outputs, ratios = {}, {}, []
    for _ in range(args.repeats):
        tps = {}
        for name in ("static", "continuous"):
            summary, _, outs = run_workload(model, wl, scheduling=name, **common)
            tps[name] = summary["output_tokens_per_s"]
            if name not in rows or tps[name] > rows[name]["output_tokens_per_s"]:
                rows[name], outputs[name] = summary, outs
        ratios.append(tps["continuous"] / tps["static"])
    same = all(outputs["static"][r.request_id].outputs[0].token_ids ==
               outputs["continuous"][r.request_id].outputs[0].token_ids for r in wl)
    print(format_table(rows, ratio=("continuous", "static")))
    ratio = rows["continuous"]["output_tokens_per_s"] / rows["static"]["output_tokens_per_s"]
    rounds = ("one round: the simulated clock does not vary" if args.simulate else
              f"best round of each side of {args.repeats}; per-round {min(ratios):.2f}-{max(ratios):.2f}")
    print(f"\ncontinuous / static throughput: {ratio:.2f}x ({rounds}); mean occupancy {rows['static']['mean_occupancy']:.0%} (static) vs "
          f"{rows['continuous']['mean_occupancy']:.0%} (continuous); greedy outputs identical: {same}")
    text, net = where_the_time_goes(rows)
    print(text)
    if args.arrival == "offline":               # the bounds assume everyone waits at t = 0
        lens, slots = [r.max_tokens for r in wl], args.max_num_seqs
        bound, cp, fcfs = slot_bound(lens, slots), critical_path_bound(lens, slots), fcfs_bound(lens, slots)
        steps = rows["static"]["num_steps"] / rows["continuous"]["num_steps"]
        print(f"ideal FCFS slot schedule {fcfs:.2f}x (lengths packed in arrival order into {slots} slots, its drain "
              f"simulated: {fcfs_schedule_steps(lens, slots)} decode steps against static's {static_steps(lens, slots)}"
              f"); measured = {ratio / fcfs:.2f} of it")
        print(f"slot-model bound {bound:.2f}x (measured = {ratio / bound:.2f} of it"
              + (f"; {net / bound:.2f} without the prompt work" if net else "") + f"); with the longest request's "
              f"critical path {cp:.2f}x (sum over static batches of the longest / max(longest, sum / slots) steps)")
        # The slot model counts steps as if each cost the same (a GPU running a small model nearly does); a CPU
        # step costs more the more rows, and the longer contexts, it has.
        print(f"in steps, as the slot model counts: static / continuous = {steps:.2f}x = {steps / bound:.2f} of the bound")


def where_the_time_goes(rows: dict) -> tuple[str, float | None]:
    """Each run's steps split into those that carry prompt tokens and those that only decode, with their seconds,
    and (returned beside the text) continuous/static with the prompt work taken out of both sides' wall time.

    Why: the slot model counts decode steps only, while both schedulers compute the same prompt tokens, and
    that shared work dilutes the end-to-end ratio. Static batching prefills in steps of its own, so its steps
    with prompt tokens measure that work. It is an estimate: continuous batching computes the same tokens as
    chunks inside decode steps, where they may cost a little more or less."""
    lines = ["where the time goes (best round):",
             f"  {'':<32} {'steps':>6}  {'steps with prompt':>17}  {'decode-only steps':>17}  ms per decode-only step"]
    for name in ("static", "continuous"):
        r = rows[name]
        per = 1e3 * r["decode_only_time"] / r["decode_only_steps"] if r["decode_only_steps"] else float("nan")
        lines.append(f"  {name:<32} {r['num_steps']:>6}  {r['prefill_steps']:>5} in {r['prefill_step_time']:6.2f} s  "
                     f"{r['decode_only_steps']:>5} in {r['decode_only_time']:6.2f} s  {per:.2f}")
    s, c = rows["static"], rows["continuous"]
    prompt = s["prefill_step_time"]          # both schedulers compute the same prompt tokens; static in steps of its own
    net = (s["wall_time"] - prompt) / (c["wall_time"] - prompt) if c["wall_time"] > prompt else None
    if net:
        lines.append(f"  steps with prompt tokens are {prompt / s['wall_time']:.0%} of static's wall time and "
                     f"{c['prefill_step_time'] / c['wall_time']:.0%} of continuous's; the same prompt work "
                     f"({prompt:.2f} s, static's) taken out of both: {net:.2f}x")
    return "\n".join(lines), net


# Benchmarks that live in modules of their own: python -m minibatch.bench NAME [their options]
OTHERS = {"attention": "minibatch.bench.attention", "kv": "minibatch.bench.kv_efficiency",
          "kv-accuracy": "minibatch.bench.kv_accuracy",
          "peers": "minibatch.bench.peers", "vllm": "minibatch.bench.vllm_peer", "online": "minibatch.bench.online",
          "serve": "minibatch.bench.serve", "trees": "minibatch.bench.trees", "disagg": "minibatch.bench.disagg",
          "gpu-check": "minibatch.bench.gpu_check", "profile": "minibatch.bench.step_profile",
          "calibrate": "minibatch.bench.calibrate", "validate": "minibatch.bench.validate",
          "preemption": "minibatch.bench.preemption", "offload": "minibatch.bench.offload",
          "host-cpu": "minibatch.bench.host_cpu", "async": "minibatch.bench.asynchronous",
          "prefix": "minibatch.bench.prefix"}


PEERS = ("peers", "vllm", "serve")   # benches with a --threads of their own (one count for both sides of each row)


def main(argv=None):
    import importlib
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    from minibatch.engine import threads       # --threads N, anywhere on the line, for every bench
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    threads.add_argument(pre)
    known, argv = pre.parse_known_args(argv)
    threads.use_cli(known.threads)
    if argv and argv[0] in OTHERS:
        if argv[0] in PEERS and known.threads is not None:   # theirs sets both sides' threads: hand it on
            argv += ["--threads", str(known.threads)]
        code = importlib.import_module(OTHERS[argv[0]]).main(argv[1:])
        return code if isinstance(code, int) else 0       # an exit status; some mains return their figures
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["batching", "speculative", *OTHERS])
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default="target", help="batching: the shipped model served (target, llama); "
                                                      "target,llama: both, alternating, continuous batching")
    ap.add_argument("--workload", default="longtail")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--arrival", default="offline")
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--prompt-len", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                    metavar="LO,HI", help="batching: prompt bytes drawn uniformly from LO..HI (default: "
                                          "make_workload's, 32,192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate", default=None, metavar="HW:MODEL",
                    help="also time every step on a simulated GPU and model, e.g. h100:llama-3-8b (minibatch.perf); "
                         "batching's tables are then on the simulated clock")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--attention-backend", "--backend", dest="backend", default=None,
                    help="attention backend: cpu, batched, loop or triton (default: the engine's, cpu on a CPU)")
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3, 4, 8])
    ap.add_argument("--typical", action="store_true",
                    help="speculative: also Medusa with typical acceptance at temperature 1 (lossy)")
    ap.add_argument("--kv-reuse", choices=["on", "off", "both"], default="on",
                    help="speculative: early exit with LayerSkip's KV reuse (on), the recompute variant "
                         "(off, row ee-recomp), or a row of each")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=None,
                    help="speculative: comma-separated (default: every method whose weights ship)")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rounds, alternating the two sides, best of each kept (batching: static and "
                         "continuous; speculative: plain and each row)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    with torch.no_grad():                      # inference only; the caller's grad mode comes back after
        if args.which == "batching":
            bench_batching(args)
        else:
            from minibatch.bench.speculative import bench_speculative
            bench_speculative(args)

