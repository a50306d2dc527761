"""``python -m minibatch.bench host-cpu``: the CPU's time per engine step outside the forward, measured here.

This is the figure behind ``minibatch/perf/host.py``'s profile: what the simulated clock adds to a GPU's step
for the host's work (schedule, inputs, sampling's bookkeeping, update_from_output, outputs), in series with the
forward (synchronous scheduling) or overlapped with it (asynchronous).

How: the shipped target model under asynchronous scheduling (so every piece of the CPU's work is on the main
thread, apart from the forward), one batch of r requests decoding together for ``steps`` tokens, r in
``sizes``. For each pure-decode step of all r rows, the CPU's time is its ``schedule_span`` (schedule + the
batch's metadata) + its ``update_span`` (sampling, placeholders resolved, the next forward launched,
update_from_output) + the time from the update's end to ``step()``'s return (the outputs, and the trace the
recorder needs). The median per r is fitted, least squares, to ``per_step + per_seq * r``.
"""
from __future__ import annotations

import argparse
import statistics
import time

from minibatch.bench.workload import PROMPTS
from minibatch.sampling.sampler import SamplingParams
from minibatch.trace import TraceRecorder

SIZES = (1, 4, 8, 16)


def cpu_per_step(model, rows: int, steps: int = 48) -> list:
    """The CPU's seconds in each pure-decode step of ``rows`` sequences (see the module's docstring)."""
    from minibatch.llm import LLM
    llm = LLM(model, async_scheduling=True, block_size=16, max_num_seqs=rows, max_num_batched_tokens=512)
    eng = llm.llm_engine
    llm.generate(["x = 1\n"], SamplingParams(temperature=0, max_tokens=2))          # warm-up
    rec = TraceRecorder()
    eng.add_hook(rec)
    for i in range(rows):
        eng.add_request(f"q{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0, max_tokens=steps))
    returned = {}                                        # trace index -> when the step() that made it returned
    while eng.has_unfinished_requests():
        before = len(rec.traces)
        eng.step()
        if len(rec.traces) > before:
            returned[len(rec.traces) - 1] = time.perf_counter() - eng.t0
    out = []
    for i, t in enumerate(rec.traces):
        if len(t.scheduled) == rows and all(s.phase == "decode" for s in t.scheduled):
            spans = (t.schedule_span[1] - t.schedule_span[0]) + (t.update_span[1] - t.update_span[0])
            out.append(spans + returned[i] - t.update_span[1])
    return out


def fit(medians: dict) -> tuple:
    """Least squares of {rows: seconds} to per_step + per_seq * rows: (per_step, per_seq)."""
    xs, ys = list(medians), list(medians.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    per_seq = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - per_seq * mx, per_seq


def measure(model, sizes=SIZES, steps: int = 48) -> dict:
    medians = {r: statistics.median(cpu_per_step(model, r, steps)) for r in sizes}
    per_step, per_seq = fit(medians)
    return {"medians": medians, "per_step": per_step, "per_seq": per_seq}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench host-cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=SIZES)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args(argv)
    if len(args.sizes) < 2 or min(args.sizes) < 1:
        ap.error(f"--sizes needs two or more batch sizes >= 1, got {args.sizes}")
    from minibatch.model.weights import load_model
    m = measure(load_model("target"), args.sizes, args.steps)
    for r, s in m["medians"].items():
        print(f"decode batch {r:>3}: CPU {s * 1e3:.3f} ms a step (median)")
    print(f"fit: {m['per_step'] * 1e3:.3f} ms a step + {m['per_seq'] * 1e3:.4f} ms a scheduled sequence "
          f"(minibatch/perf/host.py holds the figures the simulated clock uses)")
    return m
