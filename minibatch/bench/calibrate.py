"""This machine's hardware profile, measured, not typed:  python -m minibatch.bench calibrate [--out FILE]

Three microbenchmarks, each the best of several runs (noise only slows):

* peak FLOP/s: fp32 matrix products of the shapes the shipped model runs in a full step (hidden 256:
  [T, 256] x [256, 768], [T, 256] x [256, 1024], [T, 1024] x [1024, 256], T = 128), the fastest. A large
  square runs faster still, but that is not what the model's steps can reach;
* memory bandwidth: reading a buffer the size of the shipped model's weights (``x.sum()``), bytes / s. A CPU
  serves a 13 MB working set partly from its caches; that is the bandwidth the model's steps see;
* per-op overhead: one tiny op (a 1-element add), which is all dispatch.

Then the part no microbenchmark sees, the engine's own time outside its operators (scheduling, building the
flat batch, Python), and what the shipped model's eager PyTorch forward dispatches per counted kernel:
a short calibration run of the real engine (decode batches of 1, 8 and 32 rows and their prompts) whose
CPU step times (``StepTrace.cpu_duration``) are fitted, by least squares of relative errors, as
roofline + launches x op overhead + b + c x rows + e x tokens, with ``step_overhead`` = b,
``row_overhead`` = c and ``token_overhead`` = e (each clipped at >= 0). (The launches per step hardly
vary, so they could not be told apart from b: the op overhead stays the microbenchmark's.)
The validation bench (``python -m minibatch.bench validate``) then checks the profile on a *different*
workload: prefill chunks, decode batches of 1-32 rows, verify steps and token trees.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from minibatch.perf.hardware import HardwareProfile, save_profile


def _best(fn, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()           # CPU time: a shared machine's waits are not the hardware's cost
        fn()
        best = min(best, time.process_time() - t)
    return best


def measure_flops() -> float:
    best = 0.0
    for m, k, n, reps in ((128, 256, 768, 50), (128, 256, 1024, 50), (128, 1024, 256, 50)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        t = _best(lambda: [torch.mm(a, b) for _ in range(reps)])
        best = max(best, 2 * m * k * n * reps / t)
    return best


def measure_bandwidth(nbytes: int = 13_000_000) -> float:
    x = torch.randn(nbytes // 4)
    t = _best(lambda: [x.sum() for _ in range(10)])
    return 10 * x.numel() * 4 / t


def measure_op_overhead() -> float:
    a, b = torch.zeros(1), torch.zeros(1)
    t = _best(lambda: [torch.add(a, b) for _ in range(2000)])
    return t / 2000


def _calibration_traces(model):
    """Traces of a short real run: prompts (whole, up to 300 tokens), then decode batches of 1, 8 and 32 rows
    (not the validation mix: no chunks beside decodes, no drafts)."""
    from minibatch.llm import LLM
    from minibatch.sampling.sampler import SamplingParams
    from minibatch.trace import TraceRecorder
    traces = []
    for bs in (1, 8, 32):
        llm = LLM(model, max_num_seqs=bs)
        rec = TraceRecorder()
        llm.generate(["def main():\n"] * bs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
        llm.llm_engine.add_hook(rec)
        llm.generate([f"# calibration {i}\nimport os\n" * (1 + 15 * (i % 2)) for i in range(bs)],
                     SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
        traces += rec.traces
    return traces


def fit_overheads(base: HardwareProfile, traces, model_profile) -> tuple[float, float, float]:
    """Least squares (relative) of measured - roofline - launches on [1, rows, tokens]: (step, row, token)
    overheads, each >= 0."""
    from minibatch.perf.cost import CostModel
    cm = CostModel(base, model_profile)
    X, y = [], []
    for t in traces:
        if not t.scheduled:
            continue
        roof = sum(b["time_s"] for b in cm.breakdown(t))
        launches = sum(o.kernels for o in cm.forward_ops(model_profile, cm.target_rows(t)))
        w = 1.0 / t.cpu_duration          # relative errors, as the validation judges: a short step counts as much
        X.append([w, w * len(t.scheduled), w * t.num_batched_tokens])
        y.append(w * (t.cpu_duration - roof - launches * base.launch_overhead))
    coef, *_ = np.linalg.lstsq(np.asarray(X), np.asarray(y), rcond=None)
    return tuple(float(max(0.0, c)) for c in coef)


def calibrate(name: str = "this-machine", fit: bool = True) -> HardwareProfile:
    from minibatch.perf.models import get_model
    from minibatch.model.weights import load_model
    flops, bw, op = measure_flops(), measure_bandwidth(), measure_op_overhead()
    src = f"measured by python -m minibatch.bench calibrate ({os.cpu_count()} CPUs, torch {torch.__version__}, " \
          f"{torch.get_num_threads()} threads)"
    prof = HardwareProfile(name, {"fp32": flops}, bw, 16e9, op, sources={
        "peak_flops": src + ": best fp32 matmul of the shipped model's shapes",
        "mem_bandwidth": src + ": reading a 13 MB buffer (the shipped weights' size)",
        "mem_capacity": "not measured: 16 GB assumed (a laptop)",
        "launch_overhead": src + ": a 1-element add"})
    if not fit:
        return prof
    step, row, tok = fit_overheads(prof, _calibration_traces(load_model("target")), get_model("target"))
    return HardwareProfile(name, prof.peak_flops, bw, prof.mem_capacity, op, step_overhead=step,
                           row_overhead=row, token_overhead=tok, sources={**prof.sources,
                                                      "step_overhead": src + ": fitted on a calibration run",
                                                      "row_overhead": src + ": fitted on a calibration run",
                                                      "token_overhead": src + ": fitted on a calibration run"})


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/perf/this-machine.json", help="where to write the profile (JSON)")
    ap.add_argument("--no-fit", action="store_true", help="microbenchmarks only (no calibration run of the engine)")
    args = ap.parse_args(argv)
    prof = calibrate(fit=not args.no_fit)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_profile(prof, args.out, meta={"measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})
    print(f"peak fp32 {prof.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, bandwidth {prof.mem_bandwidth / 1e9:.1f} GB/s, "
          f"ridge {prof.ridge('fp32'):.1f} FLOP/B, launch {prof.launch_overhead * 1e6:.1f} us, "
          f"step {prof.step_overhead * 1e3:.2f} ms, row {prof.row_overhead * 1e6:.0f} us, token "
          f"{prof.token_overhead * 1e6:.0f} us  ->  {args.out}")
    print(f"use it: LLM('target', simulate='{args.out}:target')")
    return 0
