"""Guarded outputs for the Triton exercises' tests: a store outside the output tensor is caught, every time.

Triton's interpreter (the CPU runs of the kernels) does no bounds checks: a kernel that stores past its
output writes into whatever memory follows, which may crash the process later or change nothing visible,
by chance. ``call(fn, *args)`` runs a launcher with the tensors it allocates (``torch.empty``, ``zeros``,
``full``, ``empty_like``, ``zeros_like``, looked up through its module's ``torch``) placed inside buffers 8
times larger, filled with SENTINEL around them, and checks the guards after the call.
"""
from __future__ import annotations

import math

import torch

SENTINEL = 1234.0          # exact in float16 and float32; no attention output here comes near it


class GuardedTorch:
    """``torch`` for the launcher's module during one call: each output it allocates (``torch.empty``, ``zeros``,
    ``full``, ``empty_like``, ``zeros_like``) is a view into a buffer 8 times larger, filled with SENTINEL before and after it, so a
    store outside ``out`` (the query's strides, lanes past head_dim) lands in the guard, where the test sees it,
    instead of in memory nobody checks (the interpreter does no bounds checks)."""

    def __init__(self):
        self.buffers = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *size, dtype=None, device=None, **kw):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
        n = math.prod(shape)
        buf = torch.full((8 * n + 128,), SENTINEL, dtype=dtype or torch.get_default_dtype(), device=device)
        self.buffers.append((buf, n))
        return buf[64:64 + n].view(shape)

    def zeros(self, *size, **kw):
        return self.empty(*size, **kw).zero_()

    def full(self, size, fill_value, dtype=None, device=None, **kw):
        return self.empty(size, dtype=dtype, device=device).fill_(fill_value)

    def empty_like(self, t, dtype=None, device=None, **kw):
        return self.empty(t.shape, dtype=dtype or t.dtype, device=device or t.device)

    def zeros_like(self, t, **kw):
        return self.empty_like(t, **kw).zero_()

    def check(self):
        for buf, n in self.buffers:
            guard = torch.cat([buf[:64], buf[64 + n:]])
            bad = (guard != SENTINEL).nonzero().flatten()[:4].tolist()
            assert not bad, (f"the kernel wrote outside out (at {bad} elements past the guard's start): store with "
                             f"out's own strides (not the query's) and mask the lanes d >= head_dim")


def call(fn, *args):
    """fn(*args) with the outputs its module allocates guarded; the guards are checked after the call."""
    names, guard = getattr(fn, "__globals__", {}), GuardedTorch()
    real = names.get("torch")
    if real is torch:
        names["torch"] = guard
    try:
        got = fn(*args)
    finally:
        if real is torch:
            names["torch"] = real
    guard.check()
    return got


