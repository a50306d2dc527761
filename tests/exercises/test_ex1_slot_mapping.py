"""Exercise 1, graded: the slot mapping (exercises/ex1_slot_mapping.py).

Every test checks the implementation under test (exercises.get) against a
hand-worked answer or a plain-Python oracle (never against the reference: a student
release does not have it).
"""
import random

import pytest
import torch

import exercises

pytestmark = pytest.mark.ex1


def impl():
    return exercises.get("slot_mapping")


def oracle(block_tables, starts, counts, block_size):
    """slot = physical block * block_size + offset, one position at a time."""
    return [table[p // block_size] * block_size + p % block_size
            for table, s, n in zip(block_tables, starts, counts) for p in range(s, s + n)]


def check(block_tables, starts, counts, block_size, want=None):
    got = impl()(block_tables, starts, counts, block_size)
    assert isinstance(got, torch.Tensor), f"must return a tensor, got {type(got).__name__}"
    assert got.dtype == torch.int64 and got.dim() == 1, f"want int64 [T], got {got.dtype} {tuple(got.shape)}"
    want = oracle(block_tables, starts, counts, block_size) if want is None else want
    assert got.tolist() == want, f"tables {block_tables}, starts {starts}, counts {counts}, bs {block_size}"


def test_hand_worked_example():
    # seq 0: positions 3 (block 5, offset 3), 4 and 5 (block 2, offsets 0, 1); seq 1: positions 0, 1 of block 7
    check([[5, 2], [7]], [3, 0], [3, 2], 4, want=[23, 8, 9, 28, 29])


def test_prefill_from_zero_across_blocks():
    # 7 tokens, block size 3: blocks 4, 0, 9 in that (non-sorted) order; the last block is part-full
    check([[4, 0, 9]], [0], [7], 3, want=[12, 13, 14, 0, 1, 2, 27])


def test_decode_batch_one_token_each():
    # decode: the one new token sits at position start = length already cached (not a multiple of bs)
    tables = [[3, 8], [6], [1, 0, 2]]
    check(tables, [5, 2, 8], [1, 1, 1], 4, want=[33, 26, 8])


def test_chunk_starting_on_a_block_boundary():
    # a later prefill chunk: positions 4..9 with block size 4 start exactly at logical block 1
    check([[7, 3, 5]], [4], [6], 4, want=[12, 13, 14, 15, 20, 21])


def test_block_size_one_and_one_big_block():
    check([[9, 4, 6, 1]], [1], [3], 1, want=[4, 6, 1])
    check([[2]], [5], [11], 16, want=list(range(37, 48)))


def test_idle_sequence_feeds_no_token():
    # a sequence with nothing new this step contributes no slot; the others keep their order
    check([[4, 1], [6], [3, 0]], [5, 2, 3], [2, 0, 2], 4, want=[5, 6, 15, 0])


def on_device(block_tables, starts, counts, block_size, device):
    """The result asked for on ``device``: int64 [T] there."""
    got = impl()(block_tables, starts, counts, block_size, device=device)
    T = sum(counts)
    assert isinstance(got, torch.Tensor), f"must return a tensor, got {type(got).__name__}"
    assert got.device == torch.device(device), f"asked for device={device!r}, got a tensor on {got.device}"
    assert got.dtype == torch.int64 and tuple(got.shape) == (T,), \
        f"want int64 [{T}] on {device}, got {got.dtype} {tuple(got.shape)}"
    return got


def test_device_argument_places_the_result():
    # "meta" is a device that holds shapes but no data: the slots must be built (on the CPU is fine) and
    # moved there, as the engine asks for its accelerator; on device="cpu" the values are checked too
    tables, starts, counts = [[5, 2], [7]], [3, 0], [3, 2]
    on_device(tables, starts, counts, 4, "meta")
    assert on_device(tables, starts, counts, 4, torch.device("cpu")).tolist() == [23, 8, 9, 28, 29]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixed_batch(seed):
    # mixed decode / prefill / chunk, shuffled non-contiguous block ids, lengths not multiples of bs
    rng = random.Random(seed)
    bs = rng.choice([2, 3, 5, 8])
    pool = list(range(200))
    rng.shuffle(pool)
    tables, starts, counts = [], [], []
    for _ in range(6):
        start = rng.randrange(0, 20)
        count = rng.choice([1, 1, rng.randrange(1, 15)])
        need = -(-(start + count) // bs)
        tables.append([pool.pop() for _ in range(need)])
        starts.append(start)
        counts.append(count)
    check(tables, starts, counts, bs)
    on_device(tables, starts, counts, bs, "meta")                  # and where the engine asks for it
