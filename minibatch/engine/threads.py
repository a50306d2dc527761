"""How many CPU threads a step uses: chosen from the model's size and the machine, in one place.

torch's default is one intra-op thread per core. A matrix product of a 3.4 M-parameter model is too small to
split: two threads each get a sliver of work and then wait for each other at every operator's barrier.
On a machine where anything else runs, the wait is for a core that the other job holds, and a step
that takes a millisecond alone takes tens of milliseconds (measured in minibatch/bench/README.md: the first command at
46-62 tokens/s with torch's 2 threads beside another job, 900+ with one). So on CPU the engine picks:

    threads = clamp(num_params // PARAMS_PER_THREAD, 1, cores this process may use)

which is 1 for the shipped models, and a thread per ~32 M parameters for larger ones (GPT-2 small, 124 M:
3 threads where there are cores for them). ``LLM(..., num_threads=n)`` or an entry point's ``--threads n``
overrides it. On a GPU the host threads only prepare inputs, so the engine leaves torch's setting alone.

Who applies it: ``LLMEngine.__init__`` (so ``LLM`` and the server get it), and every command line, which
calls ``use_cli(args.threads)`` first so that work done before an engine exists (and benches that build
no engine) runs the same way. torch's thread count is process-wide, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND``
is per worker process: the last engine built sets it.
"""
from __future__ import annotations

import argparse
import numbers
import os
from typing import Optional

import torch

PARAMS_PER_THREAD = 32_000_000      # a thread's worth of work per step; below it a second thread only waits
_cli_threads: Optional[int] = None  # --threads from the command line, for engines built without num_threads


def check_num_threads(n) -> None:
    """None (the default) or an int >= 1; the one check, used by EngineConfig and the command lines."""
    if n is not None and (not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1):
        raise ValueError(f"num_threads must be None (pick from the model's size) or an int >= 1, got {n!r}")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS says, else every core)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_num_threads(num_params: int) -> int:
    """The threads a model of num_params parameters can keep busy on this machine: 1 for the shipped models."""
    return max(1, min(available_cores(), int(num_params) // PARAMS_PER_THREAD))


def resolve(num_threads: Optional[int], num_params: int) -> int:
    """An explicit count wins, then the command line's --threads, then the model-size default."""
    check_num_threads(num_threads)
    if num_threads is not None:
        return int(num_threads)
    return _cli_threads if _cli_threads is not None else default_num_threads(num_params)


def apply(num_threads: Optional[int], model) -> Optional[int]:
    """Set torch's intra-op threads for `model` (a GPT) on CPU; returns the count, or None on a GPU (unchanged)."""
    if model.device.type != "cpu":
        return None
    n = resolve(num_threads, model.num_params())
    torch.set_num_threads(n)
    return n


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for the model (default: from the model's size, 1 for the shipped models)")


def use_cli(threads: Optional[int], num_params: int = 0) -> int:
    """A command line's first act: remember --threads for the engines it builds, and set torch's count now."""
    global _cli_threads
    check_num_threads(threads)
    _cli_threads = threads
    n = resolve(None, num_params)
    torch.set_num_threads(n)
    return n
