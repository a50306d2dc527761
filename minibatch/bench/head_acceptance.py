"""How often a model's trained heads are accepted on held-out code:  python -m minibatch.bench.head_acceptance

For every speculative head shipped for ``--model`` (Medusa, EAGLE, early exit, EAGLE-3: ``weights.HEADS_OF``),
the engine decodes held-out prompts greedily (the bench's prompts: 160 bytes of held-out files, the same for
every method and model) with a chain of k drafts, and with the method's tree where it has one; the step traces
give alpha (accepted / proposed), alpha by position and tau (tokens per verify step: the accepted drafts + the
target's own), one definition each (``minibatch.stats``). ``--write`` records them in each head's manifest
under ``"acceptance"``, with this command; ``--compare target`` prints the GPT's heads beside them.
"""
from __future__ import annotations

import argparse
import json
import sys

from minibatch.llm import LLM
from minibatch.model.data import val_documents
from minibatch.model.weights import HEADS_OF, WEIGHTS_DIR, head_preset, load_model
from minibatch.sampling.sampler import SamplingParams
from minibatch.stats import run_stats
from minibatch.trace import TraceRecorder

TREES = {"medusa": {"tree": "static", "num_draft_tokens": 16},
         "eagle": {"tree": "dynamic", "num_draft_tokens": 16, "topk": 4},
         "eagle3": {"tree": "dynamic", "num_draft_tokens": 16, "topk": 4}}


def prompts(n: int) -> list:
    return [d[:160].decode("utf-8", "ignore") for d in val_documents(n, min_len=600, seed=11)]


def measure(model, spec: dict, ps: list, max_tokens: int) -> dict:
    llm = LLM(model, max_num_seqs=len(ps), speculative_config=spec)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    st = run_stats(rec.traces)
    return {"alpha": round(st.get("acceptance_rate") or 0.0, 4), "tau": round(st.get("tokens_per_verify_step") or 1.0, 4),
            "alpha_by_position": [round(a, 3) for a in st.get("acceptance_by_position") or []]}


def head_rows(name: str, k: int, ps: list, max_tokens: int) -> dict:
    """{kind: {"chain": {...}, "tree": {...}}} for the heads shipped for ``name``."""
    model, out = load_model(name, device="cpu"), {}
    for kind in HEADS_OF[name]:
        if not (WEIGHTS_DIR / f"{head_preset(kind, name)}.safetensors").exists():
            continue
        kk = min(k, 4) if kind == "medusa" else k
        out[kind] = {"chain": {"k": kk, **measure(model, {"method": kind, "num_speculative_tokens": kk}, ps, max_tokens)}}
        if kind in TREES:
            spec = {"method": kind, **TREES[kind], **({"depth": k} if kind != "medusa" else {})}
            out[kind]["tree"] = {**{x: v for x, v in spec.items() if x != "method"}, **measure(model, spec, ps, max_tokens)}
        c, t = out[kind]["chain"], out[kind].get("tree")
        print(f"{name:<7}{kind:>11}  chain k={c['k']}: alpha {c['alpha']:.3f} tau {c['tau']:.3f}  by position "
              f"{'/'.join(map(str, c['alpha_by_position']))}" + (f"   tree {t['num_draft_tokens']}: tau {t['tau']:.3f}"
                                                                  if t else ""), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench.head_acceptance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=list(HEADS_OF))
    ap.add_argument("--compare", default=None, choices=list(HEADS_OF), help="another model's heads, printed beside")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--write", action="store_true", help="record the figures in each head's manifest")
    args = ap.parse_args(argv)
    ps = prompts(args.prompts)
    print(f"{len(ps)} held-out code prompts, greedy, {args.max_tokens} tokens each")
    rows = head_rows(args.model, args.k, ps, args.max_tokens)
    if args.compare:
        head_rows(args.compare, args.k, ps, args.max_tokens)
    if args.write:
        command = " ".join(["python -m minibatch.bench.head_acceptance"] + (sys.argv[1:] if argv is None else list(argv)))
        for kind, figs in rows.items():
            path = WEIGHTS_DIR / f"{head_preset(kind, args.model)}.json"
            manifest = json.loads(path.read_text())
            manifest["acceptance"] = {"command": command, "prompts": f"{len(ps)} held-out code prompts (160 bytes), "
                                      f"greedy, {args.max_tokens} new tokens", **figs}
            path.write_text(json.dumps(manifest, indent=2) + "\n")
            print("wrote", path.name)
    return rows


if __name__ == "__main__":
    main()
