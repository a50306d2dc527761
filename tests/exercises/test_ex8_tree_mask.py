"""Exercise 8, graded: the token tree's mask, its positions and the accepted path (exercises/ex8_tree_mask.py).

Hand-worked trees probe the rules one at a time (every ancestor and not only the parent, a node sees itself,
siblings and cousins never; the root at the context length, siblings sharing a position; a later sibling
tried when the first child is rejected, the argmax read at the parent, nothing accepted below a rejection,
the first of two equal siblings). Then random parent lists (chains, stars, deep and wide trees, one node to
64) against oracles written here the other way round: each node's ancestors and depth by walking up its
parent chain, the accepted path as the deepest node whose every ancestor is accepted. Last, the engine on
your three functions: its metadata for a tree step, and greedy text with EAGLE-2's dynamic trees equal to
generation without any cache. Nothing here calls the reference: a student release does not have it.
"""
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import exercises

pytestmark = pytest.mark.ex8

EXAMPLE = [-1, 0, 0, 1, 1, 2]      # the stub's tree: root; 1, 2 under it; 3, 4 under 1; 5 under 2


def mask_of(parents) -> list:
    arg = list(parents)
    got = exercises.get("tree_mask.ancestor_mask")(arg)
    assert arg == list(parents), "ancestor_mask changed the caller's parent list: read it only"
    assert isinstance(got, torch.Tensor), f"ancestor_mask must return a torch.Tensor, got {type(got).__name__}"
    n = len(parents)
    assert tuple(got.shape) == (n, n), f"the mask of {n} nodes is [{n}, {n}], got {list(got.shape)}"
    assert got.dtype == torch.bool, f"the mask must be a torch.bool tensor (True: node i sees node j), got {got.dtype}"
    rows = got.tolist()
    got.logical_not_()                           # the caller owns its mask: changing it changes no later one
    again = exercises.get("tree_mask.ancestor_mask")(list(parents))
    assert again.tolist() == rows, "a second call returned the mask a first caller had changed: return a new " \
                                   "tensor every call (one cached tensor is shared by every caller)"
    return rows


def positions_of(parents, context_len) -> list:
    arg = list(parents)
    got = exercises.get("tree_mask.positions")(arg, context_len)
    assert arg == list(parents), "positions changed the caller's parent list: read it only (the engine " \
                                 "builds the tree mask from the same list afterwards)"
    assert isinstance(got, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in got), \
        f"positions must return a list of ints, got {got!r}"
    assert len(got) == len(parents), f"one position per node: {len(parents)} nodes, got {len(got)} positions"
    return got


def path_of(parents, tokens, target_argmax) -> list:
    args = list(parents), list(tokens), list(target_argmax)
    got = exercises.get("tree_mask.greedy_path")(*args)
    assert args == (list(parents), list(tokens), list(target_argmax)), \
        "greedy_path changed a list it was given (parents, tokens or target_argmax): read them only"
    assert isinstance(got, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in got), \
        f"greedy_path must return a list of node indices (ints), got {got!r}"
    assert got[:1] == [0], f"the accepted path starts at the root, node 0: got {got}"
    return got


# -- oracles: walk up each node's parent chain ---------------------------------------------------------------
def oracle_ancestors(parents, i) -> list:
    """i, its parent, its grandparent, ..., the root."""
    chain = [i]
    while parents[chain[-1]] != -1:
        chain.append(parents[chain[-1]])
    return chain


def oracle_mask(parents) -> list:
    n = len(parents)
    return [[j in oracle_ancestors(parents, i) for j in range(n)] for i in range(n)]


def oracle_positions(parents, context_len) -> list:
    return [context_len + len(oracle_ancestors(parents, i)) - 1 for i in range(len(parents))]


def oracle_path(parents, tokens, target_argmax) -> list:
    """The deepest node whose every step down from the root is taken: the step to child c of p is taken when c is
    the first child of p (in node order) whose token is target_argmax[p]. (At most one child of a node is taken,
    so those nodes form one path.)"""
    n = len(parents)

    first = {}                                   # parent -> its first child with the argmax's token
    for x in range(n - 1, 0, -1):
        if tokens[x] == target_argmax[parents[x]]:
            first[parents[x]] = x
    accepted = [i for i in range(n) if all(first.get(parents[c]) == c for c in oracle_ancestors(parents, i)[:-1])]
    deepest = max(accepted, key=lambda i: len(oracle_ancestors(parents, i)))
    return oracle_ancestors(parents, deepest)[::-1]


# -- the tree mask -----------------------------------------------------------------------------------------------
T, F = True, False


def test_the_mask_of_the_worked_example():
    assert mask_of(EXAMPLE) == [
        [T, F, F, F, F, F],        # the root sees itself
        [T, T, F, F, F, F],
        [T, F, T, F, F, F],        # not node 1, its sibling
        [T, T, F, T, F, F],        # its parent, and the root: every ancestor
        [T, T, F, F, T, F],        # not node 3, its sibling
        [T, F, T, F, F, T],        # not nodes 3, 4, its cousins
    ]


def test_a_chain_gets_the_causal_mask():
    assert mask_of([-1, 0, 1, 2, 3, 4]) == [[j <= i for j in range(6)] for i in range(6)]


def test_a_star_sees_only_the_root_and_itself():
    assert mask_of([-1, 0, 0, 0, 0]) == [[j == 0 or j == i for j in range(5)] for i in range(5)]


def test_the_root_alone_sees_itself():
    assert mask_of([-1]) == [[True]]


def test_a_deep_node_sees_every_ancestor_not_only_its_parent():
    # 0 - 1 - 2 - 3 - 4, and 5 - 6 under node 1: node 4 sees 0..4, node 6 sees 0, 1, 5, 6 and not 2, 3, 4
    parents = [-1, 0, 1, 2, 3, 1, 5]
    m = mask_of(parents)
    assert m[4] == [T, T, T, T, T, F, F], f"node 4's row: {m[4]}"
    assert m[6] == [T, T, F, F, F, T, T], f"node 6's row: {m[6]}"
    assert m[5] == [T, T, F, F, F, T, F], f"node 5's row: {m[5]}"
    assert m == oracle_mask(parents)


def test_a_node_never_sees_a_later_node_its_descendants_included():
    # the rows are what each node attends to: its ancestors (earlier nodes), never its children
    m = mask_of([-1, 0, 1, 1, 0, 4, 4, 6])
    assert all(not m[i][j] for i in range(8) for j in range(i + 1, 8)), f"a node sees a later node: {m}"
    assert m == oracle_mask([-1, 0, 1, 1, 0, 4, 4, 6])


# -- positions -------------------------------------------------------------------------------------------------
def test_positions_of_the_worked_example():
    assert positions_of(EXAMPLE, 7) == [7, 8, 8, 9, 9, 9]


def test_the_root_sits_at_the_context_length():
    assert positions_of([-1], 13) == [13]
    assert positions_of([-1, 0, 1], 0) == [0, 1, 2]
    assert positions_of([-1, 0, 0, 0, 0], 100) == [100, 101, 101, 101, 101]


def test_siblings_and_cousins_share_a_position():
    # depths 0 | 1 1 1 | 2 2 2 | 3 | 4: node i is not at context + i
    parents = [-1, 0, 0, 0, 1, 2, 3, 4, 7]
    assert positions_of(parents, 3) == [3, 4, 4, 4, 5, 5, 5, 6, 7]


def test_positions_then_the_mask_from_the_same_list():
    """The engine's order: positions, then the mask, from one parent list (built by the proposer)."""
    parents = [-1, 0, 1, 0, 3, 4, 3]
    engine_list = list(parents)
    pos = exercises.get("tree_mask.positions")(engine_list, 20)
    mask = exercises.get("tree_mask.ancestor_mask")(engine_list)
    assert engine_list == parents, f"the parent list changed under the engine: {engine_list}"
    assert list(pos) == [20, 21, 22, 21, 22, 23, 22]
    assert mask.tolist() == oracle_mask(parents)


# -- the accepted path -------------------------------------------------------------------------------------------
# EXAMPLE's tokens: the root 9, then 10 ("a"), 11 ("b"), 12 ("c"), 13 ("d"), 14 ("e"); target_argmax[i] is the
# target's next token after node i. Each case: (parents, tokens, target_argmax, the accepted path).
TOK = [9, 10, 11, 12, 13, 14]
CASES = {
    "first_children_to_a_leaf": (EXAMPLE, TOK, [10, 12, 0, 50, 51, 52], [0, 1, 3]),
    "the_stubs_example_a_later_sibling_below": (EXAMPLE, TOK, [10, 13, 0, 50, 51, 52], [0, 1, 4]),
    "a_later_sibling_at_the_root": (EXAMPLE, TOK, [11, 12, 14, 50, 51, 52], [0, 2, 5]),
    "every_draft_rejected": (EXAMPLE, TOK, [99, 12, 14, 50, 51, 52], [0]),
    # node 5 (14) is the argmax after node 2, but node 2 itself was rejected: nothing below it counts
    "nothing_accepted_below_a_rejection": (EXAMPLE, TOK, [10, 99, 14, 50, 51, 52], [0, 1]),
    # node 2's token (11) is the argmax *at node 2*, not at the root: only the argmax at the parent counts
    "the_argmax_at_the_parent_not_at_the_child": (EXAMPLE, TOK, [10, 13, 11, 0, 0, 0], [0, 1, 4]),
    # two siblings with the same token: the first in node order, and the path goes on below it
    "equal_siblings_the_first_in_node_order": ([-1, 0, 0, 1, 2], [9, 10, 10, 12, 13], [10, 12, 13, 0, 0],
                                               [0, 1, 3]),
    "a_chain_keeps_a_prefix": ([-1, 0, 1, 2, 3], [5, 6, 7, 8, 9], [6, 7, 0, 9, 1], [0, 1, 2]),
    "a_whole_chain_accepted": ([-1, 0, 1, 2], [5, 6, 7, 8], [6, 7, 8, 30], [0, 1, 2, 3]),
    "the_root_alone": ([-1], [5], [7], [0]),
    # depth 3 through later siblings at every level; node index and depth differ all the way down
    "later_siblings_all_the_way_down": ([-1, 0, 0, 0, 3, 3, 5, 5], [1, 2, 3, 4, 5, 6, 7, 8],
                                        [4, 9, 9, 6, 9, 8, 9, 9], [0, 3, 5, 7]),
    # the root's token equals the argmax at the root: it is not a draft, never compared
    "the_roots_own_token_is_not_compared": ([-1, 0, 0], [10, 11, 10], [10, 0, 0], [0, 2]),
    # two siblings with the same token: the first is taken even when the second's branch would go deeper
    "equal_siblings_the_first_even_when_a_later_goes_deeper": ([-1, 0, 0, 2], [9, 10, 10, 12], [10, 50, 12, 0],
                                                                [0, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_accepted_path(case):
    parents, tokens, argmax, want = CASES[case]
    assert oracle_path(parents, tokens, argmax) == want          # the case is what the rule says
    assert path_of(parents, tokens, argmax) == want, f"parents {parents}, tokens {tokens}, argmax {argmax}"


def test_token_ids_are_compared_by_value():
    # token ids past 256 (GPT-2's vocabulary runs to 50256): equal ids need not be the same Python object
    parents, tokens, argmax, want = CASES["later_siblings_all_the_way_down"]
    big = [int(str(t + 50000)) for t in tokens], [int(str(t + 50000)) for t in argmax]
    assert path_of(parents, *big) == want, f"tokens {big[0]}, argmax {big[1]}: compare token ids with ==, not is"


# -- random trees ----------------------------------------------------------------------------------------------
@st.composite
def parent_lists(draw, max_nodes=64):
    n = draw(st.integers(1, max_nodes))
    shape = draw(st.sampled_from(["random", "deep", "wide", "chain", "star"]))
    parents = [-1]
    for i in range(1, n):
        if shape == "chain":
            p = i - 1
        elif shape == "star":
            p = 0
        elif shape == "deep":                    # long paths that fork now and then
            p = draw(st.integers(max(0, i - 2), i - 1))
        elif shape == "wide":                    # a few nodes with many children
            p = draw(st.integers(0, min(i - 1, 2)))
        else:
            p = draw(st.integers(0, i - 1))
        parents.append(p)
    return parents


@st.composite
def verified_trees(draw):
    """(parents, tokens, target_argmax): the argmax after a node is mostly one of its children's tokens (so paths
    run deep); siblings' tokens are distinct (as a drafter's top-k are) or, in some trees, may repeat."""
    parents = draw(parent_lists())
    n = len(parents)
    repeats = draw(st.booleans())
    kids = [[c for c in range(1, n) if parents[c] == i] for i in range(n)]
    tokens = [draw(st.integers(0, 255))] + [0] * (n - 1)
    for i in range(n):
        for rank, c in enumerate(kids[i]):
            tokens[c] = draw(st.integers(0, 2)) if repeats else 10 * draw(st.integers(0, 3)) + rank
    argmax = []
    for i in range(n):
        if kids[i] and draw(st.integers(0, 3)):
            argmax.append(tokens[draw(st.sampled_from(kids[i]))])
        else:
            argmax.append(draw(st.integers(0, 255)))
    return parents, tokens, argmax


# Derandomized (every student gets the same examples) and no shrinking (a wrong answer fails in seconds, shown
# as found; the trees are at most 64 nodes).
_settings = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                     phases=[Phase.explicit, Phase.generate],
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CHAIN_64, STAR_64 = [-1] + list(range(63)), [-1] + [0] * 63


@_settings
@given(parent_lists())
@example([-1])
@example(CHAIN_64)
@example(STAR_64)
def test_random_trees_mask(parents):
    assert mask_of(parents) == oracle_mask(parents), f"parents {parents}"


@_settings
@given(parent_lists(), st.integers(0, 448))
@example([-1], 0)
@example(CHAIN_64, 448)
@example(STAR_64, 5)
def test_random_trees_positions(parents, context_len):
    assert positions_of(parents, context_len) == oracle_positions(parents, context_len), \
        f"parents {parents}, context_len {context_len}"


@_settings
@given(verified_trees())
@example(([-1], [3], [3]))
@example((CHAIN_64, list(range(64)), list(range(1, 64)) + [7]))
@example((STAR_64, list(range(64)), [63] + [0] * 63))
def test_random_trees_accepted_path(case):
    parents, tokens, argmax = case
    want = oracle_path(parents, tokens, argmax)
    assert path_of(parents, tokens, argmax) == want, f"parents {parents}, tokens {tokens}, argmax {argmax}"
    far = [t + 1000 for t in tokens], [t + 1000 for t in argmax]      # ids past 256: new int objects each
    assert path_of(parents, *far) == want, f"token ids past 256 (compare with ==, not is): parents {parents}, " \
                                           f"tokens {far[0]}, argmax {far[1]}"


# -- the engine on your functions --------------------------------------------------------------------------------
def slots(block_tables, starts, counts, block_size, device="cpu"):
    """The engine's slot mapping (exercise 1's formula), here so that this part needs no other part of yours."""
    return torch.tensor([t[p // block_size] * block_size + p % block_size for t, s, n in zip(block_tables, starts, counts)
                         for p in range(s, s + n)], dtype=torch.int64).to(device)


def yours():
    """exercises.patch_engine for this part alone, when it is selected (else the engine's own functions)."""
    return exercises.patch_engine(",".join(exercises.selected() & {"tree_mask"}))


def test_the_engines_metadata_for_a_tree_step_uses_your_positions_and_mask(monkeypatch):
    """AttentionMetadata.build: a tree after 5 cached tokens, a plain decode, a tree after 9: the positions the model
    reads and the per-row bitmaps the attention backends mask by."""
    import minibatch.kv.metadata as attention
    monkeypatch.setattr(attention, "_slot_mapping", slots)
    trees = [EXAMPLE, None, [-1, 0, 1, 1, 0]]
    ctx, new = [5, 3, 9], [6, 1, 5]
    with yours():
        md = attention.AttentionMetadata.build([[4, 1, 6], [0], [2, 3, 5, 7]], ctx, new, 4, tree_parents=trees)
    want_pos = oracle_positions(EXAMPLE, 5) + [3] + oracle_positions(trees[2], 9)
    assert md.positions.tolist() == want_pos

    def bits(parents):          # bit j of row i: node i sees node j (no tree here reaches bit 63, the sign bit)
        return [sum(1 << j for j, seen in enumerate(row) if seen) for row in oracle_mask(parents)]
    assert md.tree_bits.tolist() == bits(EXAMPLE) + [-1] + bits(trees[2])


class ToyPool:
    """What the engine asks of its block allocator, in plain Python (not exercise 6's: no sharing, no prefix
    cache), so that this part needs only yours: blocks handed out in id order, given back on truncate and free."""
    hits = queries = 0

    def __init__(self, num_blocks, block_size, enable_prefix_caching=False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_ids, self.tables, self.slots = list(range(num_blocks))[::-1], {}, {}

    def blocks_needed(self, n):
        return -(-n // self.block_size)

    @property
    def num_free_blocks(self):
        return len(self.free_ids)

    def can_allocate(self, tokens):
        return self.blocks_needed(len(tokens)) <= len(self.free_ids)

    def allocate(self, seq_id, tokens):
        self.tables[seq_id], self.slots[seq_id] = [], 0
        self.append_slots(seq_id, len(tokens))
        return 0                                                     # no prefix-cache hit: compute it all

    def append_slots(self, seq_id, n):
        table = self.tables[seq_id]
        grow = self.blocks_needed(self.slots[seq_id] + n) - len(table)
        assert grow <= len(self.free_ids), "the toy pool ran out of blocks (the test's pool is too small)"
        table += [self.free_ids.pop() for _ in range(grow)]
        self.slots[seq_id] += n
        return []                                                    # nothing shared: no copy-on-write

    def truncate(self, seq_id, n):
        table, keep = self.tables[seq_id], self.blocks_needed(n)
        self.free_ids += table[keep:][::-1]
        del table[keep:]
        self.slots[seq_id] = n

    def mark_computed(self, seq_id, n, tokens):
        pass

    def free(self, seq_id):
        self.truncate(seq_id, 0)
        del self.tables[seq_id], self.slots[seq_id]

    def has_seq(self, seq_id):
        return seq_id in self.tables

    def block_table(self, seq_id):
        return list(self.tables[seq_id])

    def num_slots(self, seq_id):
        return self.slots[seq_id]

    def ref_counts(self):
        used = {b for t in self.tables.values() for b in t}
        return [int(b in used) for b in range(self.num_blocks)]

    def cached_block_ids(self):
        return []


def all_at_once():
    """A toy scheduler, far simpler than exercise 7's: every request at once (the budget and the pool here hold
    them all), the whole prompt in one step, then the last token and all of its drafts every step."""
    from minibatch.engine.scheduler import ScheduledSeq, SchedulerBase

    class AllAtOnce(SchedulerBase):
        def _fill(self, out):
            for seq in list(self.running):
                spec = list(seq.spec_token_ids)
                out.cow_copies += self.allocator.append_slots(seq.seq_id, 1 + len(spec))
                out.scheduled.append(ScheduledSeq(seq, 1 + len(spec), seq.num_computed_tokens, seq.phase,
                                                  spec_token_ids=spec))
            while len(self.waiting):
                seq = self.waiting.peek()
                self._start(seq, out)
                out.scheduled.append(ScheduledSeq(seq, seq.num_uncomputed_tokens, seq.num_computed_tokens, seq.phase))
    return AllAtOnce


# short, and enough for some steps to keep a path through a later sibling (the drafter's second guess)
PROMPTS = ["def main():\n    ", "class Stack:\n    def push(self", "    def __init__(self"]
LENGTHS = [24, 40, 40]


def test_the_engine_decodes_greedily_with_eagle_trees_on_your_functions(target_model, monkeypatch):
    """EAGLE-2's dynamic trees (6 drafts, depth 3, top-2) verified on your mask, positions and accepted path: the
    greedy text equals generation without any cache, token for token. (A toy block pool and scheduler, and the
    slot mapping above: nothing here needs another exercise of yours.)"""
    import minibatch.engine.engine as engine
    import minibatch.kv.metadata as attention
    from minibatch import LLM, SamplingParams
    from minibatch.sampling.reference import generate
    from minibatch.model.tokenizer import encode
    from minibatch.trace import TraceRecorder
    want = [generate(target_model, encode(p), SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(PROMPTS, LENGTHS)]
    monkeypatch.setattr(engine, "BlockAllocator", ToyPool)
    monkeypatch.setattr(engine, "Scheduler", all_at_once())
    monkeypatch.setattr(attention, "_slot_mapping", slots)
    with yours():
        llm = LLM(target_model, enable_prefix_caching=False,
                  speculative_config={"method": "eagle", "tree": "dynamic", "num_draft_tokens": 6, "depth": 3,
                                      "topk": 2})
        rec = TraceRecorder()
        llm.llm_engine.add_hook(rec)
        outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=m) for m in LENGTHS], use_tqdm=False)
    for o, w in zip(outs, want):
        assert o.outputs[0].token_ids == w, f"request {o.request_id}: the text differs from greedy decoding"
    pool = llm.llm_engine.allocator
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    # Each tree step must have kept the path the greedy text implies: from the root (the token at position
    # num_computed_before), the first child carrying the next greedy token, and so on (a path that stops short
    # loses no text, but it is not the longest accepted one). Steps whose tree reaches past the text are skipped.
    full = {str(o.request_id): encode(p) + w for o, p, w in zip(outs, PROMPTS, want)}
    checked = later = 0
    for s in (s for t in rec.traces for s in t.scheduled if s.draft_parents):
        seq, parents, tokens = full[s.request_id], s.draft_parents, [None] + s.draft_token_ids
        path, at = [0], s.num_computed_before + 1
        while at < len(seq):
            nxt = next((c for c in range(1, len(parents)) if parents[c] == path[-1] and tokens[c] == seq[at]), None)
            if nxt is None:
                break
            path.append(nxt)
            at += 1
        if at == len(seq):
            continue
        assert s.accepted_path == path, (f"request {s.request_id} at position {s.num_computed_before}: tree "
                                         f"{parents}, drafts {s.draft_token_ids}: accepted {s.accepted_path}, "
                                         f"want {path}")
        checked += 1
        later += any(c != min(x for x in range(1, len(parents)) if parents[x] == parents[c]) for c in path[1:])
    assert checked >= 10 and later >= 1, f"{checked} tree steps checked, {later} through a later sibling"
