"""Mutant (exercise 10): gather keeps the index int32: index * stride wraps past 2**31 and reads another row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n                                      # the last block runs past the end
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, block: int = 16) -> torch.Tensor:
    """x + y for 1-D contiguous tensors of the same length."""
    out = torch.empty_like(x)
    n = x.numel()
    _add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, 0)                                 # stable: exp never overflows
    e = tl.exp(x)                                        # the padding lanes: exp(-inf) = 0
    tl.store(out_ptr + row * stride_out + cols, e / tl.sum(e, 0), mask=mask)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of a 2-D tensor whose rows are contiguous (the row stride may be anything)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0),
                                   BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")       # full float32 products (no TF32 on a GPU)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor, block_m: int = 16, block_n: int = 16, block_k: int = 16) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] (any strides)."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _matmul_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return c


@triton.jit
def _gather_kernel(table_ptr, idx_ptr, out_ptr, D, stride_t, stride_out, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(idx_ptr + i)          # BUG: int32              # int64 before the multiply: big tables
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(table_ptr + row * stride_t + cols, mask=mask, other=0.0)
    tl.store(out_ptr + i * stride_out + cols, x, mask=mask)


def gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table [V, D] (rows contiguous, any row stride), idx [N] int32/int64 -> out [N, D] = table[idx]."""
    out = torch.empty((idx.shape[0], table.shape[1]), dtype=table.dtype, device=table.device)
    if idx.shape[0]:
        _gather_kernel[(idx.shape[0],)](table, idx, out, table.shape[1], table.stride(0), out.stride(0),
                                        BLOCK_D=triton.next_power_of_2(table.shape[1]))
    return out

