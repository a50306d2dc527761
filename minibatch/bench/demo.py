"""Lecture demos: one command from nothing to an animation you can put on a slide.

    python -m minibatch demo continuous            static vs continuous batching, same workload
    python -m minibatch demo static                the static baseline alone (padding slots)
    python -m minibatch demo paged                 blocks allocated, shared (prefix cache, fork),
                                                   freed, evicted and preempted
    python -m minibatch demo speculative           draft proposals accepted and rejected
    python -m minibatch demo tree                  token trees (EAGLE-2): many guesses verified in one
                                                   forward, the longest accepted path kept
    python -m minibatch demo hierarchy             the KV cache as a memory hierarchy: a multi-turn chat on a
                                                   small pool, requests swapped out and back in, prefixes
                                                   loaded back from the host tier
    python -m minibatch demo structured            structured outputs: each row's 256-byte mask beside
                                                   the batch (out/demo/structured.png)
    python -m minibatch demo async                 sync, then async scheduling: the CPU and model lanes
                                                   (out/demo/async.png; demo_async.py)
    python -m minibatch demo run.json              replay a saved trace (no model needed)

Each scenario runs the shipped model through the real engine, records every step
with a ``TraceRecorder``, prints a short summary, and writes into ``out/demo/``
(ignored by git, so lecture output never lands in the repository):

    <scenario>.gif      the dashboard, one frame per step (``--out`` picks another path: .gif/.html/.mp4/.png)
    <scenario>.json     the recorded trace: replay it later without computing anything
    continuous-comparison.png   (continuous only) the two runs side by side
    tree-step.png       (tree only) one verify step: the tree and its tree mask, side by side

Frames use the slide preset: 1920×1080 with no text under 18 px, readable when
projected. ``--text`` prints the per-step text view instead of drawing (a
terminal, an SSH session, a machine without graphics); ``--small`` runs a
smaller workload and draws small frames (CI); under ``--text`` the tree scenario
prints each tree as an outline. The scenarios are deterministic: greedy decoding
(or seeded sampling), fixed prompts.
"""
from __future__ import annotations

import pathlib

from minibatch.engine.config import EngineConfig
from minibatch.engine.engine import LLMEngine
from minibatch.bench.workload import PROMPTS
from minibatch.sampling.sampler import SamplingParams
from minibatch.trace import TraceRecorder

SCENARIOS = ("continuous", "static", "paged", "speculative", "tree", "hierarchy", "structured", "disaggregated",
             "async")
OUT_DIR = pathlib.Path("out") / "demo"         # git-ignored (/out/ in .gitignore)
SPECULATIVE = {"method": "draft", "num_speculative_tokens": 3}
TREE = {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 16, "depth": 5, "topk": 4}
# Greedy continuations the EAGLE head half knows: paths of 1 to 5 drafts, often through a later sibling.
TREE_PROMPTS = ["try:\n    import json\n", "for i in range(", "# Copyright 2001\n", "class Stack:\n    def push(self"]



def _drive(engine: LLMEngine, arrivals: list) -> None:
    """Step the engine to the end; ``arrivals`` = [(step, request_id, prompt, params)] joining at that step.

    Arrivals by step (not by wall clock) make the picture the same on every machine.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        engine.step()
        step += 1


def _record(model, arrivals, meta, draft=None, **config) -> TraceRecorder:
    engine = LLMEngine(model, EngineConfig(**config), draft)
    rec = TraceRecorder(meta=meta)
    engine.add_hook(rec)
    _drive(engine, arrivals)
    engine.allocator.check_invariants(live_seq_ids=[])     # a demo that leaks blocks is a bug, not a lesson
    return rec


def _longtail_arrivals(n: int):
    """Everyone at step 0; output lengths with a long tail (most short, a few long): what static batching hates."""
    lengths = [6, 40, 8, 5, 12, 7, 36, 9, 6, 28, 10, 7][:n]
    return [(0, f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0, max_tokens=m))
            for i, m in enumerate(lengths)]


def scenario_batching(model, small: bool) -> dict:
    n = 6 if small else 12
    common = dict(block_size=8, num_gpu_blocks=48, max_num_seqs=4, max_num_batched_tokens=64)
    runs = {}
    for scheduling in ("static", "continuous"):
        rec = _record(model, _longtail_arrivals(n), {"scenario": scheduling}, scheduling=scheduling, **common)
        runs[scheduling] = (rec, None)
    return runs


def scenario_paged(model, small: bool) -> dict:
    """A shared preamble (prefix-cache hits), n = 2 parallel sampling (fork + copy-on-write),
    and a pool too small for everyone (preemption by recompute, then eviction of cached blocks)."""
    preamble = "import os\nimport sys\n\ndef main():\n"                      # 32 bytes = 8 full blocks of 4
    arrivals = [(0, "a", preamble + "    print(", SamplingParams(temperature=0, max_tokens=12)),
                (2, "b", preamble + "    return", SamplingParams(temperature=0, max_tokens=10)),
                (3, "c", "class Node:\n", SamplingParams(temperature=0.8, max_tokens=8, n=2, seed=1)),
                (5, "d", preamble + "    for x in", SamplingParams(temperature=0, max_tokens=14))]
    if not small:
        arrivals += [(8, "e", "def close(self):\n", SamplingParams(temperature=0, max_tokens=16)),
                     (10, "f", preamble + "    if not", SamplingParams(temperature=0, max_tokens=8))]
    rec = _record(model, arrivals, {"scenario": "paged"}, block_size=4, num_gpu_blocks=24,
                  max_num_seqs=4, max_num_batched_tokens=32)
    return {"paged": (rec, None)}


def scenario_speculative(model, small: bool) -> dict:
    from minibatch.model.weights import load_model
    draft = load_model("draft", device=model.device, dtype=model.dtype)
    n = 2 if small else 4
    # sampled at temperature 1, seeded: the draft is right often but not always, so the slivers show both
    # accepted and rejected drafts (greedy on code accepts ~95 %); a 64-token budget keeps the bars readable
    arrivals = [(0, f"s{i}", PROMPTS[i], SamplingParams(temperature=1.0, seed=i, max_tokens=12 if small else 32))
                for i in range(n)]
    rec = _record(model, arrivals, {"scenario": "speculative", "speculative": SPECULATIVE}, draft=draft,
                  block_size=8, num_gpu_blocks=40, max_num_seqs=4, max_num_batched_tokens=64,
                  speculative_config=dict(SPECULATIVE))
    return {"speculative": (rec, None)}


def scenario_tree(model, small: bool) -> dict:
    """EAGLE-2's dynamic tree: 16 drafts a sequence and step, grown where the head is confident, verified in one
    forward. Greedy: the longest path of argmax matches is kept (sampling takes the tree rule, rejection_sampler's
    tree_rejection_sample)."""
    n = 2 if small else 4
    arrivals = [(0, f"t{i}", TREE_PROMPTS[i], SamplingParams(temperature=0, max_tokens=12 if small else 32))
                for i in range(n)]
    rec = _record(model, arrivals, {"scenario": "tree", "speculative": TREE}, block_size=8, num_gpu_blocks=48,
                  max_num_seqs=4, max_num_batched_tokens=96, speculative_config=dict(TREE))
    return {"tree": (rec, None)}


def tree_lines(traces: list, meta=None) -> list:
    """Token trees: how long the kept path was, what the drafter's first-ranked branch alone (a chain of its top
    guesses) would have kept, and the tokens per target forward."""
    from minibatch.viz.tree_data import step_tree, tree_label                   # matplotlib-free, as the text view
    views = [step_tree(traces, t.step, s.seq_id) for t in traces for s in t.scheduled if s.draft_parents]
    if not views:
        return []
    spec = dict((meta or {}).get("speculative") or {})
    kind = tree_label(spec.get("method") or traces[-1].speculative_method)
    shape = ", ".join(f"{k} {spec[k]}" for k in ("depth", "topk") if k in spec)
    nodes = sum(len(v["parents"]) - 1 for v in views) / len(views)
    path = sum(len(v["accepted"]) - 1 for v in views) / len(views)
    first = sum(v["first_branch_accepted"] for v in views) / len(views)
    later = sum(v["first_branch_accepted"] < len(v["accepted"]) - 1 for v in views)
    batched = sum(t.num_batched_tokens for t in traces) / len(traces)
    return [f"  tree speculation ({kind}, {nodes:.1f} drafts a tree{', ' + shape if shape else ''}): "
            f"{len(views)} trees verified",
            f"    accepted path: {path:.2f} drafts on average; the first-ranked branch alone: {first:.2f} "
            f"({later} of {len(views)} paths went through a later sibling)",
            f"    tokens per step, batched (all sequences, drafts included):   {batched:.1f}",
            f"    tokens per target forward (emitted per sequence: accepted + 1): {path + 1:.2f}"]


def speculation_lines(traces: list, meta=None) -> list:
    """Acceptance, and the two rates a lecturer must not confuse: tokens batched per step (drafts count) and
    tokens emitted per target forward. A verify step emits its accepted drafts plus one token of the target's
    own (the bonus token when all k were accepted, else the correction), so: sum(accepted + 1) / verify steps."""
    from minibatch.stats import run_stats
    s = run_stats(traces)
    if not s.get("spec_proposed"):
        return []
    if any(x.draft_parents for t in traces for x in t.scheduled):
        return tree_lines(traces, meta)
    prop, acc = s["spec_proposed"], s["spec_accepted"]
    spec = dict((meta or {}).get("speculative") or {})
    method = spec.get("method") or s["speculative_method"]
    method = {"draft": "draft model", "ngram": "n-gram lookup"}.get(method, method)
    k = spec.get("num_speculative_tokens") or traces[-1].num_speculative_tokens or \
        max(x.proposed for t in traces for x in t.scheduled)
    batched, per_forward = s["mean_tokens_per_step"], s["tokens_per_verify_step"]
    return [f"  speculative decoding ({method + ', ' if method else ''}k = {k}): {acc}/{prop} draft tokens accepted "
            f"(alpha = {acc / prop:.2f})",
            f"    tokens per step, batched (all sequences, drafts included):   {batched:.1f}",
            f"    tokens per target forward (emitted per sequence: accepted + 1): {per_forward:.2f}"]


def summary_lines(name: str, traces: list, meta=None) -> list:
    """What a lecturer says over the animation, computed from the trace (``meta``: the recorder's)."""
    from minibatch.stats import run_stats
    s = run_stats(traces)
    seqs = {x.seq_id for t in traces for x in t.scheduled}
    lines = [f"{name}: {len(seqs)} sequences in {s['num_steps']} steps, {s['mean_tokens_per_step']:.1f} tokens/step "
             f"batched, KV blocks {100 * s['kv_usage_mean']:.0f}% used on average"]
    padding = s["padding_slot_steps"]
    if padding:
        lines.append(f"  static batching: {padding} slot-steps held by finished sequences "
                     f"(occupancy {s['useful_share_of_slots']:.0%})")
    pre = s["preemptions"]
    if pre:
        lines.append(f"  {pre} preemption(s): those sequences lost their blocks and recomputed them later")
    if s["prefix_cache_queries"]:
        from minibatch.viz.common import evicted_blocks            # matplotlib-free: the text view uses it too
        evicted = sum(len(evicted_blocks(traces, t.step)) for t in traces)
        lines.append(f"  prefix cache: {s['prefix_cache_hits']} of {s['prefix_cache_queries']} full prompt "
                     f"blocks reused; {evicted} cache entries evicted to make room")
    if any(max(t.ref_counts or [0]) > 1 for t in traces):
        lines.append(f"  blocks shared (ref count > 1) at some step: "
                     f"{sum(any(r > 1 for r in t.ref_counts) for t in traces)} steps")
    from minibatch.bench.demo_hierarchy import hierarchy_lines
    return lines + hierarchy_lines(traces) + speculation_lines(traces, meta)


def _write(rec: TraceRecorder, path: pathlib.Path, small: bool) -> list:
    from minibatch.viz.anim import save
    written = [path]
    save(rec, path, max_frames=8 if small else 40, dpi=40 if small else None, preset="slide")
    trace_path = path.with_suffix(".json")
    if trace_path != path:
        rec.save(trace_path)
        written.append(trace_path)
    return written


def _write_tree_step(rec: TraceRecorder, path: pathlib.Path, small: bool) -> pathlib.Path:
    """One verify step as a slide: the tree (left) and its tree mask (right). The step shown is the one whose
    accepted path beats the drafter's first-ranked branch by the most (what a chain would have lost)."""
    from minibatch.viz.anim import new_figure
    from minibatch.viz.tree import draw_tree, draw_tree_mask, step_tree
    views = [step_tree(rec, t.step, s.seq_id) for t in rec.traces for s in t.scheduled if s.draft_parents]
    best = max(views, key=lambda v: (len(v["accepted"]) - 1 - v["first_branch_accepted"], len(v["accepted"])))
    fig = new_figure(dpi=40 if small else None, preset="slide")
    fig.set_layout_engine("constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1.5, 1])
    draw_tree(rec, best["step"], best["seq_id"], ax=left, numbers=True, preset="slide")   # the mask's indices
    draw_tree_mask(rec, best["step"], best["seq_id"], ax=right, preset="slide")
    fig.savefig(path)
    return path


def _disaggregated(rec, path, text_only: bool, small: bool) -> int:
    from minibatch.bench import demo_disagg
    if text_only:
        from minibatch.viz.text import print_trace
        print_trace(rec)
    for line in demo_disagg.summary(rec):
        print(line)
    if not text_only:
        print("wrote " + ", ".join(str(p) for p in demo_disagg.write(rec, path, small)))
    return 0


def run_demo(scenario: str, out=None, text_only: bool = False, small: bool = False, simulate=None) -> int:
    """simulate='h100:llama-3-8b': also print each run re-timed on that GPU and model (``minibatch.perf``)."""
    if simulate is not None:                           # a bad profile fails before the run
        from minibatch.perf.cost import CostModel
        CostModel.from_spec(simulate)
    path = pathlib.Path(out) if out else OUT_DIR / f"{pathlib.Path(scenario).stem}.gif"
    if not text_only:                                  # a bad file name fails now, not after the run
        if not out:
            path.parent.mkdir(parents=True, exist_ok=True)
        from minibatch.viz.anim import SUFFIXES
        if path.suffix.lower() not in SUFFIXES:
            raise ValueError(f"cannot save {path.name!r}: choose a file ending in one of {', '.join(SUFFIXES)}")
        if not path.parent.is_dir():
            raise FileNotFoundError(f"cannot save {path}: the directory {path.parent} does not exist")
        if path.suffix.lower() == ".mp4":
            from minibatch.viz.anim import check_writer
            check_writer(".mp4")
    if scenario.endswith(".json"):                                          # replay: no model at all
        if not pathlib.Path(scenario).is_file():
            raise FileNotFoundError(f"no saved trace at {scenario}")
        rec = TraceRecorder.load(scenario)
        name = rec.meta.get("scenario", pathlib.Path(scenario).stem)
        runs = {name: (rec, None)}
        if name == "disaggregated":
            return _disaggregated(rec, path, text_only, small)
    elif scenario not in SCENARIOS:
        raise ValueError(f"unknown demo scenario {scenario!r}; choose one of {list(SCENARIOS)} "
                         f"or the path of a saved trace (.json)")
    else:
        from minibatch.model.weights import load_model
        model = load_model("target")
        print(f"running the {scenario!r} demo on {model.device} ...")
        if scenario == "disaggregated":                 # two instances: a renderer of its own
            from minibatch.bench.demo_disagg import record
            return _disaggregated(record(model, small), path, text_only, small)
        if scenario == "async":                        # two runs' lanes on the wall clock: a still of its own
            from minibatch.bench.demo_async import run
            return run(model, path, text_only, small)
        if scenario == "structured":                   # a still of its own: the masks beside the batch
            from minibatch.bench.structured_demo import run_structured_demo
            return run_structured_demo(model, path, text_only, small)
        if scenario in ("continuous", "static"):
            runs = scenario_batching(model, small)
            if scenario == "static":
                runs = {"static": runs["static"]}
        else:
            from minibatch.bench.demo_hierarchy import scenario_hierarchy
            runs = {"paged": scenario_paged, "speculative": scenario_speculative, "tree": scenario_tree,
                    "hierarchy": scenario_hierarchy}[scenario](model, small)
        name = scenario
    for label, (rec, seconds) in runs.items():
        if text_only:
            from minibatch.viz.text import print_trace
            print(f"=== {label} ===")
            print_trace(rec)
        for line in summary_lines(label, rec.traces, rec.meta):
            print(line)
    if simulate is not None:
        from minibatch.perf.clocks import compare_clocks
        print(compare_clocks({label: rec.traces for label, (rec, _) in runs.items()}, simulate))
    if "static" in runs and "continuous" in runs:
        st, ct = runs["static"][0].traces, runs["continuous"][0].traces
        print(f"continuous needs {len(ct)} steps where static needs {len(st)}: "
              f"{len(st) / len(ct):.2f}x fewer iterations for the same tokens "
              f"(throughput is measured by `python -m minibatch.bench batching`)")
    if text_only:
        return 0
    rec = (runs.get("continuous") or next(iter(runs.values())))[0]   # the run to animate
    written = _write(rec, path, small)
    if "static" in runs and "continuous" in runs:
        from minibatch.viz.anim import new_figure
        from minibatch.viz.usage import draw_comparison
        fig = new_figure(dpi=40 if small else None, preset="slide")
        draw_comparison(runs["static"][0], runs["continuous"][0], fig=fig, preset="slide")
        comparison = path.with_name(path.stem + "-comparison.png")
        fig.savefig(comparison)
        written.append(comparison)
    from minibatch.viz.common import has_trees
    if has_trees(rec.traces):
        written.append(_write_tree_step(rec, path.with_name(path.stem + "-step.png"), small))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
