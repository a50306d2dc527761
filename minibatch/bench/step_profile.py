"""Where a decode step's time goes: the PyTorch profiler over full-batch decode steps, grouped by what the work is.

    python -m minibatch.bench profile [--attention-backend batched,cpu,cpu+compile --max-num-seqs 16 --steps 30]

For each attention backend named ("+compile": with ``cuda_graph_mode="compile"``, the padded decode step compiled
at start-up, ``engine/cuda_graphs.py``), one engine (the shipped target, continuous batching) takes ``--max-num-seqs``
long-tail prompts, runs until every one of them is decoding, then ``--steps`` engine steps (whole steps:
scheduling, inputs, forward, sampling, bookkeeping) are profiled. Each profiled operator's *self* time goes to
one row below (an operator's self time excludes the operators it calls, so nothing is counted twice), and
"Python and the rest" is the step's wall time less all of them: the scheduler, building the inputs from lists,
the sampler's and the outputs' bookkeeping, in Python. The profiler adds a few microseconds to every operator,
so the operators' shares read high beside an unprofiled step; the wall time per step is measured without the
profiler too, before it, in 3 rounds alternating the engines (best and worst printed).

The rows are the ones the vLLM-peer issue's profile used, so "before" and "after" compare: the K/V gather
(``index_select`` of each row's blocks before SDPA: the "batched" backend), the C++ operator that reads the
blocks in place (the "cpu" backend, ``kv/backends/cpu_kernel.py``), SDPA, the K/V store, the linear layers, the
element-wise work, views and copies, sampling.
"""
from __future__ import annotations

import argparse
import time

import torch

from minibatch.bench.workload import make_workload
from minibatch.llm import LLM
from minibatch.sampling.sampler import SamplingParams

# (row, substrings of an operator's name); the first row whose substring matches takes the operator
ROWS = [("attention: C++ operator, blocks read in place", ("paged_attention_cpu",)),
        ("K/V store (index_copy_, or the C++ store)", ("index_copy", "store_kv_cpu")),
        ("K/V gather (index_select of the context)", ("index_select", "aten::gather", "aten::index")),
        ("SDPA", ("scaled_dot_product", "_flash_attention")),
        ("compiled code (Inductor's fused C++ loops)", ("CompiledFxGraph", "cpp_fused")),
        ("compiled step's guards and wrappers", ("Dynamo Cache Lookup", "AOTDispatcher", "Pregraph", "Torch-Compiled",
                                                 "CompiledFunction")),
        ("linear layers (addmm, mm)", ("addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul")),
        ("sampling (argmax, softmax, multinomial)", ("argmax", "softmax", "multinomial", "topk", "sort",
                                                     "exponential", "aten::max")),
        ("element-wise (norms, GELU, adds)", ("layer_norm", "gelu", "silu", "aten::add", "aten::mul", "aten::div",
                                              "aten::sub", "rsqrt", "aten::pow", "aten::mean", "aten::where",
                                              "aten::embedding", "aten::clamp", "aten::ge", "aten::lt", "aten::eq")),
        ("views, copies, new tensors", ("view", "select", "slice", "as_strided", "narrow", "reshape", "transpose",
                                        "copy", "aten::to", "contiguous", "aten::cat", "stack", "expand",
                                        "unsqueeze", "squeeze", "empty", "lift", "aten::tensor", "zeros", "full",
                                        "arange", "aten::t", "permute", "clone", "fill_", "detach", "alias",
                                        "resolve", "item", "_local_scalar"))]
PYTHON = "Python and the rest (scheduler, inputs, bookkeeping)"


def decoding_engine(backend, max_num_seqs: int, seed: int = 0) -> LLM:
    """An engine with max_num_seqs long-tail requests, stepped until every one of them has its first token.
    backend: an attention backend, "+compile" after it for the compiled decode step; None: the defaults."""
    kw = {}
    if backend and backend.endswith("+compile"):
        backend, kw = backend[:-len("+compile")], {"cuda_graph_mode": "compile", "cuda_graph_sizes": [max_num_seqs]}
    llm = LLM("target", max_num_seqs=max_num_seqs, attention_backend=backend, seed=seed, **kw)
    eng = llm.llm_engine
    for i, w in enumerate(make_workload("longtail", num_requests=max_num_seqs, seed=seed)):
        eng.add_request(str(i), w.prompt, SamplingParams(temperature=0, max_tokens=300))
    started: set = set()
    while len(started) < max_num_seqs:
        started |= {o.request_id for o in eng.step() if o.outputs[0].token_ids}
    return llm


def timed(eng, steps: int) -> float:
    """Wall ms per engine step over ``steps`` steps, unprofiled."""
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t) / steps * 1e3


def profile(eng, steps: int) -> tuple[dict, float]:
    """(row -> ms per step, wall ms per step) over ``steps`` profiled steps of the engine."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wall = timed(eng, steps)
    ms = {name: 0.0 for name, _ in ROWS}
    ms["other operators"] = 0.0
    for e in prof.key_averages():
        self_ms = e.self_cpu_time_total / 1e3 / steps
        row = next((name for name, keys in ROWS if any(k in e.key for k in keys)), "other operators")
        ms[row] += self_ms
    ms[PYTHON] = max(0.0, wall - sum(ms.values()))
    return ms, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench profile", description=__doc__.splitlines()[0])
    ap.add_argument("--attention-backend", default="batched,cpu,cpu+compile",
                    help="comma-separated backends, one column each (\"+compile\": the compiled decode step)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="decode rows a step")
    ap.add_argument("--steps", type=int, default=30, help="engine steps profiled")
    args = ap.parse_args(argv)
    backends = args.attention_backend.split(",")
    engines = {b: decoding_engine(b, args.max_num_seqs).llm_engine for b in backends}
    plain = {b: [] for b in backends}
    for _ in range(3):                       # unprofiled, alternating: every engine's contexts grow alike
        for b in backends:
            plain[b].append(timed(engines[b], args.steps))
    cols = {b: (*profile(engines[b], args.steps), min(plain[b]), max(plain[b])) for b in backends}
    print(f"A decode step of {args.max_num_seqs} rows (the shipped target, long-tail prompts of 32-192 bytes, greedy), "
          f"{args.steps} steps profiled, torch {torch.__version__}, {torch.get_num_threads()} thread(s):")
    print(f"{'':54s}" + "".join(f"{b + ' ms':>16s}{'share':>7s}" for b in backends))
    for row in [name for name, _ in ROWS] + ["other operators", PYTHON]:
        print(f"{row:54s}" + "".join(f"{cols[b][0][row]:16.2f}{cols[b][0][row] / cols[b][1]:7.0%}" for b in backends))
    print(f"{'step, profiled (wall)':54s}" + "".join(f"{cols[b][1]:16.2f}{'':7s}" for b in backends))
    print(f"{'step, not profiled (wall, best of 3 alternating runs)':54s}" +
          "".join(f"{cols[b][2]:16.2f}{'':7s}" for b in backends))
    print(f"{'  (worst of the 3)':54s}" + "".join(f"{cols[b][3]:16.2f}{'':7s}" for b in backends))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
