"""Exercise 12, graded: the radix cache (exercises/ex12_radix_cache.py).

Hand-worked trees say exactly which blocks a match finds, where an edge splits, what an insert adds, and which
blocks ``evict`` frees and in what order (least recently used unlocked leaves, exactly as many as asked); locks
must hold a whole path and let it go again. A property test runs random insert / match / lock / unlock / evict
sequences against a plain-Python model (a dict of page-prefix tuples) and the invariant checker. Last, the engine
runs with ``prefix_cache="radix"`` on your tree (the block allocator over it is the engine's), on a pool small
enough to evict, and its greedy text must equal generation without any cache, with every block back at the end.
"""
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import exercises

pytestmark = pytest.mark.ex12


def Tree(page_size=2):
    return exercises.get("radix_cache")(page_size)


def tree_with(*keys, page_size=2):
    """A tree holding ``keys`` inserted in order, page j of key i in block 100 * i + j."""
    t = Tree(page_size)
    for i, k in enumerate(keys):
        t.insert(k, [100 * i + j for j in range(len(k) // page_size)])
    return t


# -- matching and inserting -------------------------------------------------------------------------------------
def test_a_key_matches_whole_pages_only():
    t = tree_with([1, 2, 3, 4])
    assert t.match_prefix([1, 2, 3])[0] == [0]                 # the partial page (3) is not matched
    assert t.match_prefix([1, 2, 3, 4, 5])[0] == [0, 1]
    assert t.match_prefix([1, 2, 3, 9])[0] == [0]              # page (3, 9) differs in its second token
    assert t.match_prefix([1])[0] == [] and t.match_prefix([])[0] == []
    blocks, node = t.match_prefix([7, 7])
    assert blocks == [] and node is t.root_node
    t.check_invariants()


def test_a_match_ending_mid_edge_splits_and_keeps_the_tail():
    t = tree_with([1, 2, 3, 4, 5, 6])
    blocks, node = t.match_prefix([1, 2, 3, 4, 9, 9])
    assert blocks == [0, 1] and node.key == (1, 2, 3, 4) and node.value == [0, 1] and node.parent is t.root_node
    (tail,) = node.children.values()
    assert tail.key == (5, 6) and tail.value == [2] and tail.parent is node
    assert t.match_prefix([1, 2, 3, 4, 5, 6])[0] == [0, 1, 2]   # nothing was lost by the split
    assert t.match_prefix([1, 2, 3, 4, 5, 6])[1] is tail
    assert t.evictable_size() == 3
    t.check_invariants()


def test_an_insert_splits_and_adds_only_the_new_pages():
    t = tree_with([1, 2, 3, 4, 5, 6])
    assert t.insert([1, 2, 7, 8], [70, 71]) == 2               # page (1, 2) was there: it keeps block 0
    assert t.match_prefix([1, 2, 3, 4, 5, 6])[0] == [0, 1, 2]
    assert t.match_prefix([1, 2, 7, 8])[0] == [0, 71]
    assert sorted(t.all_blocks()) == [0, 1, 2, 71] and t.evictable_size() == 4
    assert t.insert([9, 9, 9], [90]) == 0 and t.match_prefix([9, 9, 9, 9])[0] == [90]     # whole pages only
    t.check_invariants()


def test_a_duplicate_insert_does_not_count_twice():
    t = tree_with([1, 2, 3, 4])
    assert t.insert([1, 2, 3, 4], [7, 8]) == 4                 # every token was there
    assert t.all_blocks() == [0, 1] and t.evictable_size() == 2
    assert t.insert([1, 2, 3, 4, 5, 6], [7, 8, 9]) == 4         # only the new page is added, with its block
    assert t.all_blocks() == [0, 1, 9] and t.evictable_size() == 3
    t.check_invariants()


# -- eviction and locks ------------------------------------------------------------------------------------------
def test_eviction_is_lru_by_last_access_not_by_insertion():
    t = tree_with([1, 2], [3, 4], [5, 6])                     # inserted in this order
    t.match_prefix([1, 2, 0])                                 # ... but (1, 2) used last, then (3, 4)
    t.match_prefix([3, 4])
    assert t.evict(1) == [200] and t.evict(1) == [0] and t.evict(1) == [100]


def test_a_locked_node_is_never_evicted():
    t = tree_with([1, 2, 3, 4], [5, 6])
    _, node = t.match_prefix([1, 2, 3, 4])
    t.inc_lock_ref(node)
    assert t.evictable_size() == 1 and t.protected_size() == 2 and node.lock_ref == 1
    assert t.evict(10) == [100]                               # everything evictable, and nothing locked
    assert t.evict(10) == [] and t.match_prefix([1, 2, 3, 4])[0] == [0, 1]
    t.check_invariants()


def test_a_lock_holds_the_whole_path_and_is_released_whole():
    t = tree_with([1, 2, 3, 4, 5, 6])
    _, node = t.match_prefix([1, 2, 3, 4, 5, 6])
    t.inc_lock_ref(node)
    t.inc_lock_ref(node)                                      # two requests on one path
    t.match_prefix([1, 2, 9, 9])                              # splits the locked edge: both halves stay locked
    assert t.evictable_size() == 0 and t.protected_size() == 3 and t.evict(5) == []
    t.dec_lock_ref(node)
    assert t.evictable_size() == 0 and t.evict(5) == []      # one request still holds it
    t.dec_lock_ref(node)                                      # the last request finishes: the whole path is free
    assert t.evictable_size() == 3 and t.protected_size() == 0 and all(n.lock_ref == 0 for n in t.nodes())
    with pytest.raises(ValueError):
        t.dec_lock_ref(node)
    assert t.evict(5) == [2, 1, 0]
    t.check_invariants()


def test_an_inner_node_waits_for_its_last_child():
    t = tree_with([1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8])  # stem (1, 2), three branches
    assert t.evict(1) == [1]                                  # the oldest branch, not the stem (older still)
    assert t.evict(1) == [101]
    assert t.evict(1) == [201]                                # the stem outlives its branches
    assert t.match_prefix([1, 2, 0])[0] == [0]
    assert t.evict(1) == [0] and t.evictable_size() == 0 and t.all_blocks() == []
    t = tree_with([1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8])  # the same in one call
    assert t.evict(3) == [1, 101, 201] and t.match_prefix([1, 2, 0])[0] == [0]
    t.check_invariants()


def test_eviction_frees_exactly_the_number_asked():
    t = tree_with([1, 2, 3, 4, 5, 6])
    assert t.evict(2) == [2, 1]                               # a leaf of 3 pages gives up its tail two
    assert t.match_prefix([1, 2, 3, 4, 5, 6])[0] == [0] and t.evictable_size() == 1
    t.check_invariants()
    t = tree_with([1, 2, 3, 4], [5, 6, 7, 8], [9, 9])
    assert t.evict(3) == [1, 0, 101] and t.evictable_size() == 2
    assert t.evict(0) == [] and t.evict(1) == [100] and t.evict(99) == [200]   # or all there is
    t.check_invariants()


# -- random operations against a model -----------------------------------------------------------------------------
class Model:
    """The radix cache as a dict: every cached prefix, a tuple of pages, with its last page's block, its lock count
    and its last access tick."""

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
            leaves = [p for p in self.block if self.locks[p] == 0
                      and not any(len(q) > len(p) and q[:len(p)] == p for q in self.block)]
            if not leaves:
                break
            p = min(leaves, key=lambda q: self.time[q])
            out.append(self.block.pop(p))
            del self.locks[p], self.time[p]
        return out


keys = st.lists(st.integers(0, 1), max_size=8)
ops = st.lists(st.one_of(st.tuples(st.just("insert"), keys), st.tuples(st.just("match"), keys),
                         st.tuples(st.just("lock"), keys), st.tuples(st.just("unlock"), st.integers(0, 9)),
                         st.tuples(st.just("evict"), st.integers(0, 4))), max_size=40)


@settings(max_examples=120, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, ps=st.sampled_from([1, 2, 3]))
def test_random_operations_match_the_model(ops, ps):
    t, m, held, next_block = Tree(ps), Model(ps), [], 0
    for op, arg in ops:
        if op == "insert":
            value = list(range(next_block, next_block + len(arg) // ps))
            next_block += len(value)
            assert t.insert(arg, value) == m.insert(arg, value), f"insert({arg})"
        elif op == "match":
            assert t.match_prefix(arg)[0] == m.match(arg)[0], f"match_prefix({arg})"
        elif op == "lock":
            (blocks, node), (want, prefix) = t.match_prefix(arg), m.match(arg)
            assert blocks == want, f"match_prefix({arg})"
            t.inc_lock_ref(node)
            m.lock(prefix, 1)
            held.append((node, prefix))
        elif op == "unlock" and held:
            node, prefix = held.pop(arg % len(held))
            t.dec_lock_ref(node)
            m.lock(prefix, -1)
        elif op == "evict":
            locked = {m.block[p] for p, n in m.locks.items() if n}
            got = t.evict(arg)
            assert not locked & set(got), f"evict({arg}) freed locked blocks {sorted(locked & set(got))}"
            assert got == m.evict(arg), f"evict({arg})"
        t.check_invariants()                                  # every block in the tree once, sizes exact, ...
        assert sorted(t.all_blocks()) == sorted(m.block.values())
        assert t.evictable_size() == sum(n == 0 for n in m.locks.values())


# -- the engine on your tree -------------------------------------------------------------------------------------
def slots(block_tables, starts, counts, block_size, device="cpu"):
    """The engine's slot mapping (exercise 1's formula), here so that this part needs no other part of yours."""
    return torch.tensor([t[p // block_size] * block_size + p % block_size for t, s, n in zip(block_tables, starts, counts)
                         for p in range(s, s + n)], dtype=torch.int64).to(device)


def _one_at_a_time():
    """A toy scheduler (not exercise 7's): one request at a time (with its forks), the whole prompt in one step,
    then one decode step per token."""
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


PREAMBLE = "import os\nimport sys\n\n# shared header for prefix caching\n"    # 58 bytes: 7 full blocks of 8


def test_the_engine_generates_the_same_text_on_your_tree(target_model, monkeypatch):
    """The shared header found in the tree, n = 2 forks (copy-on-write of the last prompt block), a pool of 12
    blocks of 8 that must evict, and every lock let go: the text of generation without a cache, every block back."""
    import minibatch.engine.engine as engine
    import minibatch.kv.metadata as metadata
    import minibatch.kv.radix_allocator as radix_allocator
    from minibatch import LLM, SamplingParams
    from minibatch.model.tokenizer import encode
    from minibatch.sampling.reference import generate
    monkeypatch.setattr(radix_allocator, "RadixCache", exercises.get("radix_cache"))
    monkeypatch.setattr(engine, "Scheduler", _one_at_a_time())
    monkeypatch.setattr(metadata, "_slot_mapping", slots)
    prompts = [PREAMBLE + "def main():\n", "class Stack:\n    def push(self", PREAMBLE + "for i in range(",
               PREAMBLE + "def main():\n", "    def __init__(self"]
    lengths = [20, 16, 12, 18, 14]
    params = [SamplingParams(temperature=0, max_tokens=m, n=2 if i == 1 else 1) for i, m in enumerate(lengths)]
    want = [generate(target_model, encode(p), SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(prompts, lengths)]
    llm = LLM(target_model, block_size=8, num_gpu_blocks=12, prefix_cache="radix")
    outs = llm.generate(prompts, params, use_tqdm=False)
    a = llm.llm_engine.allocator
    for o, w in zip(outs, want):
        for c in o.outputs:
            assert c.token_ids == w, f"request {o.request_id}: the engine's text differs from generation without a cache"
    a.check_invariants([])
    assert a.tree.protected_size() == 0, "a finished request's lock was never released"
    assert a.num_free_blocks == a.num_blocks, "blocks leaked after every request finished"
    assert a.hits >= 7, f"the shared header's blocks were found {a.hits} times in the tree, want >= 7"
