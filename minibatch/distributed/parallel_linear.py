"""Megatron-LM's two ways to split a Linear layer over ``world`` ranks (Shoeybi et al. 2019, §3).

A Linear computes y = x W^T + b with W [out, in]. Split W two ways:

* **column-parallel**: rank r keeps rows r·out/world .. (r+1)·out/world of W (and of b). Each rank gets the
  whole x and produces its own slice of y, y_r [T, out/world]: no communication. The next layer must then
  take a slice as its input...
* **row-parallel**: rank r keeps columns r·in/world .. of W. Each rank multiplies its slice of x by its slice
  of W and gets a *partial sum* of the whole y; one **all-reduce** (sum) gives every rank the full y. The bias
  is added once, after the sum.

Column then row (the MLP's c_fc then c_proj; attention's qkv then c_proj) needs one all-reduce per pair,
and the elementwise work between them (GELU; attention per head) is local because it never mixes columns
(GELU) or heads (attention). So a GPT-2 block costs two all-reduces of [T, C] per forward.

Shapes with T rows, world W: column [T, in] -> [T, out/W]; row [T, in/W] -> [T, out] (after the all-reduce).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _check_split(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what} ({n}) does not divide by tensor_parallel_size={world}")
    return n // world


class ColumnParallelLinear(nn.Module):
    """Rank ``rank``'s rows of a Linear's weight: x [T, in] -> its slice of y [T, out / world]."""

    def __init__(self, full: nn.Linear, rank: int, world: int, row_groups: int = 1):
        super().__init__()
        # row_groups > 1: the weight stacks several outputs (attention's q, k and v); each is split alike, so
        # rank r gets q's, k's and v's slice r, stacked in that order.
        out = _check_split(full.out_features, row_groups, "the fused outputs")
        part = _check_split(out, world, "a column-parallel output")
        rows = torch.cat([torch.arange(g * out + rank * part, g * out + (rank + 1) * part)
                          for g in range(row_groups)])
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())           # [row_groups * part, in]
        self.bias = nn.Parameter(full.bias.detach()[rows].clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank ``rank``'s columns of a Linear's weight: its slice of x [T, in / world] -> y [T, out], summed
    over the ranks by one all-reduce."""

    def __init__(self, full: nn.Linear, rank: int, world: int, group=None):
        super().__init__()
        part = _check_split(full.in_features, world, "a row-parallel input")
        self.weight = nn.Parameter(full.weight.detach()[:, rank * part:(rank + 1) * part].clone())   # [out, part]
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        self.group, self.world = group, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)                          # this rank's partial sum [T, out]
        if self.world > 1:
            dist.all_reduce(y, group=self.group)              # every rank now holds sum over ranks
        return y + self.bias if self.bias is not None else y
