"""Exercise 10: a Triton warm-up, four small kernels before the paged decode kernel of exercise 9 (in the
style of Triton-Puzzles, Rush et al.). Do it before exercise 9: it is numbered 10 only so that the numbers of
the earlier parts stay as they were.

Each puzzle is a kernel you write and a launcher that is given (it picks the grid and passes the strides).
Triton in ten lines (https://triton-lang.org, "triton.language"): ``tl.program_id(0)`` is this program's
index in the grid; ``tl.arange(0, N)`` (N a power of two, a constexpr) a vector of offsets; ``ptr + offs``
a vector of addresses, ``ptr + rows[:, None] * stride_r + cols[None, :] * stride_c`` a 2-D tile;
``tl.load(ptrs, mask=m, other=v)`` reads where m is true (v elsewhere), ``tl.store(ptrs, x, mask=m)`` writes
where m is true; ``tl.sum``, ``tl.max``, ``tl.exp``, ``tl.dot(a, b)`` (tiles of at least 16 x 16),
``tl.zeros([M, N], tl.float32)``, ``x.to(tl.int64)``. Without a GPU the tests run your kernels in Triton's
interpreter (``TRITON_INTERPRET=1``), where ``print(x)`` inside a kernel works. A store outside the output
is caught: the tests guard the memory around it.

    1. _add_kernel       out = x + y, one BLOCK of elements per program; n need not be a multiple of BLOCK
    2. _softmax_kernel   one row per program; stable (the scores may be in the thousands); the padding
                         lanes past n_cols must not count
    3. _matmul_kernel    one [BLOCK_M, BLOCK_N] tile of C = A @ B per program, a loop over K in BLOCK_K steps;
                         M, N, K need not be multiples of the blocks; any strides
    4. _gather_kernel    out[i] = table[idx[i]], one row per program; the table's rows may be strided and
                         the table large (an index times a stride can pass 2**31)

The reference is ``kernels/puzzles.py`` (a student release leaves its kernels out).

Run the tests:  MINIBATCH_STUDENT=triton_warmup python -m pytest tests/exercises -m ex10
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[i] = x[i] + y[i] for i in this program's BLOCK of indices (program p: p * BLOCK ..), i < n only."""
    tl.static_assert(False, "Exercise 10: write _add_kernel (exercises/ex10_triton_warmup.py)")


def add(x: torch.Tensor, y: torch.Tensor, block: int = 16) -> torch.Tensor:
    """x + y for 1-D contiguous tensors of the same length."""
    out = torch.empty_like(x)
    n = x.numel()
    _add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    """out[row, :n_cols] = softmax(x[row, :n_cols]); row r starts at x_ptr + r * stride_x (and
    out_ptr + r * stride_out); BLOCK >= n_cols. Stable for scores in the thousands; lanes >= n_cols neither
    count nor are written."""
    tl.static_assert(False, "Exercise 10: write _softmax_kernel (exercises/ex10_triton_warmup.py)")


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of a 2-D tensor whose rows are contiguous (the row stride may be anything)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0),
                                   BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile (program_id(0), program_id(1)) of C = A @ B: rows pid0 * BLOCK_M .., columns pid1 * BLOCK_N ..;
    accumulate in float32 over K in steps of BLOCK_K (``tl.dot``; ``input_precision="ieee"`` keeps float32
    products exact on a GPU too); every load and store masked at M, N, K."""
    tl.static_assert(False, "Exercise 10: write _matmul_kernel (exercises/ex10_triton_warmup.py)")


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
    """out[i, :D] = table[idx[i], :D] for i = program_id(0); row r of the table starts at table_ptr +
    r * stride_t (row i of out at out_ptr + i * stride_out); BLOCK_D >= D. Index times stride in int64."""
    tl.static_assert(False, "Exercise 10: write _gather_kernel (exercises/ex10_triton_warmup.py)")


def gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table [V, D] (rows contiguous, any row stride), idx [N] int32/int64 -> out [N, D] = table[idx]."""
    out = torch.empty((idx.shape[0], table.shape[1]), dtype=table.dtype, device=table.device)
    if idx.shape[0]:
        _gather_kernel[(idx.shape[0],)](table, idx, out, table.shape[1], table.stride(0), out.stride(0),
                                        BLOCK_D=triton.next_power_of_2(table.shape[1]))
    return out
