"""BlockAllocator: exact block ids and ref counts per operation, copy-on-write, failures that change
nothing, and a stateful property test that also simulates the KV contents the blocks would hold.

The allocator owns blocks only: it takes counts (``append_slots(seq, n)``), and the tokens only where it
hashes them (``allocate``, ``mark_computed``). So the tests keep each sequence's tokens themselves, as the
engine's ``Sequence`` does, and pass them in."""
import re

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minibatch.kv.block_allocator import BlockAllocator, NoFreeBlocksError, UnknownSequenceError


def toks(n, start=100):
    return list(range(start, start + n))


# -- construction ------------------------------------------------------------------
@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (-1, 16), (8, 0), (8, 3), (8, 12), (8, -4)])
def test_bad_geometry_is_a_value_error(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks, block_size)


def test_non_int_geometry_is_a_type_error():
    with pytest.raises(TypeError):
        BlockAllocator(8.0, 16)


def test_fresh_pool():
    a = BlockAllocator(5, 4)
    assert (a.num_blocks, a.block_size, a.enable_prefix_caching) == (5, 4, True)
    assert a.num_free_blocks == 5 and a.ref_counts() == [0] * 5 and a.free_block_ids() == [0, 1, 2, 3, 4]
    assert [a.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    a.check_invariants([])


# -- allocate / append / free --------------------------------------------------------------
def test_allocate_takes_blocks_in_free_queue_order():
    a = BlockAllocator(8, 4)
    assert a.allocate("a", toks(10)) == 0                 # nothing cached yet
    assert a.block_table("a") == [0, 1, 2] and a.num_slots("a") == 10 and a.num_cached_blocks("a") == 0
    assert a.allocate("b", toks(4, 500)) == 0
    assert a.block_table("b") == [3]
    assert a.ref_counts() == [1, 1, 1, 1, 0, 0, 0, 0] and a.num_free_blocks == 4
    assert a.has_seq("a") and not a.has_seq("c")
    a.check_invariants(["a", "b"])


def test_block_table_and_other_readings_are_copies():
    a = BlockAllocator(4, 4)
    a.allocate("a", toks(5))
    before = a.snapshot()
    a.block_table("a").append(3)
    a.ref_counts()[2] = 1
    a.free_block_ids().remove(2)
    a.snapshot()["seqs"]["a"][0].append(3)
    assert a.block_table("a") == [0, 1] and a.num_slots("a") == 5
    assert a.snapshot() == before
    a.check_invariants(["a"])


def test_append_takes_a_block_only_when_the_last_is_full():
    a = BlockAllocator(8, 4)
    a.allocate("a", toks(6))                            # blocks [0, 1], block 1 holds 2 tokens
    assert a.append_slots("a", 1) == [] and a.block_table("a") == [0, 1] and a.num_slots("a") == 7
    assert a.append_slots("a", 1) == [] and a.block_table("a") == [0, 1]     # 8 slots: exactly full
    assert a.append_slots("a", 1) == [] and a.block_table("a") == [0, 1, 2]
    assert a.append_slots("a", 5) == []                 # speculative 1 + k: crosses into a 4th block
    assert a.block_table("a") == [0, 1, 2, 3] and a.num_slots("a") == 14
    assert a.ref_counts() == [1, 1, 1, 1, 0, 0, 0, 0] and a.free_block_ids() == [4, 5, 6, 7]
    assert a.append_slots("a", 0) == [] and a.num_slots("a") == 14 and a.block_table("a") == [0, 1, 2, 3]
    assert a.append_slots("a", 2) == [] and a.block_table("a") == [0, 1, 2, 3]   # fills the 4th exactly
    assert a.append_slots("a", 9) == [] and a.block_table("a") == [0, 1, 2, 3, 4, 5, 6]   # 3 at once
    assert a.num_slots("a") == 25 and a.num_free_blocks == 1
    a.check_invariants(["a"])


@pytest.mark.parametrize("bad, err, msg", [(-1, ValueError, "num_new_tokens must be >= 0, got -1"),
                                           ([1, 2], TypeError, "num_new_tokens must be an int, got list"),
                                           ((7,), TypeError, "num_new_tokens must be an int, got tuple"),
                                           (1.0, TypeError, "num_new_tokens must be an int, got float"),
                                           (True, TypeError, "num_new_tokens must be an int, got bool")])
def test_append_slots_takes_a_non_negative_int_count(bad, err, msg):
    a = BlockAllocator(4, 4)
    a.allocate("a", toks(6))
    before = a.snapshot()
    with pytest.raises(err, match=re.escape(msg)):
        a.append_slots("a", bad)
    assert a.snapshot() == before


def test_free_returns_blocks_tail_first_to_the_back_of_the_queue():
    a = BlockAllocator(6, 4)
    a.allocate("a", toks(9))                            # [0, 1, 2]
    a.allocate("b", toks(2, 500))                       # [3]
    a.free("a")
    assert a.free_block_ids() == [4, 5, 2, 1, 0] and a.ref_counts() == [0, 0, 0, 1, 0, 0]
    a.allocate("c", toks(9, 900))                       # no cache hit: takes from the front
    assert a.block_table("c") == [4, 5, 2]
    a.check_invariants(["b", "c"])


def test_free_unknown_or_twice_is_a_key_error():
    a = BlockAllocator(4, 4)
    a.allocate("a", toks(3))
    a.free("a")
    for call in (lambda: a.free("a"), lambda: a.free("zz"), lambda: a.block_table("a"),
                 lambda: a.append_slots("a", 1), lambda: a.truncate("a", 1), lambda: a.fork("a", "b"),
                 lambda: a.num_slots("a"), lambda: a.num_cached_blocks("a"),
                 lambda: a.mark_computed("a", 0, toks(3))):
        with pytest.raises(UnknownSequenceError, match="unknown sequence") as e:
            call()
        assert isinstance(e.value, KeyError)
    assert a.num_free_blocks == 4


# -- fork and copy-on-write -----------------------------------------------------------------
def test_fork_shares_every_block_and_copy_on_write_on_the_partial_one():
    a = BlockAllocator(8, 4)
    p = toks(6)
    a.allocate("p", p)                                  # [0, 1]; block 1 partly filled
    a.mark_computed("p", 6, p)                          # block 0 cached
    a.fork("p", "c")
    c = list(p)                                         # the child's tokens: a copy of the parent's
    assert a.block_table("c") == [0, 1] and a.ref_counts()[:2] == [2, 2]
    assert a.num_slots("c") == 6 and a.num_cached_blocks("c") == 1
    assert a.append_slots("c", 1) == [(1, 2)]           # block 1 is shared: the child writes a copy
    assert a.block_table("c") == [0, 2] and a.block_table("p") == [0, 1]
    assert a.ref_counts()[:3] == [2, 1, 1]
    assert a.append_slots("p", 1) == []                 # block 1 is the parent's alone now: in place
    assert a.block_table("p") == [0, 1] and a.num_slots("p") == a.num_slots("c") == 7
    a.check_invariants(["p", "c"])
    # the two now differ in their second block; each one's computed block is cached under its own tokens
    p += [8, 9]
    c += [7, 9]
    a.append_slots("p", 1)
    a.append_slots("c", 1)
    a.mark_computed("p", 8, p)
    a.mark_computed("c", 8, c)
    assert a.cached_block_ids() == [0, 1, 2]
    assert a.allocate("p2", p + [0]) == 8 and a.block_table("p2")[:2] == [0, 1]
    assert a.allocate("c2", c + [0]) == 8 and a.block_table("c2")[:2] == [0, 2]
    a.check_invariants(["p", "c", "p2", "c2"])


def test_fork_on_a_full_block_needs_no_copy():
    a = BlockAllocator(8, 4)
    a.allocate("p", toks(8))
    a.fork("p", "c")
    assert a.append_slots("c", 1) == [] and a.block_table("c") == [0, 1, 2]
    assert a.append_slots("p", 1) == [] and a.block_table("p") == [0, 1, 3]
    assert a.ref_counts()[:4] == [2, 2, 1, 1]


def test_three_way_fork_copies_for_two_of_them():
    a = BlockAllocator(8, 4)
    a.allocate("p", toks(3))
    a.fork("p", "c1")
    a.fork("p", "c2")
    assert a.ref_count(0) == 3
    assert a.append_slots("c1", 1) == [(0, 1)]
    assert a.append_slots("p", 1) == [(0, 2)]
    assert a.append_slots("c2", 1) == []                # the last holder writes in place
    assert [a.block_table(s) for s in ("p", "c1", "c2")] == [[2], [1], [0]]


def test_free_after_fork_keeps_shared_blocks():
    a = BlockAllocator(4, 4)
    a.allocate("p", toks(6))
    a.fork("p", "c")
    a.free("p")
    assert a.ref_counts() == [1, 1, 0, 0] and a.num_free_blocks == 2
    a.free("c")
    assert a.free_block_ids() == [2, 3, 1, 0]


def test_fork_errors():
    a = BlockAllocator(4, 4)
    a.allocate("p", toks(3))
    a.allocate("q", toks(3, 50))
    before = a.snapshot()
    with pytest.raises(ValueError, match="already exists"):
        a.fork("p", "q")
    with pytest.raises(TypeError, match="hashable"):
        a.fork("p", ["x"])
    assert a.snapshot() == before


# -- truncate (speculative rollback) --------------------------------------------------------
def test_truncate_releases_blocks_no_longer_needed():
    a = BlockAllocator(8, 4)
    a.allocate("a", toks(6))
    a.append_slots("a", 5)                              # 11 slots: [0, 1, 2]
    a.truncate("a", 7)                                  # rejected drafts go
    assert a.block_table("a") == [0, 1] and a.num_slots("a") == 7
    assert a.free_block_ids()[-1] == 2 and a.ref_counts()[:3] == [1, 1, 0]
    before = a.snapshot()
    a.truncate("a", 7)                                  # no-op
    assert a.snapshot() == before
    a.truncate("a", 4)
    assert a.block_table("a") == [0] and a.num_slots("a") == 4
    assert a.append_slots("a", 1) == [] and a.block_table("a") == [0, 3]     # the front of the queue
    a.check_invariants(["a"])


def test_truncate_bad_length_changes_nothing():
    a = BlockAllocator(8, 4)
    a.allocate("a", toks(6))
    before = a.snapshot()
    for n, err in ((7, ValueError), (-1, ValueError), (2.0, TypeError)):
        with pytest.raises(err):
            a.truncate("a", n)
    assert a.snapshot() == before


# -- errors leave the state exactly as it was --------------------------------------------------
def test_allocate_errors_change_nothing():
    a = BlockAllocator(4, 4)
    a.allocate("a", toks(9))                            # 3 of 4 blocks
    a.mark_computed("a", 9, toks(9))
    before = a.snapshot()
    with pytest.raises(ValueError, match="already exists"):
        a.allocate("a", toks(1))
    with pytest.raises(ValueError, match="empty"):
        a.allocate("b", [])
    with pytest.raises(TypeError):
        a.allocate("b", [1, "x"])
    with pytest.raises(TypeError):
        a.allocate("b", "abc")
    assert not a.can_allocate(toks(8, 7))               # 2 fresh blocks, 1 free
    with pytest.raises(NoFreeBlocksError):
        a.allocate("b", toks(8, 7))
    assert a.snapshot() == before and not a.has_seq("b")
    a.check_invariants(["a"])


def test_append_errors_change_nothing():
    a = BlockAllocator(3, 4)
    a.allocate("a", toks(7))                            # [0, 1]
    a.fork("a", "b")
    a.allocate("c", toks(1, 50))                        # [2]: the pool is full
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError):
        a.append_slots("a", 1)                          # needs a copy-on-write block
    with pytest.raises(NoFreeBlocksError):
        a.append_slots("c", 4)                          # needs a second block
    with pytest.raises(TypeError):
        a.append_slots("c", 1.5)
    with pytest.raises(TypeError):
        a.append_slots("c", [1])                        # the old API: tokens instead of a count
    with pytest.raises(ValueError):
        a.append_slots("c", -1)
    assert a.snapshot() == before
    assert a.append_slots("c", 3) == [] and a.block_table("c") == [2]       # 4 slots still fit in block 2
    a.check_invariants(["a", "b", "c"])


def test_mark_computed_errors_change_nothing():
    a = BlockAllocator(4, 4)
    t = toks(6)
    a.allocate("a", t)
    a.mark_computed("a", 5, t)
    assert a.num_cached_blocks("a") == 1 and a.cached_block_ids() == [0]
    before = a.snapshot()
    for n, tokens, err in ((7, t + [1], ValueError),   # past the slots held (even with the tokens given)
                           (6, t[:5], ValueError),      # past the tokens given
                           (5, t[:4], ValueError),
                           (-1, t, ValueError),
                           (5.0, t, TypeError)):
        with pytest.raises(err):
            a.mark_computed("a", n, tokens)
    assert a.snapshot() == before and a.num_cached_blocks("a") == 1


def test_mark_computed_rejects_more_than_the_slots_held_or_the_tokens_given():
    a = BlockAllocator(8, 4)
    t = toks(9)
    a.allocate("a", t[:6])
    before = a.snapshot()
    with pytest.raises(ValueError, match=r"num_computed_tokens must be in 0\.\.6 .*got 7"):
        a.mark_computed("a", 7, t)                      # 9 tokens known, only 6 slots held
    with pytest.raises(ValueError, match=r"at most len\(token_ids\) = 4, got 5"):
        a.mark_computed("a", 5, t[:4])                  # 6 slots held, only 4 tokens given
    assert a.snapshot() == before
    a.mark_computed("a", 6, t)                          # a longer token list is fine: its first 6 count
    assert a.cached_block_ids() == [0] and a.num_cached_prefix_tokens(t) == 4


def test_mark_computed_lower_than_before_changes_nothing():
    a = BlockAllocator(8, 4)
    t = toks(10)
    a.allocate("a", t)
    a.mark_computed("a", 9, t)                          # 2 full blocks cached
    before = a.snapshot()
    for n in (8, 5, 0):                                 # the allocator keeps no count: a lower one is no news
        a.mark_computed("a", n, t)
        assert a.snapshot() == before
    assert a.num_cached_blocks("a") == 2


def test_ref_count_of_a_bad_block_id():
    a = BlockAllocator(4, 4)
    with pytest.raises(ValueError):
        a.ref_count(4)


def test_check_invariants_catches_corruption():
    a = BlockAllocator(4, 4)
    a.allocate("a", toks(5))
    a.check_invariants(["a"])
    with pytest.raises(AssertionError, match="live sequences"):
        a.check_invariants(["a", "b"])
    a._ref[3] = 1                                       # a block "in use" by nobody, still in the free queue
    with pytest.raises(AssertionError):
        a.check_invariants()
    a._ref[3] = 0
    a._seqs["a"].blocks.append(3)                       # one block too many for 5 tokens
    with pytest.raises(AssertionError, match="blocks for 5 slots"):
        a.check_invariants()
    a._seqs["a"].blocks.pop()
    a.check_invariants(["a"])
    a._seqs["a"].chain = [(0, 0), (1, 1)]               # 2 cached full blocks in 5 slots
    with pytest.raises(AssertionError, match="more cached blocks than full blocks"):
        a.check_invariants()


# -- a stateful property test ----------------------------------------------------------------
BS, NB = 4, 12


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / compute / append / fork / truncate / free, as an engine would call them.

    Next to the allocator it keeps what the engine's ``Sequence`` owns -- each sequence's tokens and its
    ``num_computed`` -- and a fake KV cache, ``kv[block][offset] = token``, written only where the engine
    would write (uncomputed positions, copy-on-write copies). So a prefix-cache hit on the wrong block, a
    missed copy-on-write or a shared block written in place shows up as a position whose "KV" is not its
    token; and every cache entry must describe the "KV" its block really holds.
    """
    caching = True

    @initialize()
    def setup(self):
        self.a = BlockAllocator(NB, BS, self.caching)
        self.tokens, self.computed = {}, {}
        self.kv, self.next_id = [[None] * BS for _ in range(NB)], 0

    def _compute(self, sid, upto):
        table = self.a.block_table(sid)
        for p in range(self.computed[sid], upto):
            b = table[p // BS]
            assert self.a.ref_count(b) == 1 and b not in self.a.cached_block_ids(), "writing a shared block"
            self.kv[b][p % BS] = self.tokens[sid][p]
        self.computed[sid] = max(self.computed[sid], upto)
        self.a.mark_computed(sid, upto, self.tokens[sid])

    def _try(self, fn):
        before = self.a.snapshot()
        try:
            return fn()
        except NoFreeBlocksError:
            assert self.a.snapshot() == before
            raise

    seqs = property(lambda self: sorted(self.tokens))

    def _done(self):
        return [s for s in self.seqs if self.computed[s] == len(self.tokens[s])]

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=20), chunk=st.integers(0, 20))
    def allocate(self, tokens, chunk):
        sid = f"s{self.next_id}"
        self.next_id += 1
        can = self.a.can_allocate(tokens)
        expect_cached = self.a.num_cached_prefix_tokens(tokens)
        try:
            cached = self._try(lambda: self.a.allocate(sid, tokens))
        except NoFreeBlocksError:
            assert not can
            return
        assert can and cached == expect_cached and cached % BS == 0 and cached <= len(tokens) - 1
        assert self.a.num_slots(sid) == len(tokens) and self.a.num_cached_blocks(sid) == cached // BS
        self.tokens[sid], self.computed[sid] = list(tokens), cached
        self._compute(sid, min(len(tokens), cached + chunk))    # a first prefill chunk

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute_more(self, data):                               # a later prefill chunk
        sid = data.draw(st.sampled_from(self.seqs))
        n = data.draw(st.integers(self.computed[sid], len(self.tokens[sid])))
        self._compute(sid, n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_again(self, data):                                 # a count already reported: no news
        sid = data.draw(st.sampled_from(self.seqs))
        n = data.draw(st.integers(0, self.computed[sid]))
        before = self.a.snapshot()
        self.a.mark_computed(sid, n, self.tokens[sid])
        after = self.a.snapshot()
        assert after["seqs"][sid][:2] == before["seqs"][sid][:2] and after["ref"] == before["ref"]
        assert after["free"] == before["free"] and (after["hits"], after["queries"]) == \
            (before["hits"], before["queries"])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def append(self, data, new):                                # decode, or verify 1 + k
        done = self._done()
        if not done:
            return
        sid = data.draw(st.sampled_from(done))
        old_table = self.a.block_table(sid)
        try:
            pairs = self._try(lambda: self.a.append_slots(sid, len(new)))
        except NoFreeBlocksError:
            return
        table = self.a.block_table(sid)
        keep = len(old_table) - len(pairs)                      # only the partly filled last block may move
        assert len(pairs) <= 1 and table[:keep] == old_table[:keep]
        assert len(table) == self.a.blocks_needed(len(self.tokens[sid]) + len(new))
        for src, dst in pairs:                                  # the engine copies before it writes
            assert src == old_table[-1] and dst == table[len(old_table) - 1] and src != dst
            assert self.a.ref_count(dst) == 1 and dst not in self.a.cached_block_ids()
            self.kv[dst] = list(self.kv[src])
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
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]
        assert self.a.block_table(child) == self.a.block_table(parent)
        assert self.a.num_cached_blocks(child) == self.a.num_cached_blocks(parent)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(self.seqs))
        n = data.draw(st.integers(0, len(self.tokens[sid])))
        self.a.truncate(sid, n)
        del self.tokens[sid][n:]
        self.computed[sid] = min(self.computed[sid], n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(self.seqs))
        self.a.free(sid)
        del self.tokens[sid], self.computed[sid]

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        self.a.check_invariants(self.tokens)
        assert self.a.num_free_blocks == self.a.ref_counts().count(0)
        entries = self.a.snapshot()["entries"]
        if not self.caching:
            assert entries == {} and self.a.cached_block_ids() == []
        for b, e in entries.items():                            # the cache describes what the block holds
            assert self.kv[b] == list(e.tokens), f"block {b} holds {self.kv[b]}, its entry says {e.tokens}"
        for sid, t in self.tokens.items():
            assert self.a.num_slots(sid) == len(t)
            assert self.a.num_cached_blocks(sid) <= self.computed[sid] // BS
            table = self.a.block_table(sid)
            held = [self.kv[table[p // BS]][p % BS] for p in range(self.computed[sid])]
            assert held == t[:len(held)], f"{sid}: the cache holds {held}, the sequence {t}"
            for i, b in enumerate(table):                       # a block's entry agrees with its holders
                if b in entries:
                    part = tuple(t[i * BS:(i + 1) * BS])
                    assert entries[b].tokens[:len(part)] == part, f"{sid}: block {b} differs from its entry"


class AllocatorMachineNoCache(AllocatorMachine):
    caching = False


_fast = settings(max_examples=50, stateful_step_count=30, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = _fast
TestAllocatorMachineNoCache = AllocatorMachineNoCache.TestCase
TestAllocatorMachineNoCache.settings = _fast


# -- the memory-efficiency script, on a tiny config ------------------------------------------
def test_kv_efficiency_paged_beats_contiguous(capsys):
    from minibatch.bench.kv_efficiency import main
    r = main(["--num-requests", "24", "--block-size", "16", "--max-len", "128", "--seed", "1"])
    assert 0 < r["contiguous_share"] < r["paged_share"] <= 1
    assert r["paged_fit"] > r["contiguous_fit"]
    assert set(r["by_block_size"]) == {8, 16, 32, 64}
    shares = [r["by_block_size"][b] for b in (8, 16, 32, 64)]
    assert shares == sorted(shares, reverse=True)   # bigger blocks waste more of the last block
    assert "20.4" in capsys.readouterr().out
