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
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.num_requests < 1:
        ap.error("--repeats and --num-requests must be >= 1")
    model = load_model("target", device="cpu")
    with torch.no_grad():
        res = compare(model, args.rates, args.num_requests, args.prompt_len, args.repeats, args.seed,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    print(f"{args.num_requests} long-tail requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} B, Poisson "
          f"arrivals; max_num_seqs={args.max_num_seqs}, token budget {args.max_num_batched_tokens}; wall clock, CPU")
    print(format_results(res))
    return 0
