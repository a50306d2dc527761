"""Exercise 6, graded: the block allocator (exercises/ex6_block_allocator.py).

Hand-worked cases say exactly which block ids come out of the free queue, the ref counts, the copy-on-write
pairs and which blocks the prefix cache finds and evicts; failed calls must change nothing. A property test
runs random allocate / compute / append / fork / truncate / free sequences, as an engine calls them, against
the invariant checker, a plain-Python model of the pool (a queue of block ids and a table per sequence) and
a fake KV cache (a prefix-cache hit on the wrong block, or a shared block written in place, leaves a position
whose "KV" is not its token). Last, the engine generates with your allocator, and its greedy text must equal
generation without any cache (minibatch/sampling/reference.py).
"""
import sys
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import exercises
import minibatch.kv.block_allocator as ba
from minibatch.kv.block_allocator import NoFreeBlocksError, UnknownSequenceError

pytestmark = pytest.mark.ex6

A = [10, 11, 12, 13, 20, 21, 22, 23, 30, 31]        # 2 full blocks of 4 and 2 tokens


def Allocator(num_blocks, block_size=4, caching=True):
    return exercises.get("block_allocator")(num_blocks, block_size, caching)


def toks(n, start=100):
    return list(range(start, start + n))


def computed(a, sid, tokens):
    """Allocate and prefill in one go (the K/V of every token is then written)."""
    cached = a.allocate(sid, tokens)
    a.mark_computed(sid, len(tokens), tokens)
    return cached


# -- the free queue, allocate, append, free ------------------------------------------------------------
def test_a_fresh_pool_hands_out_blocks_in_id_order():
    a = Allocator(8, caching=False)
    assert a.allocate("a", toks(10)) == 0
    assert a.block_table("a") == [0, 1, 2] and a.num_slots("a") == 10
    assert a.allocate("b", toks(4, 500)) == 0 and a.block_table("b") == [3]
    assert a.ref_counts() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert a.free_block_ids() == [4, 5, 6, 7] and a.num_free_blocks == 4
    a.check_invariants(["a", "b"])


def test_append_takes_a_block_only_when_the_last_is_full():
    a = Allocator(8, caching=False)
    a.allocate("a", toks(6))                            # [0, 1], block 1 holds 2 tokens
    assert a.append_slots("a", 1) == [] and a.block_table("a") == [0, 1] and a.num_slots("a") == 7
    assert a.append_slots("a", 1) == [] and a.block_table("a") == [0, 1]      # 8 slots: exactly full
    assert a.append_slots("a", 1) == [] and a.block_table("a") == [0, 1, 2]   # the 9th needs a block
    assert a.append_slots("a", 5) == [] and a.block_table("a") == [0, 1, 2, 3]   # 1 + k drafts: 14 slots
    assert a.append_slots("a", 0) == [] and a.num_slots("a") == 14
    assert a.append_slots("a", 11) == [] and a.block_table("a") == [0, 1, 2, 3, 4, 5, 6]   # 3 at once
    assert a.num_slots("a") == 25 and a.ref_counts() == [1] * 7 + [0] and a.free_block_ids() == [7]
    a.check_invariants(["a"])


def test_free_returns_blocks_tail_first_to_the_back_of_the_queue():
    a = Allocator(6, caching=False)
    a.allocate("a", toks(9))                            # [0, 1, 2]
    a.allocate("b", toks(2, 500))                       # [3]
    a.free("a")
    assert a.free_block_ids() == [4, 5, 2, 1, 0] and a.ref_counts() == [0, 0, 0, 1, 0, 0]
    assert not a.has_seq("a") and a.num_free_blocks == 5
    a.allocate("c", toks(9, 900))                       # from the front: never-used blocks first
    assert a.block_table("c") == [4, 5, 2]
    a.free("b")
    assert a.free_block_ids() == [1, 0, 3]
    a.allocate("d", toks(12, 50))
    assert a.block_table("d") == [1, 0, 3] and a.num_free_blocks == 0
    a.check_invariants(["c", "d"])
    with pytest.raises(UnknownSequenceError):
        a.free("a")                                     # freed already


def test_truncate_gives_back_blocks_through_release():
    a = Allocator(8, caching=False)
    a.allocate("a", toks(6))
    a.append_slots("a", 5)                              # 11 slots: [0, 1, 2]
    a.truncate("a", 7)                                  # rejected drafts go: block 2 back, at the end
    assert a.block_table("a") == [0, 1] and a.ref_counts()[:3] == [1, 1, 0]
    assert a.free_block_ids() == [3, 4, 5, 6, 7, 2]
    a.truncate("a", 1)
    assert a.block_table("a") == [0] and a.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    assert a.append_slots("a", 4) == [] and a.block_table("a") == [0, 3]
    a.check_invariants(["a"])


def test_running_out_of_blocks_raises_and_changes_nothing():
    a = Allocator(4, caching=False)
    a.allocate("a", toks(9))                            # 3 of 4 blocks
    before = a.snapshot()
    assert not a.can_allocate(toks(8, 7))
    with pytest.raises(NoFreeBlocksError):              # 2 blocks needed, 1 free
        a.allocate("b", toks(8, 7))
    assert a.snapshot() == before and not a.has_seq("b")
    with pytest.raises(NoFreeBlocksError):              # 12 slots -> 4 + 1 blocks, 1 free
        a.append_slots("a", 8)
    assert a.snapshot() == before
    assert a.append_slots("a", 7) == [] and a.block_table("a") == [0, 1, 2, 3]   # exactly what is left
    with pytest.raises(NoFreeBlocksError):
        a.allocate("c", [1])
    with pytest.raises(NoFreeBlocksError):
        a.append_slots("a", 1)
    a.check_invariants(["a"])
    with pytest.raises(ValueError):                     # an id that exists
        a.allocate("a", [1])


# -- fork and copy-on-write -------------------------------------------------------------------------
def test_fork_shares_every_block_and_copies_the_partly_filled_one_on_write():
    a = Allocator(8)
    p = toks(6)
    a.allocate("p", p)                                  # [0, 1]; block 1 partly filled
    a.fork("p", "c")
    assert a.block_table("c") == [0, 1] and a.ref_counts()[:3] == [2, 2, 0] and a.num_slots("c") == 6
    assert a.num_free_blocks == 6
    assert a.append_slots("c", 1) == [(1, 2)]           # block 1 is shared: the child writes into a copy
    assert a.block_table("c") == [0, 2] and a.block_table("p") == [0, 1]
    assert a.ref_counts()[:3] == [2, 1, 1]
    assert a.append_slots("p", 1) == []                 # block 1 is the parent's alone now: in place
    assert a.block_table("p") == [0, 1] and a.num_slots("p") == a.num_slots("c") == 7
    a.check_invariants(["p", "c"])


def test_fork_on_full_blocks_needs_no_copy_and_three_way_forks_copy_twice():
    a = Allocator(8)
    a.allocate("p", toks(8))
    a.fork("p", "c")
    assert a.append_slots("c", 1) == [] and a.block_table("c") == [0, 1, 2]
    assert a.append_slots("p", 1) == [] and a.block_table("p") == [0, 1, 3]
    assert a.ref_counts()[:4] == [2, 2, 1, 1]
    b = Allocator(8)
    b.allocate("p", toks(3))
    b.fork("p", "c1")
    b.fork("p", "c2")
    assert b.ref_count(0) == 3
    assert b.append_slots("c1", 1) == [(0, 1)]
    assert b.append_slots("p", 1) == [(0, 2)]
    assert b.append_slots("c2", 1) == []                # the last holder writes in place
    assert [b.block_table(s) for s in ("p", "c1", "c2")] == [[2], [1], [0]] and b.ref_counts()[:3] == [1, 1, 1]
    b.check_invariants(["p", "c1", "c2"])


def test_fork_onto_a_live_sequence_raises_and_changes_nothing():
    a = Allocator(8)
    a.allocate("p", toks(6))
    a.allocate("c", toks(5, 500))
    before = a.snapshot()
    with pytest.raises(ValueError):
        a.fork("p", "c")                                # "c" still holds blocks: replacing its table leaks them
    assert a.snapshot() == before and a.block_table("c") == [2, 3]
    with pytest.raises(UnknownSequenceError):
        a.fork("nobody", "d")
    assert a.snapshot() == before
    a.check_invariants(["p", "c"])


def test_zero_new_tokens_copy_nothing_even_on_a_shared_partly_filled_block():
    a = Allocator(8)
    a.allocate("p", toks(6))                            # [0, 1]; block 1 holds 2 tokens
    a.fork("p", "c")
    before = a.snapshot()
    assert a.append_slots("c", 0) == []                 # nothing is written: nothing to copy
    assert a.snapshot() == before and a.block_table("c") == [0, 1] and a.num_free_blocks == 6
    assert a.append_slots("c", 1) == [(1, 2)]           # the first real write copies


def test_free_after_fork_keeps_the_shared_blocks():
    a = Allocator(4)
    a.allocate("p", toks(6))
    a.fork("p", "c")
    a.free("p")
    assert a.ref_counts() == [1, 1, 0, 0] and a.free_block_ids() == [2, 3]
    assert a.block_table("c") == [0, 1]
    a.free("c")
    assert a.ref_counts() == [0] * 4 and a.free_block_ids() == [2, 3, 1, 0]
    a.check_invariants([])


def test_copy_on_write_with_no_free_block_changes_nothing():
    a = Allocator(3, caching=False)
    a.allocate("a", toks(7))                            # [0, 1]
    a.fork("a", "b")
    a.allocate("c", toks(1, 50))                        # [2]: the pool is full
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError):
        a.append_slots("a", 1)                          # needs a copy of shared block 1
    assert a.snapshot() == before
    a.free("c")
    assert a.append_slots("a", 1) == [(1, 2)] and a.ref_counts() == [2, 1, 1]
    a.check_invariants(["a", "b"])


# -- the prefix cache --------------------------------------------------------------------------------
def test_a_shared_prefix_reuses_the_same_physical_blocks():
    a = Allocator(12)
    assert computed(a, "a", A) == 0
    assert a.block_table("a") == [0, 1, 2] and a.cached_block_ids() == [0, 1]
    b = A[:8] + [50, 51, 52]
    assert a.allocate("b", b) == 8                      # K/V of tokens 0..7 is already there
    assert a.block_table("b") == [0, 1, 3] and a.ref_counts()[:4] == [2, 2, 1, 1] and a.num_cached_blocks("b") == 2
    assert a.allocate("c", A[:4] + [99] * 6) == 4 and a.block_table("c") == [0, 4, 5]
    assert a.allocate("d", [0, 0, 0, 0] + A[4:]) == 0   # block 1 has A's tokens after another block 0
    assert a.block_table("d") == [6, 7, 8] and a.ref_count(1) == 2
    assert (a.hits, a.queries) == (3, 2 + 2 + 2 + 2)
    a.check_invariants(["a", "b", "c", "d"])


def test_the_last_token_is_always_computed_and_partial_blocks_are_never_cached():
    a = Allocator(8)
    computed(a, "a", A[:8])                             # two full blocks
    assert a.cached_block_ids() == [0, 1]
    assert a.allocate("b", A[:8]) == 4                  # not 8: the last token must make logits
    assert a.block_table("b") == [0, 2]
    assert a.allocate("c", A[:9]) == 8 and a.block_table("c") == [0, 1, 3]
    x = Allocator(8)
    computed(x, "a", A)
    assert x.cached_block_ids() == [0, 1]               # block 2 holds 2 of 4 tokens: not an entry
    assert x.allocate("b", A + [32, 33, 7]) == 8


def test_blocks_not_yet_computed_are_not_shared():
    a = Allocator(16)
    a.allocate("a", A)                                  # blocks given out, K/V not written yet
    assert a.cached_block_ids() == [] and a.allocate("b", A) == 0
    a.mark_computed("a", 3, A)                          # chunked prefill: no full block written
    assert a.cached_block_ids() == [] and a.allocate("c", A) == 0
    a.mark_computed("a", 5, A)
    assert a.cached_block_ids() == [0] and a.allocate("d", A) == 4
    a.mark_computed("a", 10, A)
    assert a.cached_block_ids() == [0, 1] and a.allocate("e", A) == 8
    assert a.num_cached_blocks("a") == 2
    a.check_invariants(["a", "b", "c", "d", "e"])


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    a = Allocator(6)
    computed(a, "a", A)                                 # [0, 1, 2], cached 0, 1
    a.free("a")
    assert a.free_block_ids() == [3, 4, 5, 2, 1, 0] and a.cached_block_ids() == [0, 1]
    b = [60 + i for i in range(10)]
    computed(a, "b", b)                                 # never-used blocks first: [3, 4, 5]
    a.free("b")
    assert a.free_block_ids() == [2, 1, 0, 5, 4, 3] and a.cached_block_ids() == [0, 1, 3, 4]
    a.allocate("c", [7] * 5)                            # 2 fresh blocks: 2 (no entry), then 1 (evicted)
    assert a.block_table("c") == [2, 1] and a.cached_block_ids() == [0, 3, 4]
    assert a.allocate("a2", A) == 4                     # a's first block survived, its second did not
    assert a.block_table("a2") == [0, 5, 4] and a.cached_block_ids() == [0, 3]
    a.free("c")
    assert a.allocate("b2", b) == 4 and a.block_table("b2") == [3, 1, 2]
    a.check_invariants(["a2", "b2"])


def test_a_hit_on_a_free_block_takes_it_off_the_queue_and_makes_room():
    a = Allocator(3)
    computed(a, "a", A[:5])                             # [0, 1], cached 0
    a.free("a")
    a.allocate("x", [1, 1])                             # 2
    a.allocate("y", [2])                                # 1
    a.free("x")
    assert a.free_block_ids() == [0, 2]                 # the cached block is at the front
    assert a.can_allocate(A[:4] + [9]) and not a.can_allocate([9] * 9)
    assert a.allocate("b", A[:4] + [9]) == 4            # taken as a hit, not evicted as a fresh block
    assert a.block_table("b") == [0, 2] and a.ref_counts() == [1, 1, 1] and a.num_free_blocks == 0
    a.check_invariants(["y", "b"])
    c = Allocator(3)
    computed(c, "a", A[:9])                             # [0, 1, 2], cached 0, 1
    c.free("a")
    c.allocate("x", [1])                                # block 2; queue [1, 0], both cached
    before = c.snapshot()
    with pytest.raises(NoFreeBlocksError):              # 2 hits from the queue + 1 fresh: none left
        c.allocate("b", A[:8] + [5])
    assert c.snapshot() == before


def test_free_hits_leave_the_queue_too_when_counting_what_is_free():
    a = Allocator(5)
    computed(a, "a", A)                                 # [0, 1, 2], cached 0, 1
    a.allocate("x", [7] * 8)                            # [3, 4]
    a.free("a")                                         # queue [2, 1, 0]
    b = A[:8] + [1] * 9                                 # 5 blocks: 2 hits (both in the queue) + 3 fresh
    assert not a.can_allocate(b)
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError):              # 3 queue blocks, but 2 of them are the hits
        a.allocate("b", b)
    assert a.snapshot() == before
    assert a.allocate("b2", A[:8] + [1]) == 8 and a.block_table("b2") == [0, 1, 2] and a.num_free_blocks == 0
    a.check_invariants(["x", "b2"])


def _patch_hash(monkeypatch, fn):
    """Replace hash_block_tokens where the allocator under test reads it (its module, and minibatch's)."""
    for m in {ba, sys.modules[exercises.get("block_allocator").__module__]}:
        if hasattr(m, "hash_block_tokens"):
            monkeypatch.setattr(m, "hash_block_tokens", fn)


def test_a_hash_collision_is_a_miss(monkeypatch):
    _patch_hash(monkeypatch, lambda parent, tokens: 0)  # every block collides
    a = Allocator(8)
    computed(a, "a", A)
    assert a.cached_block_ids() == [0]                  # a collision stops registration, never overwrites
    assert a.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0   # same hash, other tokens: a miss
    assert a.block_table("b") == [3, 4, 5]
    assert a.allocate("c", A) == 4                      # the real match is still found
    a.check_invariants(["a", "b", "c"])


def test_a_hit_must_follow_the_same_parent(monkeypatch):
    _patch_hash(monkeypatch, lambda parent, tokens: hash(tokens))   # a hash that forgets the parent
    a = Allocator(16)
    computed(a, "a", A)                                 # X = [10..13], then [20..23]
    y = [40, 41, 42, 43]
    computed(a, "y", y + [1])
    assert a.allocate("b", y + A[4:]) == 4              # Y hits; [20..23] after Y is not A's block
    assert a.block_table("b")[1] != a.block_table("a")[1]


def test_writing_into_a_cached_block_after_truncate_evicts_it_or_copies_it():
    a = Allocator(8)
    computed(a, "a", A)                                 # cached 0, 1
    a.truncate("a", 6)                                  # block 1 keeps 2 of its tokens
    assert a.append_slots("a", 2) == []                 # private: written in place, its entry dropped
    assert a.cached_block_ids() == [0] and a.allocate("b", A) == 4
    computed(a, "c", [5] * 9)
    c1 = a.block_table("c")[1]
    a.allocate("d", [5] * 9)                            # shares c's two cached blocks
    a.truncate("c", 6)
    pairs = a.append_slots("c", 2)                      # shared: copy-on-write, the entry stays
    assert pairs == [(c1, a.block_table("c")[1])] and c1 in a.cached_block_ids()
    assert a.block_table("d")[1] == c1 and a.ref_count(c1) == 1
    a.check_invariants(["a", "b", "c", "d"])


def test_fork_shares_cached_blocks_and_registers_them_once():
    a = Allocator(8)
    a.allocate("p", A)
    a.fork("p", "c")
    a.mark_computed("p", 10, A)
    before = a.snapshot()
    a.mark_computed("c", 10, A)
    assert a.cached_block_ids() == [0, 1] and a.ref_counts()[:3] == [2, 2, 2]
    assert a.snapshot()["entries"] == before["entries"]
    assert a.num_cached_blocks("p") == a.num_cached_blocks("c") == 2
    a.check_invariants(["p", "c"])


def test_hit_and_query_counters():
    a = Allocator(16)
    computed(a, "a", A)
    assert (a.hits, a.queries) == (0, 2)                # 2 full blocks could have been reused
    a.allocate("b", A[:8] + [1])                        # 2 of 2
    a.allocate("c", A[:4] + [0] * 9)                    # 1 of 3
    assert (a.hits, a.queries) == (3, 7)
    a.num_cached_prefix_tokens(A)                       # looking counts nothing
    a.can_allocate(A)
    a.allocate("d", [1, 2])
    assert (a.hits, a.queries) == (3, 7)
    a.allocate("e", A[:8])                              # 8 tokens: 1 block could be found, not 2 (the last
    assert (a.hits, a.queries) == (4, 8)                # token's block is never looked up)
    off = Allocator(8, caching=False)
    computed(off, "a", A)
    assert off.allocate("b", A) == 0 and (off.hits, off.queries) == (0, 0) and off.cached_block_ids() == []


# -- a property test: random operations against a model of the pool -----------------------------------
BS, NB = 4, 12


class PoolModel:
    """The pool as plain Python: each sequence's block table (as the allocator reported it), ref counts as
    the number of tables holding a block, and, with prefix caching off, the exact free queue (a list: taken
    from the front, freed blocks appended tail first)."""

    def __init__(self, caching):
        self.caching, self.tables, self.queue = caching, {}, list(range(NB))

    def refs(self):
        c = Counter(b for t in self.tables.values() for b in t)
        return [c[b] for b in range(NB)]

    def release(self, blocks):
        for b in reversed(blocks):
            if self.refs()[b] == 0:
                self.queue.append(b)

    def take(self, n):
        got, self.queue = self.queue[:n], self.queue[n:]
        return got


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / compute / append / fork / truncate / free, as an engine calls them. Next to the
    allocator: the model of the pool, each sequence's tokens and computed count (the engine's ``Sequence``),
    and a fake KV cache ``kv[block][offset] = token`` written only where the engine would write."""
    caching = True

    @initialize()
    def setup(self):
        self.a = Allocator(NB, BS, self.caching)
        self.m = PoolModel(self.caching)
        self.tokens, self.computed = {}, {}
        self.kv, self.next_id = [[None] * BS for _ in range(NB)], 0

    def _compute(self, sid, upto):
        table = self.a.block_table(sid)
        for p in range(self.computed[sid], upto):
            b = table[p // BS]
            assert self.a.ref_count(b) == 1, f"{sid} writes position {p} into block {b}, which is shared"
            assert b not in self.a.cached_block_ids(), f"{sid} writes into block {b}, which the cache lists"
            self.kv[b][p % BS] = self.tokens[sid][p]
        self.computed[sid] = max(self.computed[sid], upto)
        self.a.mark_computed(sid, upto, self.tokens[sid])

    def _try(self, fn):
        before = self.a.snapshot()
        try:
            return fn()
        except NoFreeBlocksError:
            assert self.a.snapshot() == before, "a failed call changed the allocator"
            raise

    seqs = property(lambda self: sorted(self.tokens))

    def _done(self):
        return [s for s in self.seqs if self.computed[s] == len(self.tokens[s])]

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=20), chunk=st.integers(0, 20))
    def allocate(self, tokens, chunk):
        sid = f"s{self.next_id}"
        self.next_id += 1
        need, free = -(-len(tokens) // BS), len(self.m.queue)
        counters = self.a.hits, self.a.queries
        try:
            cached = self._try(lambda: self.a.allocate(sid, tokens))
        except NoFreeBlocksError:
            assert self.caching or need > free, f"allocate({len(tokens)} tokens) refused with {free} blocks free"
            assert (self.a.hits, self.a.queries) == counters, "a refused allocate counted queries or hits"
            return
        looked = (len(tokens) - 1) // BS if self.caching else 0     # whole blocks, the last token's left out
        assert (self.a.hits - counters[0], self.a.queries - counters[1]) == (cached // BS, looked), \
            f"allocate({len(tokens)} tokens) counted hits, queries {self.a.hits - counters[0]}, " \
            f"{self.a.queries - counters[1]}; want {cached // BS}, {looked}"
        assert self.caching or need <= free, f"allocate({len(tokens)} tokens) took {need} blocks, {free} were free"
        assert cached % BS == 0 and cached <= len(tokens) - 1
        table = self.a.block_table(sid)
        assert len(table) == need and len(set(table)) == need
        fresh = table[cached // BS:]
        if not self.caching:
            assert cached == 0 and fresh == self.m.take(need), "fresh blocks come from the front of the queue"
        else:
            assert all(self.m.refs()[b] == 0 for b in fresh), "a fresh block was still in use"
            for b in table:
                if b in self.m.queue:
                    self.m.queue.remove(b)
        self.m.tables[sid] = list(table)
        self.tokens[sid], self.computed[sid] = list(tokens), cached
        self._compute(sid, min(len(tokens), cached + chunk))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute_more(self, data):                               # a later prefill chunk
        sid = data.draw(st.sampled_from(self.seqs))
        self._compute(sid, data.draw(st.integers(self.computed[sid], len(self.tokens[sid]))))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def append(self, data, new):                                # decode, or verify 1 + k
        done = self._done()
        if not done:
            return
        sid = data.draw(st.sampled_from(done))
        old = self.a.block_table(sid)
        n_old = len(self.tokens[sid])
        grow = -(-(n_old + len(new)) // BS) - len(old)
        cow = n_old % BS != 0 and self.m.refs()[old[-1]] > 1
        try:
            pairs = self._try(lambda: self.a.append_slots(sid, len(new)))
        except NoFreeBlocksError:
            assert grow + cow > len(self.m.queue), f"append_slots refused with {len(self.m.queue)} blocks free"
            return
        assert grow + cow <= len(self.m.queue), f"append_slots needed {grow + cow} blocks, {len(self.m.queue)} free"
        table = self.a.block_table(sid)
        assert len(pairs) == cow, f"copy-on-write pairs {pairs}: the last block {old[-1]} is " + \
            ("shared" if cow else "not shared, or full")
        keep = len(old) - cow
        assert table[:keep] == old[:keep] and len(table) == len(old) + grow
        if not self.caching:
            want = self.m.take(grow + cow)
            assert table[keep:] == want, f"new blocks {table[keep:]}, the front of the queue was {want}"
        for src, dst in pairs:                                  # the engine copies before it writes
            assert src == old[-1] and dst == table[len(old) - 1] and src != dst
            self.kv[dst] = list(self.kv[src])
        for b in table:
            if b in self.m.queue:
                self.m.queue.remove(b)
        self.m.tables[sid] = list(table)
        self.m.release([old[-1]] if cow else [])
        self.tokens[sid] += new
        self._compute(sid, len(self.tokens[sid]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):                                       # parallel sampling: after the prompt
        done = self._done()
        if not done:
            return
        parent, child = data.draw(st.sampled_from(done)), f"s{self.next_id}"
        self.next_id += 1
        self.a.fork(parent, child)
        self.m.tables[child] = list(self.m.tables[parent])
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]
        assert self.a.block_table(child) == self.a.block_table(parent)

    @precondition(lambda self: len(self.tokens) >= 2)
    @rule(data=st.data())
    def fork_onto_a_live_sequence(self, data):                  # must raise and change nothing
        parent, child = data.draw(st.permutations(self.seqs))[:2]
        before = self.a.snapshot()
        with pytest.raises(ValueError):
            self.a.fork(parent, child)
        assert self.a.snapshot() == before, f"fork({parent!r}, {child!r}) onto a live sequence changed the pool"

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append_nothing(self, data):                             # a step that writes no token: no copy, no block
        sid = data.draw(st.sampled_from(self.seqs))
        before = self.a.snapshot()
        assert self.a.append_slots(sid, 0) == [], f"append_slots({sid!r}, 0) returned copy-on-write pairs"
        assert self.a.snapshot() == before, f"append_slots({sid!r}, 0) changed the pool"

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(self.seqs))
        n = data.draw(st.integers(0, len(self.tokens[sid])))
        self.a.truncate(sid, n)
        gone = self.m.tables[sid][-(-n // BS):]
        self.m.tables[sid] = self.m.tables[sid][:-(-n // BS)]
        self.m.release(gone)
        del self.tokens[sid][n:]
        self.computed[sid] = min(self.computed[sid], n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(self.seqs))
        self.a.free(sid)
        self.m.release(self.m.tables.pop(sid))
        del self.tokens[sid], self.computed[sid]

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        self.a.check_invariants(self.tokens)
        assert self.a.ref_counts() == self.m.refs(), \
            f"ref counts {self.a.ref_counts()}, the block tables hold {self.m.refs()}"
        if self.caching:
            assert sorted(self.a.free_block_ids()) == sorted(self.m.queue)
        else:
            assert self.a.free_block_ids() == self.m.queue, \
                f"free queue {self.a.free_block_ids()}, want {self.m.queue} (freed blocks go to the back, tail first)"
        entries = self.a.snapshot()["entries"]
        for b, e in entries.items():                            # the cache describes what the block holds
            assert self.kv[b] == list(e.tokens), f"block {b} holds {self.kv[b]}, its cache entry says {e.tokens}"
        for sid, t in self.tokens.items():
            assert self.a.block_table(sid) == self.m.tables[sid] and self.a.num_slots(sid) == len(t)
            table = self.a.block_table(sid)
            held = [self.kv[table[p // BS]][p % BS] for p in range(self.computed[sid])]
            assert held == t[:len(held)], f"{sid}: the cache holds {held} for its tokens {t}"


class AllocatorMachineNoCache(AllocatorMachine):
    caching = False


# Derandomized: every run (and every student) gets the same examples, so a grade never depends on luck. No
# shrinking: it can take minutes on a wrong allocator (past the grader's per-test limit); the failing run is
# printed as it was found (a few dozen steps: read it from the end).
_settings = settings(max_examples=40, stateful_step_count=30, deadline=None, derandomize=True, database=None,
                     phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])


def test_random_operations_with_prefix_caching():
    run_state_machine_as_test(AllocatorMachine, settings=_settings)


def test_random_operations_without_prefix_caching():
    run_state_machine_as_test(AllocatorMachineNoCache, settings=_settings)


# -- the engine on your allocator ------------------------------------------------------------------------
def slots(block_tables, starts, counts, block_size, device="cpu"):
    """The engine's slot mapping (exercise 1's formula), here so that this part needs no other part of yours."""
    return torch.tensor([t[p // block_size] * block_size + p % block_size for t, s, n in zip(block_tables, starts, counts)
                         for p in range(s, s + n)], dtype=torch.int64).to(device)


def _engine_outputs(model, prompts, params, **cfg):
    """LLM on the allocator under test, with a toy scheduler (below) so that this part needs only yours."""
    import minibatch.engine.engine as engine
    import minibatch.kv.metadata as attention
    from minibatch import LLM
    saved = engine.BlockAllocator, engine.Scheduler, attention._slot_mapping
    engine.BlockAllocator, engine.Scheduler = exercises.get("block_allocator"), _one_at_a_time()
    attention._slot_mapping = slots
    try:
        llm = LLM(model, **cfg)
        outs = llm.generate(prompts, params, use_tqdm=False)
        a = llm.llm_engine.allocator
    finally:
        engine.BlockAllocator, engine.Scheduler, attention._slot_mapping = saved
    a.check_invariants([])
    assert a.num_free_blocks == a.num_blocks, "blocks leaked after every request finished"
    return outs, a


def _one_at_a_time():
    """A toy scheduler, far simpler than exercise 7's: one request at a time (with its forks), the whole prompt
    in one step, then one decode step per token; it never preempts (the pools here are big enough)."""
    from minibatch.engine.scheduler import ScheduledSeq, SchedulerBase

    class OneAtATime(SchedulerBase):
        def _fill(self, out):
            if not self.running:
                seq = self.waiting.peek()
                self._start(seq, out)
                out.scheduled.append(ScheduledSeq(seq, seq.num_uncomputed_tokens, seq.num_computed_tokens, seq.phase))
                return
            for seq in list(self.running):
                out.cow_copies += self.allocator.append_slots(seq.seq_id, 1)
                out.scheduled.append(ScheduledSeq(seq, 1, seq.num_computed_tokens, seq.phase))
    return OneAtATime


PREAMBLE = "import os\nimport sys\n\n# shared header for prefix caching\n"    # 58 bytes: 3 full blocks of 16


def test_the_engine_generates_the_same_text_on_your_allocator(target_model):
    """Prefix-cache hits on freed blocks (the shared header), forks (n = 2: copy-on-write of the last prompt
    block) and a pool small enough to evict cached blocks. (Greedy, the "batched" attention, no speculation:
    nothing here needs another exercise of yours.)"""
    from minibatch import SamplingParams
    from minibatch.sampling.reference import generate
    from minibatch.model.tokenizer import encode
    prompts = [PREAMBLE + "def main():\n", "class Stack:\n    def push(self", PREAMBLE + "for i in range(",
               PREAMBLE + "def main():\n", "    def __init__(self"]
    lengths = [20, 16, 12, 18, 14]
    params = [SamplingParams(temperature=0, max_tokens=m, n=2 if i == 1 else 1) for i, m in enumerate(lengths)]
    want = [generate(target_model, encode(p), SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(prompts, lengths)]
    outs, a = _engine_outputs(target_model, prompts, params, block_size=16, num_gpu_blocks=10)
    for o, w in zip(outs, want):
        for c in o.outputs:
            assert c.token_ids == w, f"request {o.request_id}: the engine's text differs from generation without a cache"
    assert a.hits >= 6, f"the shared header's blocks were found {a.hits} times in the prefix cache, want >= 6"
