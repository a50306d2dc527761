"""Process groups for minibatch's distributed rooms: one owner of how ranks find each other.

``torch.distributed`` needs every rank to call ``init_process_group`` with the same rendezvous address,
the world size and its own rank. Two ways in:

* **spawned here** (``LLM(..., tensor_parallel_size=2)`` on one machine): the driver picks a free port on
  127.0.0.1 and hands ``(addr, port, world_size)`` to each process it starts (``spawn_context``);
* **torchrun** (several hosts): ``torchrun --nproc-per-node N script.py`` sets ``MASTER_ADDR``,
  ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``; ``init(rank=None)`` reads them (the ``env://`` method).

The backend is gloo on CPU and NCCL on CUDA (NCCL moves CUDA tensors only). Every collective of the group
runs under ``timeout``: a rank that died turns a blocked collective into an error after that long, never
a hang (``init_process_group(timeout=...)`` applies it to gloo's and NCCL's collectives alike).
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0


def collective_timeout_s() -> float:
    """Seconds any collective may wait: ``MINIBATCH_DIST_TIMEOUT`` (tests shorten it), else 60."""
    raw = os.environ.get("MINIBATCH_DIST_TIMEOUT", "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"MINIBATCH_DIST_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"MINIBATCH_DIST_TIMEOUT must be > 0, got {raw!r}")
    return value


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it); the rendezvous store binds it next."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def backend_for(device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init(rank: int, world_size: int, addr: str, port: int, device="cpu",
         timeout_s: float = None) -> None:
    """Join the default process group as ``rank`` of ``world_size`` (a TCP rendezvous at addr:port)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel or "
                           "disaggregated engine per process (shut the other one down first)")
    seconds = collective_timeout_s() if timeout_s is None else timeout_s
    dist.init_process_group(backend_for(device), init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=seconds))


def torchrun_env() -> dict | None:
    """``{rank, world_size, addr, port}`` when torchrun (or any env:// launcher) set them, else None."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "addr": os.environ["MASTER_ADDR"], "port": int(os.environ["MASTER_PORT"])}


def spawn_context():
    """Worker processes are *spawned* (a fresh interpreter), never forked: a fork would copy the parent's
    threads and locks (OpenMP's, the tokenizer's, CUDA's) in whatever state they were."""
    return mp.get_context("spawn")


SPAWN_HINT = ("a script that starts worker processes must guard its entry point with "
              "`if __name__ == \"__main__\":` (they are spawned, and import the main module again), and the process's "
              "own error is printed above")


def init_watching(procs, names, rank: int, world_size: int, addr: str, port: int, device="cpu",
                  timeout_s: float = None) -> None:
    """``init`` as ``rank``, while watching the processes that must join too: one that exits first (a script
    without a ``__main__`` guard, a crash while loading) is a clear error at once, not the group's timeout."""
    import threading
    failed = []

    def join():
        try:
            init(rank, world_size, addr, port, device, timeout_s)
        except Exception as e:                       # reported below, in the caller's thread
            failed.append(e)
    t = threading.Thread(target=join, daemon=True, name="minibatch-rendezvous")
    t.start()
    while t.is_alive():
        t.join(0.1)
        dead = [(n, p.exitcode) for n, p in zip(names, procs) if not p.is_alive()]
        if dead and t.is_alive():
            for p in procs:
                p.kill()
            who = ", ".join(f"{n} (exit code {c})" for n, c in dead)
            raise RuntimeError(f"{who} exited before joining the process group: {SPAWN_HINT}")
    if failed:
        raise failed[0]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
