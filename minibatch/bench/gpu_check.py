"""The prepared GPU check: one command for a lent GPU, about 8 minutes, every log kept.

    python -m minibatch.bench gpu-check              # on a CUDA machine; logs under $OUT (else ./gpu-check-logs)
    python -m minibatch.bench gpu-check --dry-run    # print the steps, run nothing

It runs, in order, each as its own process with its own time limit, and goes on past a failure:

1. the ``gpu`` tests (``pytest -m gpu``): the engine natively on CUDA against the CPU oracle for every backend,
   speculation method and tree, with CUDA graphs and without; the kernels at fp16/bf16 against torch;
2. ``python -m minibatch.bench attention``: the decode kernels' GB/s, to set against the card's copy bandwidth;
3. ``bench batching``, ``bench speculative`` and ``bench trees`` with ``--device cuda`` and the ``triton``
   backend, CUDA graphs on (the default on CUDA) and off (``--enforce-eager``), small enough to fit.

The total has a budget (``--budget``, seconds): a step that would start past it is skipped and said so.
``summary.txt`` lists each step's command, exit status and time; ``<step>.log`` holds its output, and
``nvidia-smi.txt`` names the card the figures came from.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
SMALL = ["--max-tokens", "64", "--repeats", "2"]


def steps() -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds), in the order they run."""
    bench = [PY, "-m", "minibatch.bench"]
    out = [("gpu-tests", [PY, "-m", "pytest", "tests", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs"], 180),
           ("attention", bench + ["attention"], 75)]
    for graphs, flag in (("graphs", []), ("eager", ["--enforce-eager"])):
        out += [(f"batching-{graphs}", bench + ["batching", "--device", "cuda", "--backend", "triton",
                                                "--num-requests", "48", "--max-num-seqs", "16", *SMALL, *flag], 50),
                (f"speculative-{graphs}", bench + ["speculative", "--device", "cuda", "--backend", "triton",
                                                   "--batch-sizes", "1,16", "--ks", "3", *SMALL, *flag], 60),
                (f"trees-{graphs}", bench + ["trees", "--device", "cuda", "--batch-sizes", "1,16",
                                             "--temperatures", "0", *SMALL, *flag], 50)]
    return out


def run_step(name: str, cmd: list[str], limit: int, logs: Path) -> tuple[int | str, float]:
    t0 = time.time()
    with open(logs / f"{name}.log", "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {limit} s"
    return rc, time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minibatch.bench gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-logs", help="log folder (default: $OUT)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for all steps together")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None, help="comma-separated step names")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and stop")
    args = ap.parse_args(argv)
    todo = steps()
    names = [n for n, _, _ in todo]
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            ap.error(f"unknown step(s) {unknown}; the steps are {names}")
        todo = [s for s in todo if s[0] in args.only]
    if args.dry_run:
        for name, cmd, limit in todo:
            print(f"{name:<18} <= {limit:>3} s  {shlex.join(cmd)}")
        return 0
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu-check needs a CUDA GPU and torch sees none (--dry-run lists the steps).")
    logs = Path(args.out)
    logs.mkdir(parents=True, exist_ok=True)
    card = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout if _has("nvidia-smi") else ""
    (logs / "nvidia-smi.txt").write_text(card or torch.cuda.get_device_name(0) + "\n")
    start, lines = time.time(), [f"card: {torch.cuda.get_device_name(0)}"]
    for name, cmd, limit in todo:
        left = args.budget - (time.time() - start)
        if left < limit / 2:
            lines.append(f"{name:<18} skipped: {left:.0f} s of the budget left, it may take {limit} s")
        else:
            rc, took = run_step(name, cmd, int(min(limit, left)), logs)
            lines.append(f"{name:<18} exit {rc} in {took:5.1f} s   {shlex.join(cmd)}")
        print(lines[-1], flush=True)
    (logs / "summary.txt").write_text("\n".join(lines) + "\n")
    print(f"logs in {logs.resolve()}")
    return 0


def _has(tool: str) -> bool:
    from shutil import which
    return which(tool) is not None


if __name__ == "__main__":
    sys.exit(main())
