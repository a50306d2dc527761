"""The radix tree alone (minibatch/kv/radix_cache.py): whole-page matches, splits, duplicate inserts, LRU eviction
of unlocked leaves, exact eviction counts; and a property test against a slow, obvious reference.

Page size 2 throughout, so page i of a key is tokens 2i, 2i+1. Block ids are the tests' own (the tree stores
whatever it is given).
"""
import pytest
from hypothesis import given, settings, strategies as st

from minibatch.kv.radix_cache import RadixCache


def tree_with(*keys, page_size=2):
    """A tree holding ``keys`` inserted in order, page j of key i in block 100 * i + j."""
    t = RadixCache(page_size)
    for i, k in enumerate(keys):
        t.insert(k, [100 * i + j for j in range(len(k) // page_size)])
    return t


def test_a_key_matches_whole_pages_only():
    t = tree_with([1, 2, 3, 4])
    assert t.match_prefix([1, 2, 3])[0] == [0]                 # the partial page (3) is not looked at
    assert t.match_prefix([1, 2, 3, 4, 5])[0] == [0, 1]
    assert t.match_prefix([1, 9, 3, 4])[0] == []                # a page differs in its second token: no match
    assert t.match_prefix([1])[0] == [] and t.match_prefix([])[0] == []
    assert t.insert([5, 6, 7], [50, 51]) == 0                   # insert takes whole pages too
    assert t.all_blocks() == [0, 1, 50] and t.evictable_size() == 3
    t.check_invariants()


def test_a_match_ending_mid_edge_splits_and_keeps_the_tail():
    t = tree_with([1, 2, 3, 4, 5, 6])
    blocks, node = t.match_prefix([1, 2, 3, 4, 9, 9])
    assert blocks == [0, 1] and node.key == (1, 2, 3, 4) and node.value == [0, 1]
    (tail,) = node.children.values()
    assert tail.key == (5, 6) and tail.value == [2] and tail.parent is node
    assert t.match_prefix([1, 2, 3, 4, 5, 6])[0] == [0, 1, 2]   # nothing was lost by the split
    assert t.evictable_size() == 3
    t.check_invariants()


def test_an_insert_ending_mid_edge_splits_too():
    t = tree_with([1, 2, 3, 4, 5, 6])
    assert t.insert([1, 2, 7, 8], [70, 71]) == 2               # page (1, 2) was there: it keeps block 0
    assert t.match_prefix([1, 2, 3, 4, 5, 6])[0] == [0, 1, 2]
    assert t.match_prefix([1, 2, 7, 8])[0] == [0, 71]
    assert sorted(t.all_blocks()) == [0, 1, 2, 71] and t.evictable_size() == 4
    t.check_invariants()


def test_a_duplicate_insert_does_not_count_twice():
    t = tree_with([1, 2, 3, 4])
    assert t.insert([1, 2, 3, 4], [7, 8]) == 4                 # every token was there
    assert t.all_blocks() == [0, 1] and t.evictable_size() == 2
    assert t.insert([1, 2, 3, 4, 5, 6], [7, 8, 9]) == 4         # only the new page is added, with its block
    assert t.all_blocks() == [0, 1, 9] and t.evictable_size() == 3
    t.check_invariants()


def test_eviction_is_lru_by_last_access_not_by_insertion():
    t = tree_with([1, 2], [3, 4])                             # (1, 2) inserted first
    t.match_prefix([1, 2, 0])                                 # ... but used last
    assert t.evict(1) == [100]                                # so (3, 4) goes first
    assert t.evict(1) == [0]


def test_a_locked_node_is_never_evicted():
    t = tree_with([1, 2, 3, 4], [5, 6])
    _, node = t.match_prefix([1, 2, 3, 4])
    t.inc_lock_ref(node)
    assert t.evictable_size() == 1 and t.protected_size() == 2
    assert t.evict(10) == [100]                              # everything evictable, and nothing locked
    assert t.evict(10) == [] and t.match_prefix([1, 2, 3, 4])[0] == [0, 1]
    t.dec_lock_ref(node)
    assert t.evictable_size() == 2 and t.evict(10) == [1, 0]  # a leaf's tail page first
    with pytest.raises(ValueError, match="not locked"):
        t.dec_lock_ref(node)
    t.check_invariants()


def test_a_lock_below_a_split_holds_the_head_too():
    t = tree_with([1, 2, 3, 4])
    _, node = t.match_prefix([1, 2, 3, 4])
    t.inc_lock_ref(node)
    t.match_prefix([1, 2, 9, 9])                              # splits the locked edge: both halves stay locked
    assert t.evictable_size() == 0 and t.evict(5) == []
    t.check_invariants()


def test_an_inner_node_waits_for_its_last_child():
    t = tree_with([1, 2, 3, 4], [1, 2, 5, 6])                 # stem (1, 2), branches (3, 4) and (5, 6)
    assert t.evict(1) == [1]                                  # the older branch, not the stem (older still)
    assert t.evict(1) == [101]
    assert t.evict(1) == [0]                                  # the stem is a leaf now
    assert t.evictable_size() == 0 and t.all_blocks() == []


def test_eviction_frees_exactly_the_number_asked():
    t = tree_with([1, 2, 3, 4, 5, 6])
    assert t.evict(2) == [2, 1]                               # a leaf of 3 pages gives up its tail two
    assert t.match_prefix([1, 2, 3, 4, 5, 6])[0] == [0] and t.evictable_size() == 1
    t.check_invariants()
    t = tree_with([1, 2, 3, 4], [5, 6, 7, 8])
    assert len(t.evict(3)) == 3 and t.evictable_size() == 1
    assert t.evict(0) == [] and len(t.evict(99)) == 1         # or every evictable block, if fewer


# -- the property test: the tree against a dict of page-prefix tuples ------------------------------------------
class Reference:
    """The slow, obvious radix cache: every cached prefix, as a tuple of pages, with its last page's block, its
    lock count and its last access tick."""

    def __init__(self, ps):
        self.ps, self.block, self.locks, self.time, self.clock = ps, {}, {}, {}, 0

    def pages(self, key):
        return tuple(tuple(key[i:i + self.ps]) for i in range(0, len(key) // self.ps * self.ps, self.ps))

    def match(self, key, touch=True):
        p, n = self.pages(key), 0
        while n < len(p) and p[:n + 1] in self.block:
            n += 1
        if touch:
            self.clock += 1
            for i in range(1, n + 1):
                self.time[p[:i]] = self.clock
        return [self.block[p[:i]] for i in range(1, n + 1)], p[:n]

    def insert(self, key, value):
        p = self.pages(key)
        self.clock += 1
        had = sum(p[:i] in self.block for i in range(1, len(p) + 1))
        for i in range(1, len(p) + 1):
            self.block.setdefault(p[:i], value[i - 1])
            self.locks.setdefault(p[:i], 0)
            self.time[p[:i]] = self.clock
        return had * self.ps

    def lock(self, prefix, d):
        for i in range(1, len(prefix) + 1):
            self.locks[prefix[:i]] += d

    def evict(self, n):
        out = []
        while len(out) < n:
            leaves = [p for p in self.block if self.locks[p] == 0 and not any(q[:len(p)] == p and q != p
                                                                                for q in self.block)]
            if not leaves:
                break
            p = min(leaves, key=lambda q: self.time[q])
            out.append(self.block.pop(p))
            del self.locks[p], self.time[p]
        return out

    def evictable(self):
        return sum(v == 0 for v in self.locks.values())


keys = st.lists(st.integers(0, 1), max_size=8)
ops = st.lists(st.one_of(st.tuples(st.just("insert"), keys), st.tuples(st.just("match"), keys),
                         st.tuples(st.just("lock"), keys), st.tuples(st.just("unlock"), st.integers(0, 9)),
                         st.tuples(st.just("evict"), st.integers(0, 4))), max_size=40)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(ops=ops, ps=st.sampled_from([1, 2, 3]))
def test_the_tree_matches_the_reference(ops, ps):
    t, ref, held, next_block = RadixCache(ps), Reference(ps), [], 0
    for op, arg in ops:
        if op == "insert":
            value = list(range(next_block, next_block + len(arg) // ps))
            next_block += len(value)
            assert t.insert(arg, value) == ref.insert(arg, value)
        elif op == "match":
            assert t.match_prefix(arg)[0] == ref.match(arg)[0]
        elif op == "lock":
            (blocks, node), (ref_blocks, prefix) = t.match_prefix(arg), ref.match(arg)
            assert blocks == ref_blocks
            t.inc_lock_ref(node)
            ref.lock(prefix, 1)
            held.append((node, prefix))
        elif op == "unlock" and held:
            node, prefix = held.pop(arg % len(held))
            t.dec_lock_ref(node)
            ref.lock(prefix, -1)
        elif op == "evict":
            locked = {ref.block[p] for p, n in ref.locks.items() if n}
            evicted = t.evict(arg)
            assert evicted == ref.evict(arg) and not locked & set(evicted)
        t.check_invariants()                                  # among them: every block in the tree exactly once
        assert sorted(t.all_blocks()) == sorted(ref.block.values())
        assert t.evictable_size() == ref.evictable()
        for p in ref.block:                                   # every cached prefix is found, whole
            key = [x for page in p for x in page]
            assert t.peek(key + [9] * ps)[0] == ref.match(key, touch=False)[0]
