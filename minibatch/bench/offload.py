"""The prefix cache's host tier on a multi-turn chat, on both clocks (vLLM V1's CPU offloading; SGLang's HiCache).

    python -m minibatch.bench offload [--conversations 12 --turns 4 --repeats 3] [--small]

The workload (``workload.multi_turn_chat``): N conversations, each turn's prompt the conversation so far plus a
new user turn, turns interleaved across conversations and each sent once its conversation's previous turn is back.
The device pool holds about a quarter of the working set (every conversation's last prompt and reply), so
between two turns of a conversation the others push its blocks out of the device pool. Three rows:

* ``device only``: no host tier; a prefix the device lost is prefilled again;
* ``write_through``: a host tier as large as the working set, each block copied to it once full (vLLM's
  ``OffloadingConnector``); a prefix that misses the device pool is loaded back from it;
* ``write_back``: the same tier, a block copied only when the device pool evicts it (SGLang's default).

Printed per row: the device hit rate (prefix-cache hits / blocks looked up), the host hit rate (blocks loaded back
/ blocks looked up in the tier, i.e. those that missed the device pool), TTFT p50 / p90 and output throughput, on
the CPU wall clock (rows alternated, ``--repeats`` rounds, each row's best round by throughput, with the range
over rounds) and on the simulated H100 (``simulate="h100:llama-3-8b"``: Llama-3-8B's prefill against its blocks'
PCIe copies; one run, the clock does not vary). Every row's greedy output equals the others' (asserted).
"""
from __future__ import annotations

import argparse
import time

import torch

from minibatch.bench.metrics import summarize
from minibatch.bench.workload import multi_turn_chat
from minibatch.llm import LLM
from minibatch.model.weights import load_model
from minibatch.trace import TraceRecorder

ROWS = {"device only": {}, "write_through": dict(kv_offload_write_policy="write_through"),
        "write_back": dict(kv_offload_write_policy="write_back")}


def run_chat(model, wl, simulate=None, **engine_kwargs):
    """Drive a multi-turn chat closed-loop: a turn is added once its ``after`` has finished (arrival = then).
    Returns (summary, traces, {request id: token ids}); the summary is on the simulated clock with ``simulate``."""
    llm = LLM(model, simulate=simulate, **engine_kwargs)
    eng, rec = llm.llm_engine, TraceRecorder()
    eng.add_hook(rec)
    pending, done, outs, arrivals = list(wl), set(), {}, {}
    t0 = time.perf_counter()
    while pending or eng.has_unfinished_requests():
        for r in [r for r in pending if r.after is None or r.after in done]:
            pending.remove(r)
            arrivals[r.request_id] = eng.simulated_time if simulate else time.perf_counter()
            eng.add_request(r.request_id, r.prompt, r.sampling_params(), arrival_time=arrivals[r.request_id]
                            if not simulate else None)
        for o in eng.step():
            if o.finished:
                done.add(o.request_id)
                outs[o.request_id] = o
    wall = time.perf_counter() - t0
    metrics = [outs[r.request_id].metrics for r in wl]
    if simulate:
        s = summarize(metrics, rec.traces, clock="simulated", arrivals=arrivals)
    else:
        s = summarize(metrics, rec.traces, wall)
    last = rec.traces[-1]
    s["host_hit_rate"] = last.offload_hits / last.offload_queries if last.offload_queries else None
    s["offload_hits"], s["offload_queries"] = last.offload_hits, last.offload_queries
    cm = eng.config.cost_model() if simulate else None
    s["copy_time"] = sum(cm.transfer_time(t) for t in rec.traces) if cm else None
    return s, rec.traces, {r.request_id: outs[r.request_id].outputs[0].token_ids for r in wl}


def working_set_blocks(wl, block_size: int) -> int:
    """Blocks every conversation's last turn holds (its prompt and reply): the chat's working set."""
    last = {}
    for r in wl:
        last[r.conversation] = r
    return sum(-(-(r.num_prompt_tokens + r.max_tokens) // block_size) for r in last.values())


def _rate(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def format_rows(wall: dict, sim: dict) -> str:
    base = "device only"
    lines = [f"CPU wall clock      {'device hits':>11} {'host hits':>9} {'prefilled':>9} | {'TTFT p50 (range)':>22} "
             f"{'p90':>7} | {'output tok/s (range)':>20} {'x (range)':>16}"]
    bbest = max(s["output_tokens_per_s"] for s in wall[base])
    for name in ROWS:
        runs = wall[name]
        best = max(runs, key=lambda s: s["output_tokens_per_s"])
        tps, ttft = [s["output_tokens_per_s"] for s in runs], [1e3 * s["ttft_p50"] for s in runs]
        ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(runs, wall[base])]
        lines.append(f"  {name:<17} {_rate(best['prefix_cache_hit_rate']):>11} {_rate(best['host_hit_rate']):>9} "
                     f"{best['prompt_tokens'] - best['cached_prompt_tokens']:>9} | {1e3 * best['ttft_p50']:7.1f} ms "
                     f"({min(ttft):5.1f}-{max(ttft):5.1f}) {1e3 * best['ttft_p90']:5.0f}ms | {max(tps):6.0f} "
                     f"({min(tps):4.0f}-{max(tps):4.0f}) {max(tps) / bbest:7.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f})")
    lines.append(f"simulated H100      {'device hits':>11} {'host hits':>9} {'prefilled':>9} | {'TTFT p50':>10} "
                 f"{'p90':>9} | {'output tok/s':>12} {'x':>6} | {'copies':>9}")
    for name in ROWS:
        m = sim[name]
        lines.append(f"  {name:<17} {_rate(m['prefix_cache_hit_rate']):>11} {_rate(m['host_hit_rate']):>9} "
                     f"{m['prompt_tokens'] - m['cached_prompt_tokens']:>9} | {1e3 * m['ttft_p50']:7.1f} ms "
                     f"{1e3 * m['ttft_p90']:6.1f} ms | {m['output_tokens_per_s']:12.0f} "
                     f"{m['output_tokens_per_s'] / sim[base]['output_tokens_per_s']:5.2f}x | "
                     f"{1e3 * m['copy_time']:6.2f} ms")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens each turn generates")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device-share", type=float, default=0.25, help="device pool / working set")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--simulate", default="h100:llama-3-8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="CI: 4 conversations of 3 turns, one round")
    args = ap.parse_args(argv)
    if args.small:
        args.conversations, args.turns, args.repeats = 4, 3, 1
    if args.repeats < 1 or not 0 < args.device_share <= 1:
        ap.error("--repeats must be >= 1 and --device-share in (0, 1]")
    model = load_model("target")
    wl = multi_turn_chat(args.conversations, args.turns, seed=args.seed, max_tokens=args.max_tokens)
    bs, ws = args.block_size, working_set_blocks(wl, args.block_size)
    longest = max(-(-(r.num_prompt_tokens + r.max_tokens) // bs) for r in wl)
    device = max(int(ws * args.device_share), longest + 1)
    per_block = LLM(model, block_size=bs, num_gpu_blocks=2).llm_engine.bytes_per_block
    tier = dict(kv_offload_space=ws * per_block / 2 ** 30)               # the host tier holds the working set
    common = dict(block_size=bs, num_gpu_blocks=device, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512)
    print(f"device: {model.device}; multi-turn chat: {args.conversations} conversations x {args.turns} turns "
          f"({len(wl)} requests, prompts {min(r.num_prompt_tokens for r in wl)}-"
          f"{max(r.num_prompt_tokens for r in wl)} tokens, {wl[0].max_tokens} generated each), closed loop; "
          f"working set {ws} blocks of {bs}; device pool {device} blocks ({device / ws:.0%}); host tier {ws} blocks")
    print(f"CPU wall clock: rows alternated, best of {args.repeats} rounds by throughput (range over rounds); "
          f"simulated {args.simulate}: one run")
    wall, sim, ref = {n: [] for n in ROWS}, {}, None
    with torch.inference_mode():
        run_chat(model, wl[:2], **common)                                    # warm-up
        for _ in range(args.repeats):
            for name, kw in ROWS.items():
                s, _, toks = run_chat(model, wl, **common, **(dict(tier, **kw) if kw else {}))
                ref = ref or toks
                assert toks == ref, f"{name}: greedy output differs from the device-only run's"
                wall[name].append(s)
        for name, kw in ROWS.items():
            s, _, toks = run_chat(model, wl, simulate=args.simulate, **common, **(dict(tier, **kw) if kw else {}))
            assert toks == ref, f"{name} (simulated): greedy output differs"
            sim[name] = s
    print(format_rows(wall, sim))
    w = sim["write_through"]
    print(f"host tier (write_through): {w['offload_hits']} of {w['offload_queries']} blocks that missed the device "
          f"pool loaded back; greedy outputs of every row equal: True (asserted)")
