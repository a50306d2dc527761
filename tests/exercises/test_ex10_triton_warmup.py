"""Exercise 10, graded: the Triton warm-up puzzles (exercises/ex10_triton_warmup.py).

Each puzzle against torch's own answer, in float32, on shapes chosen to catch the usual slips: lengths that are
not multiples of the block (an unmasked load reads past the end, an unmasked store writes past it), strided
rows, scores in the thousands (a softmax without its max overflows), padding lanes that must not count, a K
that is not a multiple of BLOCK_K, an index whose offset passes 2**31 elements. Every output is allocated inside
guard memory (exercises/guarded.py) that is checked after the call, so a store outside it fails the test every
time. Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""
import pytest
import torch

import exercises
from exercises.guarded import call

pytest.importorskip("triton", reason="exercise 10 needs Triton (Linux)")
pytestmark = pytest.mark.ex10
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def puzzle(name):
    return exercises.get(f"triton_warmup.{name}")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def same(got, want, tol=1e-5):
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, f"want shape {tuple(want.shape)}"
    assert not got.isnan().any(), "NaN in the output: a masked-off lane counted, or exp() overflowed"
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=tol, rtol=tol)


# -- 1. add ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [16, 37, 1])
def test_add(n):
    x, y = randn(n, seed=1), randn(n, seed=2)
    same(call(puzzle("add"), x, y), x + y)


def test_add_many_blocks_ragged_end():
    x, y = randn(203, seed=3), randn(203, seed=4)
    same(call(puzzle("add"), x, y, 32), x + y)


# -- 2. softmax -----------------------------------------------------------------------------------------------
def test_softmax_rows_of_a_power_of_two():
    x = randn(4, 32, seed=5)
    same(call(puzzle("softmax"), x), x.softmax(-1))


def test_softmax_padding_lanes_do_not_count():
    # 20 columns run in 32 lanes: the 12 past the row must add nothing to its sum, and be written nowhere
    x = randn(3, 20, seed=6)
    same(call(puzzle("softmax"), x), x.softmax(-1))


@pytest.mark.parametrize("shape", [(3, 24), (2, 64)])
def test_softmax_of_large_scores(shape):
    # scores in the thousands: exp() overflows unless the row's max is subtracted first
    x = randn(*shape, seed=7) * 1000
    same(call(puzzle("softmax"), x), x.softmax(-1))


def test_softmax_of_strided_rows():
    x = randn(5, 48, seed=8)[:, 5:35]                         # rows 48 apart, 30 columns each
    same(call(puzzle("softmax"), x), x.softmax(-1))


# -- 3. matmul ------------------------------------------------------------------------------------------------
def test_matmul_one_tile():
    a, b = randn(16, 16, seed=9), randn(16, 16, seed=10)
    same(call(puzzle("matmul"), a, b), a @ b, tol=1e-4)


def test_matmul_ragged_m_n_k():
    # no dimension a multiple of 16: every load and store is masked, and K's last step is partial
    a, b = randn(21, 37, seed=11), randn(37, 19, seed=12)
    same(call(puzzle("matmul"), a, b), a @ b, tol=1e-4)


def test_matmul_k_past_one_block():
    a, b = randn(16, 50, seed=13), randn(50, 32, seed=14)
    same(call(puzzle("matmul"), a, b), a @ b, tol=1e-4)


def test_matmul_transposed_operands():
    # b is a transposed view: its strides are (1, K), and the kernel must use them
    a, bt = randn(20, 24, seed=15), randn(18, 24, seed=16)
    same(call(puzzle("matmul"), a, bt.t()), a @ bt.t(), tol=1e-4)


def test_matmul_of_column_slices():
    # a's rows are 40 apart though K is 24; c = a @ b with b a column slice too
    a, b = randn(20, 40, seed=20)[:, 3:27], randn(24, 48, seed=21)[:, 8:40]
    same(call(puzzle("matmul"), a, b), a @ b, tol=1e-4)


# -- 4. gather ------------------------------------------------------------------------------------------------
def test_gather_rows():
    table = randn(50, 16, seed=17)
    idx = torch.tensor([3, 0, 49, 3, 7], device=DEVICE)
    same(call(puzzle("gather"), table, idx), table[idx])


def test_gather_strided_rows_and_a_ragged_width():
    table = randn(40, 32, seed=18)[:, 4:16]                  # 12 columns, rows 32 apart
    idx = torch.tensor([39, 1, 1, 20], dtype=torch.int32, device=DEVICE)
    same(call(puzzle("gather"), table, idx), table[idx])


@pytest.mark.parametrize("D", [16, 32])
def test_gather_past_two_to_the_32_elements(D):
    # int32 indices into a table of more than 2**32 elements (address space from torch.empty: only the rows
    # read are ever written): idx * stride must be computed in int64, or it wraps to another row
    rows = 2 ** 32 // D + 8
    table = torch.empty(rows, D, dtype=torch.float16, device=DEVICE)
    idx = torch.tensor([rows - 1, rows - 5, 3], dtype=torch.int32, device=DEVICE)
    table[idx.long()] = randn(3, D, seed=19).half()
    same(call(puzzle("gather"), table, idx), table[idx.long()])
