"""A decode step's time with CUDA graphs (on a CPU: eager-replay) against eager, alternating rounds:

    python -m minibatch.bench.cuda_graphs [--device cuda] [--batch 16] [--backend batched] [--rounds 5]

The graph path itself is ``engine/cuda_graphs.py``; this only drives two engines and times their steps.
"""
from __future__ import annotations

import argparse
import time

import torch

from minibatch.llm import LLM
from minibatch.sampling.sampler import SamplingParams


def _step_time(llm, batch: int, steps: int) -> float:
    """Seconds of one engine step at ``batch`` running decodes (best of ``steps``), after their prefills."""
    eng = llm.llm_engine
    for i in range(batch):
        eng.add_request(f"t{i}", bytes(range(32, 42 + 3 * i)).decode(), SamplingParams(temperature=0, max_tokens=steps + 8))
    for _ in range(3):
        eng.step()
    best = float("inf")
    for _ in range(steps):
        if eng.model.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        best = min(best, time.perf_counter() - t)
    while eng.has_unfinished_requests():
        eng.step()
    return best


def main(argv=None) -> int:
    """python -m minibatch.bench.cuda_graphs [--device cuda] [--batch 16]: a decode step's time, graphs (on
    the CPU: eager-replay) against eager, alternating rounds, best of each, with the spread over rounds."""
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench.cuda_graphs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--backend", default="batched")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    cuda = a.device.startswith("cuda")
    graphs = "graphs" if cuda else "eager-replay"
    llms = {"eager": LLM(device=a.device, attention_backend=a.backend, max_num_seqs=a.batch, enforce_eager=True),
            graphs: LLM(device=a.device, attention_backend=a.backend, max_num_seqs=a.batch,
                        **({} if cuda else {"cuda_graph_mode": "eager-replay"}))}
    times = {k: [] for k in llms}
    for _ in range(a.rounds):
        for k, llm in llms.items():
            times[k].append(_step_time(llm, a.batch, 20))
    for k, ts in times.items():
        print(f"{k:12s} decode step, batch {a.batch}, {a.device}, {a.backend}: best {min(ts) * 1e6:.0f} us "
              f"(rounds {min(ts) * 1e6:.0f}-{max(ts) * 1e6:.0f} us)")
    print(f"eager / {graphs}: {min(times['eager']) / min(times[graphs]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
