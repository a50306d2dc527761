"""Preemption by swapping against recomputation, per block size, on both clocks (PagedAttention §7.3, Fig. 19).

    python -m minibatch.bench preemption [--block-sizes 8,16,32,64,128 --num-requests 16 --repeats 3] [--small]

One workload that preempts: ``--num-requests`` prompts of 64-128 bytes, each generating 64-128 tokens, 8 slots,
and a device pool of ``--pool-tokens`` slots (768: about half of what the 8 running sequences reach), the same
number of *tokens* at every block size (``num_gpu_blocks = pool_tokens // block_size``). Each block size runs
three ways: no memory pressure (a pool for every slot's full context), ``preemption_mode="recompute"`` and
``"swap"`` (a swap space as large as the device pool). The **preemption overhead** of a mode is its run time
against the unpressured run's, minus one:

* on the CPU wall clock: the three run alternately, ``--repeats`` rounds, each keeping its best; the range is
  that of the per-round overheads (a slow spell of a shared machine hits all three);
* on the simulated H100 (``simulate="h100:llama-3-8b"``: each step re-timed for Llama-3-8B, the swaps priced on
  its blocks over PCIe, ``perf/cost.py``'s ``transfer_time``), one run, the clock does not vary; beside it the
  same steps with the copies priced as vLLM V0's loop (``per_block=True``: one cudaMemcpyAsync per block, per
  layer, for K and for V), which is what Fig. 19 measured.

Then, per block size, what one request of ``--request-tokens`` tokens costs to swap out and back in (two batched
copies, ``KVCache.swap_out`` / ``swap_in``) against recomputing it (a prefill of that many tokens through the
engine), on this CPU and on the simulated H100. Every run's greedy output must equal the unpressured run's: the
bench asserts it (swapping and recomputing change when a token is computed, never which).
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from minibatch.bench.run import run_workload
from minibatch.bench.workload import describe, make_workload
from minibatch.llm import LLM
from minibatch.model.weights import load_model
from minibatch.perf.cost import CostModel
from minibatch.sampling.sampler import SamplingParams
from minibatch.trace import TraceRecorder

MODES = ("free", "swap", "recompute")
PAPER = ("PagedAttention Fig. 19 (OPT-13B, A100): swapping's overhead is high at small blocks (many small PCIe "
         "transfers) and falls as blocks grow; recomputation is flat in block size (it uses no PCIe); at small blocks "
         "'recomputation overhead is never higher than 20 % of swapping's latency', at large ones swapping is "
         "cheaper.")


def _mode_kwargs(mode: str, block_size: int, pool_tokens: int) -> dict:
    if mode == "free":
        return dict(block_size=block_size)                       # room for every slot's full context
    return dict(block_size=block_size, num_gpu_blocks=pool_tokens // block_size, preemption_mode=mode)


def _tokens(outs, wl) -> list:
    return [outs[r.request_id].outputs[0].token_ids for r in wl]


def _sim_seconds(traces, cm: CostModel, per_block: bool = False) -> float:
    """The run on the simulated clock; per_block: its copies re-priced as vLLM V0's per-block loop."""
    if not per_block:
        return sum(t.simulated_duration for t in traces)
    return sum(t.simulated_duration - cm.transfer_time(t) + cm.transfer_time(t, per_block=True) for t in traces)


def sweep(model, wl, block_sizes, pool_tokens: int, repeats: int, simulate: str, common: dict) -> dict:
    """{block size: {mode: dict(wall=[per round], sim=..., sim_loop=..., steps, swapped, preempted)}}."""
    cm, res = CostModel.from_spec(simulate), {}
    for bs in block_sizes:
        res[bs] = {m: dict(wall=[]) for m in MODES}
        ref = None
        for _ in range(repeats):                                 # alternating: free, swap, recompute, free, ...
            for m in MODES:
                s, traces, outs = run_workload(model, wl, **common, **_mode_kwargs(m, bs, pool_tokens))
                ref = ref or _tokens(outs, wl)
                assert _tokens(outs, wl) == ref, f"block {bs}, {m}: greedy output differs from the unpressured run's"
                r = res[bs][m]
                r["wall"].append(s["wall_time"])
                r.update(steps=len(traces), swapped=sum(len(t.swapped_out) for t in traces),
                         preempted=sum(len(t.preempted) for t in traces),
                         blocks=sum(t.blocks_to_host for t in traces))
        for m in MODES:                                          # the simulated clock: one run says it all
            _, traces, outs = run_workload(model, wl, **common, simulate=simulate, **_mode_kwargs(m, bs, pool_tokens))
            assert _tokens(outs, wl) == ref, f"block {bs}, {m} (simulated): greedy output differs"
            res[bs][m].update(sim=_sim_seconds(traces, cm), sim_loop=_sim_seconds(traces, cm, per_block=True),
                              sim_copies=sum(cm.transfer_time(t) for t in traces),
                              sim_copies_loop=sum(cm.transfer_time(t, per_block=True) for t in traces))
        if res[bs]["swap"]["swapped"] == 0 or res[bs]["recompute"]["preempted"] == 0:
            raise RuntimeError(f"block {bs}: the workload did not preempt ({res[bs]}); shrink --pool-tokens")
    return res


def _pct(x: float) -> str:
    return f"{100 * x:+.0f} %"


def format_sweep(res: dict) -> str:
    lines = ["preemption overhead = run time / the unpressured run's - 1",
             f"CPU wall clock {'free':>9} | {'swap: best, overhead (range over rounds)':>40} | "
             f"{'recompute: best, overhead (range)':>36} | swapped (blocks) / preempted"]
    for bs, r in res.items():
        f, cells = r["free"], []
        for m in ("swap", "recompute"):
            rounds = [w / fw - 1 for w, fw in zip(r[m]["wall"], f["wall"])]
            cells.append(f"{min(r[m]['wall']):6.2f} s {_pct(min(r[m]['wall']) / min(f['wall']) - 1):>7} "
                         f"({_pct(min(rounds))} .. {_pct(max(rounds))})")
        lines.append(f"  block {bs:>4} {min(f['wall']):7.2f} s | {cells[0]:>40} | {cells[1]:>36} | "
                     f"{r['swap']['swapped']} ({r['swap']['blocks']}) / {r['recompute']['preempted']}")
    lines.append(f"simulated H100 {'free':>9} | {'swap':>8} {'recompute':>9} {'swap/recomp':>11} | "
                 f"{'swap, V0 loop':>13} {'loop/recomp':>11} | copies: batched (V0 loop)")
    for bs, r in res.items():
        sf, sw, rc, lp = r["free"]["sim"], r["swap"]["sim"], r["recompute"]["sim"], r["swap"]["sim_loop"]
        lines.append(f"  block {bs:>4} {1e3 * sf:6.1f} ms | {_pct(sw / sf - 1):>8} {_pct(rc / sf - 1):>9} "
                     f"{sw / rc:10.2f}x | {_pct(lp / sf - 1):>13} {lp / rc:10.2f}x | "
                     f"{1e3 * r['swap']['sim_copies']:6.2f} ({1e3 * r['swap']['sim_copies_loop']:6.2f}) ms")
    return "\n".join(lines)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def one_request(model, block_sizes, tokens: int, simulate: str, repeats: int = 5) -> list:
    """Per block size: (bs, CPU swap out+in s, CPU prefill s, sim swap s, sim swap V0-loop s, sim prefill s)."""
    cm, rows = CostModel.from_spec(simulate), []
    prompt = list(range(1, 256)) * (tokens // 255 + 1)
    prompt, one = prompt[:tokens], SamplingParams(max_tokens=1, temperature=0.0)
    for bs in block_sizes:
        n = -(-tokens // bs)
        llm = LLM(model, block_size=bs, num_gpu_blocks=n + 1, max_num_seqs=1, max_num_batched_tokens=tokens,
                  preemption_mode="swap", enable_prefix_caching=False)
        kv, pairs = llm.llm_engine.kv_cache, [(i, i) for i in range(n)]
        swap = _best(lambda: (kv.swap_out(pairs), kv.swap_in(pairs), kv.wait_copies()), repeats)
        llm.generate([prompt], one, use_tqdm=False)                                 # warm-up
        prefill = _best(lambda: llm.generate([prompt], one, use_tqdm=False), repeats)
        way = lambda **kw: sum(cm.transfer_time(SimpleNamespace(block_size=bs, blocks_to_host=h, blocks_to_device=d),
                                                **kw) for h, d in ((n, 0), (0, n)))
        sim = LLM(model, block_size=bs, max_num_seqs=1, max_num_batched_tokens=tokens, enable_prefix_caching=False,
                  simulate=simulate)
        rec = TraceRecorder()
        sim.llm_engine.add_hook(rec)
        sim.generate([prompt], one, use_tqdm=False)
        rows.append((bs, swap, prefill, way(), way(per_block=True), sum(t.simulated_duration for t in rec.traces)))
    return rows


def format_one_request(rows, tokens: int) -> str:
    lines = [f"one request of {tokens} tokens: swapped out and back in (two batched copies a layer) against "
             f"recomputed (a prefill of {tokens} tokens)",
             f"{'block':>5} | {'CPU swap':>9} {'CPU prefill':>11} {'prefill/swap':>12} | {'sim swap':>9} "
             f"{'V0 loop':>9} {'sim prefill':>11} {'prefill/swap':>12} {'prefill/loop':>12}"]
    for bs, swap, prefill, ssim, sloop, spre in rows:
        lines.append(f"{bs:>5} | {1e3 * swap:7.3f}ms {1e3 * prefill:9.2f}ms {prefill / swap:11.1f}x | "
                     f"{1e3 * ssim:7.3f}ms {1e3 * sloop:7.3f}ms {1e3 * spre:9.2f}ms {spre / ssim:11.1f}x "
                     f"{spre / sloop:11.2f}x")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64, 128])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=768, help="device pool, in token slots at every block size")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--request-tokens", type=int, default=256, help="the one-request comparison's length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--simulate", default="h100:llama-3-8b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="CI: blocks 8 and 64, 6 requests, one round")
    args = ap.parse_args(argv)
    if args.small:
        args.block_sizes, args.num_requests, args.repeats, args.pool_tokens = [8, 64], 6, 1, 256
        args.max_num_seqs, args.request_tokens, out_len = 4, 128, (24, 40)
    else:
        out_len = (64, 128)
    if args.repeats < 1 or any(b < 1 for b in args.block_sizes):
        ap.error("--repeats and every --block-sizes entry must be >= 1")
    model = load_model("target")
    wl = make_workload("uniform", num_requests=args.num_requests, seed=args.seed, prompt_len=(64, 128),
                       output_len=out_len)
    common = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512)
    print(f"device: {model.device}; {describe(wl)}")
    print(f"{args.max_num_seqs} slots; device pool under pressure: {args.pool_tokens} token slots; CPU: best of "
          f"{args.repeats} alternating rounds (per-round range); simulated: {args.simulate}, one run")
    with torch.inference_mode():
        run_workload(model, wl[:2], **common)                                   # warm-up
        res = sweep(model, wl, args.block_sizes, args.pool_tokens, args.repeats, args.simulate, common)
        print(format_sweep(res))
        print("greedy outputs of every run equal the unpressured run's: True (asserted)")
        print(PAPER)
        print("Ours differs at small blocks: minibatch copies each direction as one batched index copy per layer "
              "(vLLM's swap_blocks per layer), so the per-transfer latency is paid per layer, not per block, and "
              "swapping stays cheap at block 8; the 'V0 loop' column prices vLLM V0's per-block copies, Fig. 19's "
              "shape. Both modes' overheads are mostly the smaller batch a full pool allows (and, under swap, no "
              "admission while a request is swapped out, §4.5), not the mechanism: on the H100 a re-prefill of a "
              "few hundred tokens hides under the weight reads of a memory-bound step, so recomputation costs "
              "little and swap / recompute stays near 1. The same token slots hold fewer sequences at large "
              "blocks (each last block's unused tail), so both rise with the block size.")
        print(format_one_request(one_request(model, args.block_sizes, args.request_tokens, args.simulate),
                                 args.request_tokens))
