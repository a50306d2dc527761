"""Is the cost model right? Predicted against measured step times on this CPU, per step kind.

    python -m minibatch.bench validate [--profile out/perf/this-machine.json] [--small]

Runs the real engine on a workload that mixes what a serving step can be, records every step, and
compares each step's measured CPU time (``cpu_duration``: ``duration`` without the waits of a machine shared
with other processes) with ``CostModel(calibrated profile, target).step_time``:

* prefill chunks (a token budget of 128 cuts the prompts into chunks) and mixed steps (chunks beside decodes);
* decode batches of 1 to 32 rows (32 long-tail requests at max_num_seqs 32, draining to 1);
* verify steps of a draft model's chains (k = 3, 4 rows), and Medusa's token trees (2 rows).

Relative error |predicted - measured| / measured, its median and p90 per step kind. The profile is
calibrated (just before, unless ``--profile`` names a file) on a different, simpler run (``calibrate.py``),
so this is a held-out check. A shared machine is noisy even in CPU time (caches, memory bandwidth):
a step's measured time is one sample, and the p90 shows that noise too.
"""
from __future__ import annotations

import numpy as np

KINDS = ("prefill", "mixed", "decode", "verify", "tree")


def step_kind(trace) -> str:
    phases = {s.phase for s in trace.scheduled}
    if "decode" not in phases:
        return "prefill"
    if phases != {"decode"}:
        return "mixed"
    if any(s.draft_parents for s in trace.scheduled):
        return "tree"
    return "verify" if any(s.proposed for s in trace.scheduled) else "decode"


def validation_traces(small: bool = False) -> list:
    """The mixed workload's traces (warm engines; the first step of each run is left out as warm-up)."""
    from minibatch.bench.run import run_workload
    from minibatch.bench.workload import make_workload
    from minibatch.llm import LLM
    from minibatch.sampling.sampler import SamplingParams
    from minibatch.model.weights import load_model
    from minibatch.trace import TraceRecorder
    model, draft = load_model("target"), load_model("draft")
    n = 12 if small else 32
    _, traces, _ = run_workload(model, make_workload("longtail", num_requests=n, seed=3),
                                max_num_seqs=32, max_num_batched_tokens=128)
    out = list(traces[1:])
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n", "for i in range(10):\n"]
    params = SamplingParams(temperature=0, max_tokens=24 if small else 64)
    for spec, bs, dm in (({"method": "draft", "num_speculative_tokens": 3}, 4, draft),
                         ({"method": "medusa", "num_speculative_tokens": 4, "tree": "static"}, 2, None)):
        llm = LLM(model, draft_model=dm, max_num_seqs=bs, speculative_config=spec)
        llm.generate(prompts[:1], params, use_tqdm=False)                   # warm-up
        rec = TraceRecorder()
        llm.llm_engine.add_hook(rec)
        llm.generate(prompts[:bs], params, use_tqdm=False)
        out += rec.traces
    return out


def errors(traces, cost_model) -> dict:
    """kind -> [relative error of each step]."""
    errs = {k: [] for k in KINDS}
    for t in traces:
        if t.scheduled and t.cpu_duration:
            errs[step_kind(t)].append(abs(cost_model.step_time(t) - t.cpu_duration) / t.cpu_duration)
    return errs


def format_errors(errs: dict) -> str:
    lines = [f"{'step kind':<10} {'steps':>6} {'median':>8} {'p90':>8}"]
    every = [e for v in errs.values() for e in v]
    for k, v in [*errs.items(), ("all", every)]:
        if v:
            lines.append(f"{k:<10} {len(v):>6} {np.median(v):>8.1%} {np.percentile(v, 90):>8.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    from minibatch.bench.calibrate import calibrate
    from minibatch.perf.cost import CostModel
    from minibatch.perf.hardware import load_profile
    from minibatch.perf.models import get_model
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="a calibration file (default: calibrate now)")
    ap.add_argument("--small", action="store_true", help="a shorter workload (CI)")
    args = ap.parse_args(argv)
    try:
        prof = load_profile(args.profile) if args.profile else None
    except ValueError as e:                       # not a calibration file: its own message, and the usage
        ap.error(str(e))
    prof = prof or calibrate()
    print(f"profile {prof.name}: {prof.peak_flops['fp32'] / 1e9:.1f} GFLOP/s fp32, {prof.mem_bandwidth / 1e9:.1f} GB/s, "
          f"launch {prof.launch_overhead * 1e6:.1f} us, step {prof.step_overhead * 1e3:.2f} ms, "
          f"row {prof.row_overhead * 1e6:.0f} us")
    errs = errors(validation_traces(args.small), CostModel(prof, get_model("target"), get_model("draft")))
    print("relative error of each step's predicted time against its measured CPU time (this machine):")
    print(format_errors(errs))
    return 0
