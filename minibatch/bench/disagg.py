"""Colocated against disaggregated prefill/decode under Poisson load: TTFT and TPOT (DistServe, OSDI'24, §2).

    python -m minibatch.bench disagg [--rates 4,8 --num-requests 48 --prompt-len 200,400 --max-num-seqs 8]

What to look for: in one engine a long prompt's step stalls every running decode (the TPOT spike that
chunked prefill softens); split into a prefill instance and a decode instance, decode steps never carry a
prompt, so TPOT stays at a decode step's cost, while each prompt pays a KV transfer on its way to the first
token... and the first token itself comes from the prefill instance as soon as its step is done.

On this machine the comparison is not of equal hardware: the colocated engine runs in one process on one
thread, the pair on two processes (one thread each), as DistServe compares one instance on 2 GPUs with a
1 + 1 pair; so the table also runs the colocated engine with 2 threads (``colocated-2t``). Both sides see the
same requests (prompts, lengths, arrival times), alternately, ``--repeats`` rounds; a row keeps its best
(lowest p90 TPOT) round and prints the range of p90 TPOT over rounds.

``--simulate h100:llama-3-8b`` asks DistServe's question on the simulated clock instead (``minibatch.perf``;
``disagg/sim.py``): one colocated instance on 2 devices (tensor parallelism, ``2xh100:llama-3-8b``) against a
prefill instance and a decode instance of one device each, the K/V crossing the profile's interconnect; goodput
at ``--slo ttft=..,tpot=..`` (requests/s meeting both). Then the per-token latency of a model that does not fit one
device (``--big llama-3-70b``) at tensor_parallel_size 2 and 4.
"""
from __future__ import annotations

import argparse

import torch

from minibatch.bench.online import parse_rates
from minibatch.bench.run import run_workload
from minibatch.bench.workload import make_workload
from minibatch.model.weights import load_model

SETUPS = {"colocated": dict(threads=1), "colocated-2t": dict(threads=2), "disaggregated": dict(threads=1)}


def run_setup(model, wl, setup: str, **engine_kwargs) -> dict:
    torch.set_num_threads(SETUPS[setup]["threads"])
    try:
        summary, _, _ = run_workload(model, wl, disaggregated=setup == "disaggregated", **engine_kwargs)
    finally:
        torch.set_num_threads(1)
    return summary


def compare(model, rates, num_requests, prompt_len, repeats, seed=0, **engine_kwargs) -> dict:
    """{(setup, rate): the kept summary + "tpot_p90_range"}."""
    results = {}
    for rate in rates:
        wl = make_workload("longtail", num_requests=num_requests, seed=seed, arrival="poisson", rate=rate,
                           prompt_len=prompt_len)
        runs = {s: [] for s in SETUPS}
        for _ in range(repeats):
            for s in SETUPS:
                runs[s].append(run_setup(model, wl, s, **engine_kwargs))
        for s, rs in runs.items():
            best = min(rs, key=lambda r: r["tpot_p90"])
            results[s, rate] = {**best, "tpot_p90_range": (min(r["tpot_p90"] for r in rs),
                                                           max(r["tpot_p90"] for r in rs))}
    return results


def compare_simulated(model, spec: str, rates, num_requests, prompt_len, slo, seed=0, **engine_kwargs) -> dict:
    """{(setup, rate): request_stats on the simulated clock}: colocated on 2 devices vs 1 prefill + 1 decode."""
    from minibatch.disagg.sim import run_disaggregated_simulated
    from minibatch.stats import request_stats
    out = {}
    for rate in rates:
        wl = make_workload("longtail", num_requests=num_requests, seed=seed, arrival="poisson", rate=rate,
                           prompt_len=prompt_len)
        arrivals = {r.request_id: r.arrival_time for r in wl}
        _, traces, _ = run_workload(model, wl, simulate=f"2x{spec}", **engine_kwargs)
        out["colocated, 2 devices (TP=2)", rate] = request_stats(traces, "simulated", arrivals, slo)
        traces, _ = run_disaggregated_simulated(model, wl, spec, **engine_kwargs)
        out["1 prefill + 1 decode", rate] = request_stats(traces, "simulated", arrivals, slo)
    return out


def format_simulated(results: dict, slo: dict) -> str:
    rows = ["| rate (req/s) | setup | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | SLO attainment | goodput (req/s) |",
            "|---|---|---|---|---|---|"]
    for (s, rate), r in results.items():
        rows.append(f"| {rate:g} | {s} | {r['ttft_p50'] * 1e3:.1f} / {r['ttft_p90'] * 1e3:.1f} | "
                    f"{r['tpot_p50'] * 1e3:.2f} / {r['tpot_p90'] * 1e3:.2f} | {r['slo_attainment']:.2f} | "
                    f"{r['goodput']:.1f} |")
    return f"clock: simulated (minibatch.perf's cost model, not measured); SLO {slo}\n" + "\n".join(rows)


def big_model_latency(model, hw: str, big: str, tps=(2, 4)) -> str:
    """One request's TTFT and TPOT for a model too big for one device, at each tensor-parallel degree."""
    from minibatch.llm import LLM
    from minibatch.sampling.sampler import SamplingParams
    from minibatch.stats import request_stats
    from minibatch.trace import TraceRecorder
    lines = []
    try:
        LLM(model, simulate=f"{hw}:{big}")
    except ValueError as e:
        lines.append(f"{hw}:{big} on one device: {e}")
    for tp in tps:
        llm = LLM(model, simulate=f"{tp}x{hw}:{big}", max_num_seqs=1)
        rec = TraceRecorder()
        llm.llm_engine.add_hook(rec)
        llm.generate(["def fib(n):\n" * 20], SamplingParams(temperature=0, max_tokens=64))
        r = request_stats(rec.traces, "simulated")
        lines.append(f"{tp}x{hw}:{big}, batch 1, 240-token prompt: TTFT {r['ttft_p50'] * 1e3:.1f} ms, "
                     f"TPOT {r['tpot_p50'] * 1e3:.2f} ms ({1 / r['tpot_p50']:.0f} tokens/s), simulated")
    return "\n".join(lines)


def format_results(results: dict) -> str:
    rows = ["| rate (req/s) | setup | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) [p90 range] | output tok/s |",
            "|---|---|---|---|---|"]
    for (s, rate), r in sorted(results.items(), key=lambda kv: (kv[0][1], list(SETUPS).index(kv[0][0]))):
        lo, hi = r["tpot_p90_range"]
        rows.append(f"| {rate:g} | {s} | {r['ttft_p50'] * 1e3:.0f} / {r['ttft_p90'] * 1e3:.0f} | "
                    f"{r['tpot_p50'] * 1e3:.1f} / {r['tpot_p90'] * 1e3:.1f} [{lo * 1e3:.1f}-{hi * 1e3:.1f}] | "
                    f"{r['output_tokens_per_s']:.0f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=parse_rates, default=[4.0, 8.0])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=lambda s: tuple(int(x) for x in s.split(",")), default=(200, 400),
                    metavar="LO,HI")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate", default=None, metavar="HW:MODEL",
                    help="DistServe's comparison on the simulated clock, e.g. h100:llama-3-8b")
    ap.add_argument("--slo", default="ttft=0.2,tpot=0.006", help="with --simulate: goodput's SLOs, in seconds")
    ap.add_argument("--big", default="llama-3-70b", help="with --simulate: a model too big for one device")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1:
        ap.error("--repeats and --num-requests must be >= 1")
    model = load_model("target", device="cpu")
    if args.simulate:
        from minibatch.bench.online import parse_slo
        slo = parse_slo(args.slo)
        with torch.no_grad():
            res = compare_simulated(model, args.simulate, args.rates, args.num_requests, args.prompt_len, slo,
                                    args.seed, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens)
            print(format_simulated(res, slo))
            print(big_model_latency(model, args.simulate.split(":")[0], args.big))
        return 0
    with torch.no_grad():
        res = compare(model, args.rates, args.num_requests, args.prompt_len, args.repeats, args.seed,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    print(f"{args.num_requests} long-tail requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} B, Poisson "
          f"arrivals; max_num_seqs={args.max_num_seqs}, token budget {args.max_num_batched_tokens}; wall clock, CPU")
    print(format_results(res))
    return 0
