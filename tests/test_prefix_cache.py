"""The prefix cache: which blocks are reused, what is never shared, collisions, eviction order, counters.

Block size 4 throughout, so block i of a prompt is tokens 4i..4i+3. The allocator keeps no tokens: as the
engine's ``Sequence`` does, the tests keep them and pass them to ``mark_computed``.
"""
import sys

import pytest

from minibatch.kv.block_allocator import BlockAllocator, NoFreeBlocksError

A = [10, 11, 12, 13, 20, 21, 22, 23, 30, 31]        # 2 full blocks + 2 tokens


def patch_hash(monkeypatch, fn):
    """Replace hash_block_tokens wherever the allocator reads it: minibatch's module and, in a student release
    (where BlockAllocator is built over the student's class), the student's module too."""
    for cls in type(BlockAllocator(1, 4)).__mro__:
        mod = sys.modules.get(cls.__module__)
        if mod is not None and hasattr(mod, "hash_block_tokens"):
            monkeypatch.setattr(mod, "hash_block_tokens", fn)


def computed(a, sid, tokens):
    """Allocate and prefill in one go (the KV of every token is then written)."""
    cached = a.allocate(sid, tokens)
    a.mark_computed(sid, len(tokens), tokens)
    return cached


def test_a_shared_prefix_reuses_the_same_physical_blocks():
    a = BlockAllocator(8, 4)
    assert computed(a, "a", A) == 0
    assert a.block_table("a") == [0, 1, 2] and a.cached_block_ids() == [0, 1]
    b = A[:8] + [50, 51, 52]
    assert a.num_cached_prefix_tokens(b) == 8
    assert a.allocate("b", b) == 8                     # KV of tokens 0..7 is already there
    assert a.block_table("b") == [0, 1, 3] and a.ref_counts()[:4] == [2, 2, 1, 1]
    assert a.num_cached_blocks("b") == 2 and a.num_slots("b") == 11
    c = A[:4] + [99] * 6                                # shares only the first block
    assert a.allocate("c", c) == 4 and a.block_table("c") == [0, 4, 5]
    assert a.ref_count(0) == 3
    a.check_invariants(["a", "b", "c"])


def test_a_different_first_block_shares_nothing_even_if_later_blocks_match():
    a = BlockAllocator(8, 4)
    computed(a, "a", A)
    assert a.allocate("b", [0, 0, 0, 0] + A[4:]) == 0   # block 1 has A's tokens but another prefix
    assert a.block_table("b") == [3, 4, 5]


def test_a_prompt_of_whole_blocks_still_computes_its_last_token():
    a = BlockAllocator(8, 4)
    computed(a, "a", A[:8])
    assert a.cached_block_ids() == [0, 1]
    assert a.num_cached_prefix_tokens(A[:8]) == 4      # not 8: the last token must make logits
    assert a.allocate("b", A[:8]) == 4
    assert a.block_table("b") == [0, 2]                 # the block holding the last token is private
    assert a.allocate("c", A[:9]) == 8                  # one token more: both blocks reused
    assert a.block_table("c") == [0, 1, 3]
    assert a.num_cached_prefix_tokens(A[:4]) == 0 and a.num_cached_prefix_tokens(A[:1]) == 0


def test_partial_blocks_are_never_cached():
    a = BlockAllocator(8, 4)
    computed(a, "a", A)
    assert 2 not in a.cached_block_ids()               # block 2 holds 2 of 4 tokens
    assert a.allocate("b", A + [32, 33]) == 8           # so a longer prompt gets only 2 blocks
    a_tokens = A + [32, 33]
    assert a.append_slots("a", 2) == []                 # block 2 fills up ...
    assert a.cached_block_ids() == [0, 1] and a.num_cached_blocks("a") == 2
    a.mark_computed("a", 10, a_tokens)                  # (the old count again: nothing new)
    assert a.cached_block_ids() == [0, 1]
    a.mark_computed("a", 12, a_tokens)                  # ... and is computed: now it is an entry
    assert a.cached_block_ids() == [0, 1, 2] and a.num_cached_blocks("a") == 3
    assert a.allocate("c", A + [32, 33, 7]) == 12


def test_blocks_not_yet_computed_are_not_shared():
    a = BlockAllocator(16, 4)
    a.allocate("a", A)                                  # blocks given out, KV not written yet
    assert a.cached_block_ids() == [] and a.allocate("b", A) == 0
    a.mark_computed("a", 3, A)                          # chunked prefill: 3 of 10 written, no full block
    assert a.cached_block_ids() == [] and a.num_cached_blocks("a") == 0
    a.mark_computed("a", 5, A)                          # 5 of 10 tokens written
    assert a.cached_block_ids() == [0] and a.num_cached_blocks("a") == 1
    assert a.allocate("c", A) == 4
    a.mark_computed("a", 7, A)
    assert a.cached_block_ids() == [0] and a.allocate("d", A) == 4
    a.mark_computed("a", 10, A)
    assert a.cached_block_ids() == [0, 1] and a.allocate("e", A) == 8
    a.check_invariants(["a", "b", "c", "d", "e"])


def test_a_duplicate_block_computed_elsewhere_does_not_steal_the_entry():
    a = BlockAllocator(8, 4)
    a.allocate("a", A)
    a.allocate("b", A)                                  # before a's KV exists: no hit, own blocks
    a.mark_computed("a", 10, A)
    before = a.snapshot()
    a.mark_computed("b", 10, A)                         # same content: the first entry stays
    assert a.cached_block_ids() == [0, 1]
    assert a.snapshot()["entries"] == before["entries"] and a.snapshot()["cache"] == before["cache"]
    assert a.num_cached_blocks("b") == 2                # b's chain follows a's entries (its own blocks: not cached)
    assert a.allocate("c", A) == 8 and a.block_table("c")[:2] == [0, 1]


def test_hash_collisions_are_caught_by_the_stored_tokens(monkeypatch):
    patch_hash(monkeypatch, lambda parent, tokens: 0)   # every block collides
    a = BlockAllocator(8, 4)
    computed(a, "a", A)
    assert a.cached_block_ids() == [0]                  # a collision stops registration, never overwrites
    assert a.num_cached_blocks("a") == 1
    other = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert a.num_cached_prefix_tokens(other) == 0       # same hash, other tokens: a miss
    assert a.allocate("b", other) == 0 and a.block_table("b") == [3, 4, 5]
    assert a.allocate("c", A) == 4                      # the real match is still found
    a.check_invariants(["a", "b", "c"])


def test_a_collision_on_a_later_block_checks_its_parent(monkeypatch):
    # a hash that forgets the parent: block [20..23] after block X and after block Y look alike
    patch_hash(monkeypatch, lambda parent, tokens: hash(tokens))
    a = BlockAllocator(16, 4)
    computed(a, "a", A)                                 # X = [10..13], then [20..23]
    y = [40, 41, 42, 43]
    computed(a, "y", y + [1])                           # Y cached
    assert a.num_cached_prefix_tokens(y + A[4:]) == 4   # Y hits; [20..23] after Y is not A's block
    assert a.allocate("b", y + A[4:]) == 4
    assert a.block_table("b")[1] != a.block_table("a")[1]


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    a = BlockAllocator(6, 4)
    computed(a, "a", A)                                 # [0, 1, 2], cached 0, 1
    a.free("a")
    assert a.free_block_ids() == [3, 4, 5, 2, 1, 0]     # tail first: a's last block goes first
    assert a.cached_block_ids() == [0, 1] and a.num_free_blocks == 6
    b = [60 + i for i in range(10)]
    computed(a, "b", b)                                 # never-used blocks first: [3, 4, 5]
    a.free("b")
    assert a.free_block_ids() == [2, 1, 0, 5, 4, 3] and a.cached_block_ids() == [0, 1, 3, 4]
    a.allocate("c", [7] * 5)                            # 2 fresh blocks: 2 (not cached), then 1: evicted
    assert a.block_table("c") == [2, 1] and a.cached_block_ids() == [0, 3, 4]
    assert a.allocate("a2", A) == 4                     # a's first block survived, its second did not
    assert a.block_table("a2") == [0, 5, 4]             # 0 leaves the queue; 5, then 4 (evicts b's 2nd)
    assert a.cached_block_ids() == [0, 3]
    a.free("c")                                         # queue: [3, 1, 2]
    assert a.allocate("b2", b) == 4 and a.block_table("b2") == [3, 1, 2]
    a.check_invariants(["a2", "b2"])


def test_reusing_a_cached_free_block_takes_it_off_the_free_queue():
    a = BlockAllocator(3, 4)
    computed(a, "a", A[:5])                             # [0, 1], cached 0
    a.free("a")
    a.allocate("x", [1, 1])                             # 2
    a.allocate("y", [2])                                # 1
    a.free("x")
    assert a.free_block_ids() == [0, 2]                 # the cached block is at the front
    assert a.allocate("b", A[:4] + [9]) == 4            # it is taken as a hit, not evicted as "fresh"
    assert a.block_table("b") == [0, 2] and a.ref_counts() == [1, 1, 1] and a.num_free_blocks == 0
    a.check_invariants(["y", "b"])


def test_hits_make_room_where_fresh_blocks_would_not():
    a = BlockAllocator(4, 4)
    computed(a, "a", A)                                 # 3 blocks in use, 1 free
    assert a.can_allocate(A[:8] + [5])                  # 2 hits + 1 fresh
    assert not a.can_allocate([5] * 9)                  # 3 fresh
    with pytest.raises(NoFreeBlocksError):
        a.allocate("z", [5] * 9)
    assert a.allocate("b", A[:8] + [5]) == 8 and a.num_free_blocks == 0


def test_hit_and_query_counters():
    a = BlockAllocator(16, 4)
    computed(a, "a", A)
    assert (a.hits, a.queries) == (0, 2)                # 2 full blocks could have been reused
    a.allocate("b", A[:8] + [1])                        # 2 of 2
    a.allocate("c", A[:4] + [0] * 9)                    # 1 of 3
    assert (a.hits, a.queries) == (3, 7)
    a.num_cached_prefix_tokens(A)                       # looking does not count
    a.can_allocate(A)
    a.allocate("d", [1, 2])                             # no full block to look up
    assert (a.hits, a.queries) == (3, 7)
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError):
        a.allocate("e", A[:8] + [0] * 100)              # a failed allocate counts nothing
    assert a.snapshot() == before


def test_writing_into_a_cached_block_after_truncate_evicts_it_or_copies_it():
    a = BlockAllocator(8, 4)
    computed(a, "a", A)                                 # cached 0, 1
    a.truncate("a", 6)                                  # block 1 keeps 2 of its tokens
    assert a.cached_block_ids() == [0, 1]               # its KV is untouched so far
    assert a.append_slots("a", 2) == []                 # private: written in place, entry dropped
    assert a.cached_block_ids() == [0] and a.allocate("b", A) == 4
    a_tokens = A[:6] + [98, 99]
    a.mark_computed("a", 8, a_tokens)                   # the new content of block 1 is cached in its place
    assert a.cached_block_ids() == [0, 1] and a.num_cached_prefix_tokens(A) == 4
    assert a.num_cached_prefix_tokens(a_tokens + [0]) == 8

    computed(a, "c", [5] * 9)                           # a fresh pair of cached blocks
    c1 = a.block_table("c")[1]
    a.allocate("d", [5] * 9)                            # shares them
    a.truncate("c", 6)
    pairs = a.append_slots("c", 2)                      # shared: copy-on-write, the entry stays
    assert pairs == [(c1, a.block_table("c")[1])] and c1 in a.cached_block_ids()
    assert a.block_table("d")[1] == c1 and a.ref_count(c1) == 1
    assert a.num_cached_prefix_tokens([5] * 9) == 8     # d's blocks still serve the old prefix
    a.check_invariants(["a", "b", "c", "d"])


def test_fork_shares_cached_blocks_and_registers_once():
    a = BlockAllocator(8, 4)
    a.allocate("p", A)
    a.fork("p", "c")
    a.mark_computed("p", 10, A)
    before = a.snapshot()
    a.mark_computed("c", 10, A)
    assert a.cached_block_ids() == [0, 1] and a.ref_counts()[:3] == [2, 2, 2]
    assert a.snapshot()["entries"] == before["entries"]  # the child adds no entry of its own
    assert a.num_cached_blocks("p") == a.num_cached_blocks("c") == 2
    a.check_invariants(["p", "c"])


def test_reset_prefix_cache():
    a = BlockAllocator(8, 4)
    computed(a, "a", A)
    a.reset_prefix_cache()
    assert a.cached_block_ids() == [] and a.num_cached_blocks("a") == 0 and a.allocate("b", A) == 0
    a.check_invariants(["a", "b"])


def test_caching_off():
    a = BlockAllocator(8, 4, enable_prefix_caching=False)
    assert computed(a, "a", A) == 0
    assert a.cached_block_ids() == [] and a.num_cached_prefix_tokens(A) == 0 and a.num_cached_blocks("a") == 0
    assert a.allocate("b", A) == 0 and a.block_table("b") == [3, 4, 5]
    assert (a.hits, a.queries) == (0, 0)
    a.free("a")
    a.free("b")
    assert a.cached_block_ids() == []


def test_free_cached_hits_are_not_counted_twice():
    a = BlockAllocator(3, 4)
    computed(a, "a", A[:9])                             # [0, 1, 2], cached 0, 1
    a.free("a")
    a.allocate("x", [1])                                # takes block 2; queue [1, 0], both cached
    b = A[:8] + [5]                                     # 2 hits from the queue + 1 fresh: none left
    assert a.num_cached_prefix_tokens(b) == 8 and not a.can_allocate(b)
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError):
        a.allocate("b", b)
    assert a.snapshot() == before
    assert a.can_allocate(A[:5]) and a.allocate("c", A[:5]) == 4   # 1 hit + 1 fresh fits
    assert a.block_table("c") == [0, 1]                 # fresh = block 1, its stale entry evicted
    assert a.cached_block_ids() == [0]
