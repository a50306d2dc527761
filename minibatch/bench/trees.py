"""Chains against trees, for the methods that make trees:  python -m minibatch.bench trees

For Medusa (its chain of k heads; the shipped static trees of 8, 16 and 32 nodes) and EAGLE (its chain of k
passes; EAGLE-2 dynamic trees of the same depth, so the same number of sequential draft passes), at each
batch size and at temperature 0 and 1, on code, each row is timed against plain decoding of the same
prompts in this process, alternately, best of ``--repeats`` (``speculative.timed_pair``). Each row reports:

* ``nodes``: verify tokens per step and sequence (1 + the drafts, a tree's nodes);
* ``tau``: tokens per target forward (accepted drafts + the target's own token, per verify step), and
  ``tau/chain``, the ratio to the same method's chain at the same number of draft passes (the aim is
  >= 1.3 for the best tree at batch 1, greedy);
* ``speedup`` over plain decoding (best round of each side) and its ``spread`` (per-round ratios);
* ``verify``: a verify step's time over a plain decode step's (the cost of a bigger tree in the target's
  forward, proposer time excluded), and ``propose``: the proposer's time per step over a plain decode step.

All figures come from the step traces (``minibatch.stats.run_stats``).
"""
from __future__ import annotations

import argparse

from minibatch.bench.speculative import _decode_step_time, _propose_time, timed_pair
from minibatch.llm import LLM
from minibatch.stats import run_stats

HEADER = (f"{'temp':>5}{'batch':>6}{'method':>8}{'shape':>22}{'passes':>7}{'nodes':>7}{'tau':>6}{'tau/chain':>10}"
          f"{'tok/s':>8}{'base':>7}{'speedup':>8}{'spread':>11}{'verify':>7}{'propose':>8}")


def shapes(method: str, depth: int, heads: int) -> list:
    """(label, speculative_config) rows for one method: its chain, then its trees."""
    if method == "medusa":
        k = min(depth, heads)
        return [(f"chain k={k}", {"method": "medusa", "num_speculative_tokens": k})] + [
            (f"static {n}", {"method": "medusa", "tree": "static", "num_draft_tokens": n}) for n in (8, 16, 32)]
    return [(f"chain k={depth}", {"method": "eagle", "num_speculative_tokens": depth})] + [
        (f"dynamic {n}/{depth}/{topk}", {"method": "eagle", "tree": "dynamic", "num_draft_tokens": n,
                                          "depth": depth, "topk": topk})
        for n, topk in ((8, 2), (16, 4), (32, 4))]


def bench_tree_row(model, spec, label, prompts, params, bs, repeats, plain, temp, chain_tau):
    cm = plain.llm_engine.cost_model
    llm = LLM(model, max_num_seqs=max(bs, 1), speculative_config=spec, simulate=plain.llm_engine.config.simulate)
    (base, _, base_tr, base_walls), (tps, _, tr, walls) = timed_pair(plain, llm, prompts, params, repeats)
    st = run_stats(tr)
    verify = [s for t in tr for s in t.scheduled if s.proposed]
    nodes = sum(s.num_tokens for s in verify) / max(len(verify), 1)
    tau = st.get("tokens_per_verify_step", 1.0)
    ratios = [b / s for b, s in zip(base_walls, walls)]
    base_step = _decode_step_time(base_tr, cm)
    passes = getattr(llm.llm_engine.proposer, "sequential_passes", "k")
    passes = llm.llm_engine.proposer.k if passes == "k" else int(passes)
    row = dict(temperature=temp, batch=bs, method=spec["method"], shape=label, passes=passes, nodes=nodes, tau=tau,
               tau_over_chain=tau / chain_tau if chain_tau else 1.0, tps=tps, base=base, speedup=tps / base,
               spread=(min(ratios), max(ratios)), verify_cost=_decode_step_time(tr, cm) / base_step,
               propose_cost=_propose_time(tr, cm) / base_step)
    print(f"{temp:>5.1f}{bs:>6}{spec['method']:>8}{label:>22}{passes:>7}{nodes:>7.1f}{tau:>6.2f}"
          f"{row['tau_over_chain']:>10.2f}{tps:>8.1f}{base:>7.1f}{tps / base:>8.2f}"
          f" {f'{min(ratios):.2f}-{max(ratios):.2f}':>10}{row['verify_cost']:>7.2f}{row['propose_cost']:>8.2f}",
          flush=True)
    return row


def bench_trees(args) -> list:
    from minibatch.sampling.sampler import SamplingParams
    from minibatch.model.data import val_documents
    from minibatch.model.weights import WEIGHTS_DIR, load_model, read_manifest
    model = load_model("target", device=args.device)
    methods = [m for m in args.methods if (WEIGHTS_DIR / f"{m}.safetensors").exists()]
    heads = read_manifest("medusa")["config"]["num_heads"] if "medusa" in methods else 0
    docs = val_documents(32, min_len=600, seed=11)
    prompts = [d[:160].decode("utf-8", "ignore") for d in docs]
    print(f"device: {model.device}; methods {', '.join(methods)}; best of {args.repeats} runs alternating with plain "
          f"decoding on the same code prompts (at least {args.prompts} a row); max_tokens {args.max_tokens}")
    print(HEADER)
    rows = []
    for temp in args.temperatures:
        for bs in args.batch_sizes:
            ps = prompts[:max(bs, args.prompts)]        # batch 1 still averages over several prompts, in turn
            sp = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0 if temp else None)
            plain = LLM(model, max_num_seqs=max(bs, 1), simulate=args.simulate)
            for method in methods:
                chain_tau = None
                for label, spec in shapes(method, args.depth, heads):
                    row = bench_tree_row(model, spec, label, ps, sp, bs, args.repeats, plain, temp, chain_tau)
                    chain_tau = chain_tau or row["tau"]
                    rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench trees", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["medusa", "eagle"])
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    ap.add_argument("--depth", type=int, default=4, help="chain k and dynamic tree depth (draft passes)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per row at least (run max_num_seqs = batch at a time)")
    ap.add_argument("--simulate", default=None, metavar="HW:MODEL",
                    help="time on a simulated GPU and model, e.g. h100:llama-3-8b (minibatch.perf); one run per row")
    args = ap.parse_args(argv)
    if args.simulate:
        args.repeats = 1
        print(f"clock: simulated, {args.simulate} (minibatch.perf's roofline): tok/s, speedup and costs simulated; "
              f"tau real")
    return bench_trees(args)


if __name__ == "__main__":
    main()
