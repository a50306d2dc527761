"""``python -m minibatch demo async``: one workload scheduled synchronously, then asynchronously.

Synchronous scheduling runs the CPU's work (schedule the step, prepare its inputs; after the forward, update the
sequences from its output) in series with the model's forward. Asynchronous scheduling (vLLM V1's
``--async-scheduling``, ``engine/async_scheduler.py``) schedules step N+1 and updates step N-1 while step N's
forward runs on the model's thread. Both runs give the same tokens; the demo prints, per run, its steps, its
wall time and the share of it the model lane was busy, and draws both runs' lanes (``viz/lanes.py``) one above
the other on a common scale: ``out/demo/async.png``, with each run's trace beside it (``async-sync.json``,
``async-async.json``: ``python -m minibatch demo out/demo/async-async.json`` replays one without a model).
"""
from __future__ import annotations

import pathlib
import time

from minibatch.bench.workload import PROMPTS
from minibatch.sampling.sampler import SamplingParams
from minibatch.trace import TraceRecorder

MODES = {"sync": False, "async": True}


def record(model, small: bool) -> dict:
    """{"sync": (TraceRecorder, wall seconds), "async": (...)}: the same requests, greedy, in each mode."""
    from minibatch.llm import LLM
    n, tokens = (4, 8) if small else (8, 24)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    runs, outputs = {}, {}
    for name, mode in MODES.items():
        llm = LLM(model, async_scheduling=mode, block_size=8, num_gpu_blocks=64, max_num_seqs=n,
                  max_num_batched_tokens=64)
        llm.generate(["x = 1\n"], SamplingParams(temperature=0, max_tokens=2))    # warm-up: not the first run's
        rec = TraceRecorder(meta={"scenario": "async", "async_scheduling": mode})   # cost alone
        llm.llm_engine.add_hook(rec)
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens))
        runs[name] = (rec, time.perf_counter() - start)
        llm.llm_engine.allocator.check_invariants(live_seq_ids=[])   # a demo that leaks blocks is a bug
        outputs[name] = [o.outputs[0].token_ids for o in outs]
    if outputs["sync"] != outputs["async"]:
        raise AssertionError("asynchronous scheduling changed the greedy tokens: a bug, not a lesson")
    return runs


def summary(runs: dict) -> list:
    from minibatch.viz.lanes import busy_share, overlap       # matplotlib-free functions of the traces
    lines = []
    for name, (rec, wall) in runs.items():
        tokens = sum(len(s.new_token_ids) for t in rec.traces for s in t.scheduled)
        lines.append(f"{name:>5}: {len(rec.traces)} steps, {tokens} tokens in {wall:.2f} s wall, model lane busy "
                     f"{busy_share(rec.traces, 'model'):.0%} of the run, both lanes busy "
                     f"{overlap(rec.traces) * 1e3:.1f} ms")
    (s, ws), (a, wa) = runs["sync"], runs["async"]
    lines.append(f"async / sync wall time: {wa / ws:.2f} (same tokens; on this CPU the model and the CPU's work "
                 f"share the cores, on a GPU they do not: notebook 09)")
    lines.append("  (sync's model lane holds its inputs and sampling too, as ModelRunner.execute runs them; async's "
                 "the forward alone, the rest on the CPU lane)")
    return lines


def write(runs: dict, path: pathlib.Path, small: bool) -> list:
    """Both runs' lanes, one above the other on one scale (a still), and each run's trace."""
    from minibatch.viz.anim import new_figure
    from minibatch.viz.lanes import draw_lanes, lane_spans
    png = path.with_suffix(".png")
    fig = new_figure(dpi=40 if small else None, preset="slide")
    fig.set_layout_engine("constrained")
    axes = fig.subplots(len(runs), 1, sharex=True)
    longest = max(max(e for _, e, _, _ in lane_spans(r.traces)["cpu"] + lane_spans(r.traces)["model"])
                  - min(t.schedule_span[0] for t in r.traces) for r, _ in runs.values())
    for ax, (name, (rec, _)) in zip(axes, runs.items()):
        res = draw_lanes(rec, ax=ax, legend=name == "sync", preset="slide")
        res["ax"].set_title(f"{name}: model busy {res['model_busy']:.0%} of the run", loc="left")
        ax.set_xlim(0, longest * 1e3)
    fig.savefig(png)
    written = [png]
    for name, (rec, _) in runs.items():
        trace = path.with_name(f"{path.stem}-{name}.json")
        rec.save(trace)
        written.append(trace)
    return written


def run(model, path: pathlib.Path, text_only: bool, small: bool) -> int:
    runs = record(model, small)
    if text_only:
        from minibatch.viz.text import print_trace
        for name, (rec, _) in runs.items():
            print(f"=== {name} ===")
            print_trace(rec)
    for line in summary(runs):
        print(line)
    if not text_only:
        print("wrote " + ", ".join(str(p) for p in write(runs, path, small)))
    return 0
