"""Choose Medusa's static trees from the shipped heads:  python -m minibatch.bench.medusa_tree

Drives the engine (greedy generations from held-out prompts) to measure, per position, the rank of the
target's own next token under each Medusa head; ``spec_decode/medusa_tree.py`` then chooses the N most
frequent rank prefixes (the tree of highest expected acceptance) and this writes them, with their held-out
tau, to ``model/checkpoints/medusa_tree.json``. Under a minute on one core.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time

import numpy as np
import torch

from minibatch.llm import LLM
from minibatch.model.data import val_documents
from minibatch.model.heads import load_head
from minibatch.model.weights import HEADS_OF, head_preset, load_model, read_manifest
from minibatch.sampling.sampler import SamplingParams
from minibatch.spec_decode.medusa_tree import MAX_RANK, SIZES, choose, prefix_counts, ranks_of, tau, tree_file


@torch.no_grad()
def measure_ranks(target, heads, num_prompts: int = 512, prompt_len: int = 64, new_tokens: int = 128,
                  seed: int = 0) -> list:
    """Per generated sequence, the ranks [P, K] of the target's own greedy tokens in each head's distribution."""
    rng = np.random.default_rng(seed)
    docs = val_documents(num_prompts, min_len=prompt_len + 400, seed=seed)       # every held-out file this long
    prompts = []
    for i in range(num_prompts):                                                  # windows at seeded offsets
        d = docs[i % len(docs)]
        start = int(rng.integers(0, len(d) - prompt_len))
        prompts.append(list(d[start: start + prompt_len]))
    outs = LLM(target, max_num_seqs=64).generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens))
    seqs = torch.tensor([p + o.outputs[0].token_ids for p, o in zip(prompts, outs)])   # [B, S]
    out = []
    for i in range(0, len(seqs), 16):                                             # 16 sequences per forward
        out += list(ranks_of(target, heads, seqs[i: i + 16], prompt_len).cpu().numpy())
    return out



def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench.medusa_tree",
                                 description="Choose Medusa's static trees from the shipped heads' held-out ranks.")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES))
    ap.add_argument("--model", default="target", choices=list(HEADS_OF), help="whose Medusa heads")
    ap.add_argument("--out", default=None, help="default: the model's tree file (medusa_tree.json, llama_...)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    target = load_model(args.model)
    heads = load_head(head_preset("medusa", args.model), target)
    args.out = args.out or str(tree_file(args.model))
    per_seq = measure_ranks(target, heads, args.prompts, new_tokens=args.new_tokens, seed=args.seed)
    fit, held = np.concatenate(per_seq[0::2]), np.concatenate(per_seq[1::2])       # by sequence, not position
    counts = prefix_counts(fit)
    K = heads.num_heads
    chain = [(0,) * d for d in range(1, K + 1)]
    trees = {}
    print(f"{len(fit)} positions to choose on, {len(held)} held out; chain k={K}: tau {tau(chain, held):.3f}")
    for n in args.sizes:
        ch = choose(counts, n)
        trees[str(n)] = {"choices": [list(c) for c in ch], "depth": max(map(len, ch)),
                         "tau_fit": round(tau(ch, fit), 4), "tau_held_out": round(tau(ch, held), 4)}
        print(f"{n:>3} nodes, depth {trees[str(n)]['depth']}: tau {trees[str(n)]['tau_held_out']:.3f} held out "
              f"({trees[str(n)]['tau_fit']:.3f} on the positions it was chosen on)")
    doc = {"what": "Medusa static trees (minibatch/spec_decode/medusa_tree.py): choice (r_0..r_{d-1}) = head d-1's "
                   "rank r_{d-1} guess under the node (r_0..r_{d-2}); tau = 1 + expected accepted drafts, greedy",
           "medusa_sha256": read_manifest(head_preset("medusa", args.model))["sha256"],
           "command": " ".join(["python -m minibatch.bench.medusa_tree"] + (sys.argv[1:] if argv is None else list(argv))),
           "data": {"prompts": args.prompts, "prompt_len": 64, "new_tokens": args.new_tokens, "seed": args.seed,
                    "positions_fit": int(len(fit)), "positions_held_out": int(len(held)), "max_rank": MAX_RANK},
           "chain": {"choices": [list(c) for c in chain], "tau_fit": round(tau(chain, fit), 4),
                     "tau_held_out": round(tau(chain, held), 4)},
           "trees": trees, "minutes": round((time.time() - t0) / 60, 1)}
    text = json.dumps(doc, indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)   # a choice on one line
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(f"wrote {args.out} in {doc['minutes']} min")


if __name__ == "__main__":
    main()
