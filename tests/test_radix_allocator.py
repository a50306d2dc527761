"""The block allocator over the radix tree (``prefix_cache="radix"``, minibatch/kv/radix_allocator.py): the same
hits as the hash chain where no block is evicted, a different eviction order where one is, copy-on-write against the
tree, and the engine on it (greedy tokens as the hash chain's; with copy-on-write, n > 1, chunked prefill and
preemption in one run).

Block size 4 in the allocator tests, so block i of a prompt is tokens 4i..4i+3.
"""
import pytest
from hypothesis import given, settings, strategies as st

from minibatch import LLM, SamplingParams
from minibatch.engine.config import EngineConfig
from minibatch.kv.block_allocator import BlockAllocator, NoFreeBlocksError
from minibatch.kv.radix_allocator import RadixBlockAllocator
from minibatch.model.data import val_documents

A = [10, 11, 12, 13, 20, 21, 22, 23, 30]            # 2 full blocks + 1 token
B = [40, 41, 42, 43, 50, 51, 52, 53, 60]


def computed(a, sid, tokens):
    cached = a.allocate(sid, tokens)
    a.mark_computed(sid, len(tokens), tokens)
    return cached


def test_a_shared_prefix_reuses_the_tree_blocks_and_locks_them():
    a = RadixBlockAllocator(8, 4)
    assert computed(a, "a", A) == 0 and a.cached_block_ids() == [0, 1]
    assert a.allocate("b", A[:8] + [7, 7]) == 8 and a.block_table("b") == [0, 1, 3]
    a.free("a")                                        # b still holds the path: nothing evictable
    assert a.tree.evictable_size() == 0 and a.num_free_blocks == 5
    a.free("b")                                        # now the two pages wait in the tree, evictable
    assert a.tree.evictable_size() == 2 and a.num_free_blocks == 8 and a.free_block_ids() == [4, 5, 6, 7, 2, 3]
    a.check_invariants([])


def test_evictable_blocks_count_as_free_and_are_evicted_for_fresh_ones():
    a = RadixBlockAllocator(6, 4)
    computed(a, "a", A)
    computed(a, "b", B)
    a.free("a"), a.free("b")
    assert a.num_free_blocks == 6 and a.can_allocate(list(range(24)))
    a.allocate("c", list(range(24)))                   # 6 fresh blocks: the 2 free ones and the 4 in the tree
    assert a.cached_block_ids() == [] and a.num_free_blocks == 0
    a.check_invariants(["c"])


def test_where_the_two_caches_differ_the_order_of_eviction():
    """A is computed before B; B is freed before A. The hash chain evicts the least recently *freed* (B); the
    radix tree the least recently *used* (A): each keeps the other's prefix."""
    kept = {}
    for cls in (BlockAllocator, RadixBlockAllocator):
        a = cls(6, 4)
        computed(a, "a", A)
        computed(a, "b", B)
        a.free("b")
        a.free("a")
        a.allocate("c", [1] * 9)                       # 3 fresh blocks: the 2 partial ones and one cached page
        a.check_invariants(["c"])
        kept[cls.__name__] = (a.num_cached_prefix_tokens(A + [0]), a.num_cached_prefix_tokens(B + [0]))
    assert kept == {"BlockAllocator": (8, 0),          # B's tail went (least recently freed), then B's head
                    "RadixBlockAllocator": (4, 8)}     # A's tail page went (least recently used)


def test_a_stem_outlives_its_branches():
    a = RadixBlockAllocator(7, 4)
    computed(a, "x", A[:4] + [1, 1, 1, 1, 0])          # stem A[:4], branch [1, 1, 1, 1]
    computed(a, "y", A[:4] + [2, 2, 2, 2, 0])          # same stem, branch [2, 2, 2, 2]
    a.free("x"), a.free("y")
    a.allocate("z", [9] * 21)                          # 6 fresh: 4 in the queue, then both branches
    assert a.num_cached_prefix_tokens(A[:4] + [5]) == 4 and a.cached_block_ids() == [0]
    a.check_invariants(["z"])


def test_truncating_into_a_cached_page_copies_it_on_the_next_write():
    a = RadixBlockAllocator(8, 4)
    computed(a, "a", A)
    a.truncate("a", 6)                                 # keeps half of page 1, which the tree still indexes
    a.check_invariants(["a"])
    assert a.num_cached_blocks("a") == 1
    assert a.append_slots("a", 2) == [(1, 3)]          # written into a copy: the tree's page stays whole
    t = A[:6] + [7, 7]
    a.mark_computed("a", 8, t)
    assert a.num_cached_prefix_tokens(A + [0]) == 8 and a.num_cached_prefix_tokens(t + [0]) == 8
    a.check_invariants(["a"])
    a.free("a")
    assert a.num_free_blocks == 8


def test_fork_locks_the_path_for_the_child():
    a = RadixBlockAllocator(8, 4)
    computed(a, "p", A)
    a.fork("p", "c")
    assert a.append_slots("c", 1) == [(2, 3)]          # the shared partial block: copy-on-write
    a.free("p")
    assert a.tree.evictable_size() == 0                # the child holds the path
    a.check_invariants(["c"])
    a.free("c")
    assert a.tree.evictable_size() == 2
    a.check_invariants([])


def test_failed_calls_change_nothing():
    a = RadixBlockAllocator(4, 4)
    computed(a, "a", A)
    a.free("a")
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError):
        a.allocate("b", [0] * 17)                      # 5 blocks of 4
    computed(a, "b", A[:8] + [1, 2, 3, 4])             # 2 hits + 2 fresh: the whole pool
    before = a.snapshot()
    with pytest.raises(NoFreeBlocksError):
        a.append_slots("b", 5)
    assert a.snapshot() == before
    a.check_invariants(["b"])


def test_radix_needs_prefix_caching_and_the_config_checks_its_choices():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        RadixBlockAllocator(4, 4, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"prefix_cache 'tree'; choose one of \['hash', 'radix'\]"):
        EngineConfig(prefix_cache="tree")


# -- the same hits as the hash chain, while nothing is evicted -----------------------------------------------------
TEMPLATES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7]]
steps = st.lists(st.tuples(st.sampled_from(["new", "compute", "decode", "fork", "free"]), st.integers(0, 99),
                           st.integers(0, 2), st.lists(st.integers(0, 3), max_size=6)), max_size=30)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(steps=steps)
def test_same_hits_as_the_hash_chain_when_nothing_is_evicted(steps):
    pools = [BlockAllocator(400, 4), RadixBlockAllocator(400, 4)]
    seqs = {}                                          # seq id -> [tokens, num computed]
    for n, (op, pick, t, tail) in enumerate(steps):
        live = sorted(seqs)
        sid = live[pick % len(live)] if live else None
        if op == "new" or sid is None:
            tokens = TEMPLATES[t] + tail + [5]
            assert len({p.num_cached_prefix_tokens(tokens) for p in pools}) == 1
            assert len({p.allocate(f"s{n}", tokens) for p in pools}) == 1
            seqs[f"s{n}"] = [tokens, 0]
        elif op == "compute":                          # a chunk of prefill (or all of it)
            s = seqs[sid]
            s[1] = min(len(s[0]), s[1] + 1 + pick % 6)
            for p in pools:
                p.mark_computed(sid, s[1], s[0])
        elif op == "decode" and seqs[sid][1] == len(seqs[sid][0]):
            s = seqs[sid]
            s[0] = s[0] + [tail[0] if tail else 0]
            for p in pools:
                p.append_slots(sid, 1)
                p.mark_computed(sid, len(s[0]) - 1, s[0])
            s[1] = len(s[0]) - 1
        elif op == "fork" and seqs[sid][1] == len(seqs[sid][0]):
            for p in pools:
                p.fork(sid, f"s{n}")
            seqs[f"s{n}"] = [list(seqs[sid][0]), seqs[sid][1]]
        elif op == "free":
            for p in pools:
                p.free(sid)
            del seqs[sid]
        for p in pools:
            p.check_invariants(list(seqs))
        assert pools[0].hits == pools[1].hits and pools[0].queries == pools[1].queries
        assert [pools[0].num_cached_blocks(s) for s in seqs] == [pools[1].num_cached_blocks(s) for s in seqs]


# -- the engine on it ----------------------------------------------------------------------------------------------
PREAMBLE = list(b"import os\nimport sys\n\n# shared header for prefix caching\n")    # 58 bytes: 7 full blocks of 8
PROMPTS = [PREAMBLE + list(d[:n]) for d, n in zip(val_documents(4, min_len=100, seed=5), (20, 35, 9, 14))] + \
          [list(val_documents(5, min_len=100, seed=6)[4][:30])]


def run(model, params, **cfg):
    llm = LLM(model, block_size=8, **cfg)
    eng, traces = llm.llm_engine, []

    def hook(t):
        eng.allocator.check_invariants(eng.scheduler.live_seq_ids())
        traces.append(t)
    eng.add_hook(hook)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
    return [[c.token_ids for c in o.outputs] for o in outs], traces, eng


def test_radix_gives_the_hash_chains_tokens_and_hits(target_model):
    params = SamplingParams(temperature=0, max_tokens=12)
    (hash_out, hash_tr, _), (radix_out, radix_tr, _) = (run(target_model, params, prefix_cache=c, max_num_seqs=2)
                                                        for c in ("hash", "radix"))
    assert radix_out == hash_out
    hits = [(t.prefix_cache_hits, t.prefix_cache_queries) for t in hash_tr]
    assert [(t.prefix_cache_hits, t.prefix_cache_queries) for t in radix_tr] == hits and hits[-1][0] >= 14


def test_radix_with_copy_on_write_forks_chunked_prefill_and_preemption(target_model):
    """A pool of 18 blocks of 8 for up to 4 sequences of up to 15 blocks: they preempt each other, and the tree
    evicts; n = 2 seeded samples fork off the prompt and share its partial block (copy-on-write on their first
    token), and differ after; a 16-token budget chunks every prompt. The tokens are an engine's without a cache."""
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24)]
    params = [params[i % 2] for i in range(len(PROMPTS))]
    cfg = dict(num_gpu_blocks=18, max_num_seqs=4, max_num_batched_tokens=16)
    want, _, _ = run(target_model, params, enable_prefix_caching=False, **cfg)
    got, traces, eng = run(target_model, params, prefix_cache="radix", **cfg)
    assert got == want
    assert any(t.preempted for t in traces) and traces[-1].prefix_cache_hits > 0
    assert any(s.phase == "prefill" and s.num_computed_before and s.num_computed_before % 8
               for t in traces for s in t.scheduled)            # a later chunk of a prompt (not a cache hit)
    assert any(len(set(map(tuple, o))) == 2 for o in got)      # the forks ran, and went their own ways


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 6, "depth": 3, "topk": 2}])
def test_radix_under_speculation_gives_the_hash_chains_tokens(target_model, spec):
    """Verify steps write drafts past the computed tokens and roll the rejected ones back (``truncate``); a token
    tree writes into scratch slots too. The tree only ever holds computed pages, so the tokens stay the same."""
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = [run(target_model, params, prefix_cache=c, num_gpu_blocks=24, speculative_config=spec)[0]
            for c in ("hash", "radix")]
    assert outs[1] == outs[0]
