"""Medusa's static tree: chosen right (the most frequent rank prefixes are the best tree), shipped consistent with
the heads it was measured on, and drafted right (each node's token is its head's rank-r guess)."""
import itertools
import json

import numpy as np
import pytest
import torch

from minibatch.model.heads import MedusaHeads, load_head
from minibatch.model.weights import WEIGHTS_DIR, head_preset, read_manifest
from minibatch.kv import tree
from minibatch.spec_decode import medusa_tree
from minibatch.spec_decode.medusa import MedusaProposer

HAVE = (WEIGHTS_DIR / "medusa.safetensors").exists()
M = medusa_tree.MAX_RANK

# rank_1..rank_3 of the target's token in heads 0..2, at six positions (M = not in the top-k)
RANKS = np.array([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, M], [0, 0, 0], [2, M, 0]])


def test_prefix_counts_by_hand():
    c = medusa_tree.prefix_counts(RANKS)
    assert c[(0,)] == 4 and c[(0, 0)] == 3 and c[(0, 0, 0)] == 2 and c[(1,)] == 1 and c[(1, 0)] == 1
    assert c[(2,)] == 1 and (2, M) not in c and (2, M, 0) not in c, "a rank past the top-k ends the prefix"


def test_tau_counts_accepted_drafts_by_hand():
    # chain of 2: positions accept 2, 2, 1, 0, 2, 0 drafts -> tau = 1 + 7/6
    assert medusa_tree.tau([(0,), (0, 0)], RANKS) == pytest.approx(1 + 7 / 6)
    # a second child at the root adds position 3's (1,) and position 5's (2,) only if they are in the tree
    assert medusa_tree.tau([(0,), (0, 0), (1,)], RANKS) == pytest.approx(1 + 8 / 6)


def brute_force_best(ranks, n):
    counts = medusa_tree.prefix_counts(ranks)
    best = 0.0
    for subset in itertools.combinations(counts, n):
        if all(c[:-1] in subset or len(c) == 1 for c in subset):           # a tree: every prefix in it
            best = max(best, medusa_tree.tau(subset, ranks))
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [1, 3, 5])
def test_choose_finds_the_best_tree_of_n_nodes(seed, n):
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.geometric(0.6, size=(40, 3)) - 1, M)              # small ranks likelier, as real heads
    ch = medusa_tree.choose(medusa_tree.prefix_counts(ranks), n)
    assert len(ch) == n
    tree.from_choices(ch)                                                     # prefix-closed: a valid tree
    assert medusa_tree.tau(ch, ranks) == pytest.approx(brute_force_best(ranks, n))


def test_choose_refuses_more_nodes_than_seen():
    with pytest.raises(ValueError, match="distinct prefixes"):
        medusa_tree.choose(medusa_tree.prefix_counts(RANKS), 50)


@pytest.mark.parametrize("model", ["target", "llama"])
def test_the_shipped_trees_belong_to_the_shipped_heads_and_beat_the_chain(model):
    name = head_preset("medusa", model)                  # the GPT's medusa, the Llama's llama_medusa
    if not (WEIGHTS_DIR / f"{name}.safetensors").exists() or not medusa_tree.tree_file(model).exists():
        pytest.skip(f"no shipped {name} checkpoint or tree")
    doc = json.loads(medusa_tree.tree_file(model).read_text())
    assert doc["medusa_sha256"] == read_manifest(name)["sha256"], \
        f"the trees were measured on other heads: rerun python -m minibatch.bench.medusa_tree --model {model}"
    heads = read_manifest(name)["config"]["num_heads"]
    assert sorted(map(int, doc["trees"])) == list(medusa_tree.SIZES)
    taus = []
    for n in medusa_tree.SIZES:
        ch = medusa_tree.load_tree(n, model)
        parents, _ = tree.from_choices(ch)
        assert len(parents) == n + 1 and max(map(len, ch)) <= heads
        taus.append(doc["trees"][str(n)]["tau_held_out"])
    assert taus == sorted(taus) and taus[0] > doc["chain"]["tau_held_out"]
    assert medusa_tree.load_tree(None, model) == medusa_tree.load_tree(medusa_tree.DEFAULT_SIZE, model)


def test_an_unshipped_size_is_refused_naming_the_shipped_ones():
    with pytest.raises(ValueError, match=r"\[8, 16, 32\]"):
        medusa_tree.load_tree(7)


CHOICES = [(0,), (1,), (2,), (3,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (3, 0), (0, 0, 5)]


def test_each_node_is_its_heads_rank_r_guess():
    torch.manual_seed(0)
    heads = MedusaHeads(32, 40, num_heads=3)
    for p in heads.parameters():                      # not the identity start: every head differs
        p.data.normal_(0, 0.3)
    prop = MedusaProposer(heads, tree=CHOICES)
    parents, order = tree.from_choices(CHOICES)
    assert prop.parents == parents and prop.k == 3 and prop.tree_nodes == len(CHOICES)
    h = torch.randn(5, 32)
    got = prop.tree_tokens(h).tolist()                              # [B, N]
    logits = heads(h)                                               # [B, K, V], the unfused forward
    for b in range(5):
        want = [int(logits[b, len(c) - 1].argsort(descending=True)[c[-1]]) for c in order[1:]]
        assert got[b] == want
    assert prop.num_at_depth == [0, 4, 8, 10]                        # the nodes a budget of d keeps


@pytest.mark.parametrize("choices,k,match", [
    ([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], None, "3 heads"),
    ([(0,), (0, 0)], 3, "2 deep"),
    ([(0,), (50,)], None, "vocabulary"),
])
def test_bad_trees_are_refused(choices, k, match):
    heads = MedusaHeads(32, 40, num_heads=3)
    with pytest.raises(ValueError, match=match):
        MedusaProposer(heads, k, tree=choices)


@pytest.mark.skipif(not HAVE, reason="no shipped medusa checkpoint")
def test_the_shipped_heads_load_for_a_tree(target_model):
    prop = MedusaProposer(load_head("medusa", target_model), tree=medusa_tree.load_tree())
    assert prop.tree_nodes == medusa_tree.DEFAULT_SIZE and prop.num_lookahead_slots == prop.tree_nodes


@pytest.mark.parametrize("path,judged", [
    ([0], 1),                # nothing accepted: the root's children were judged
    ([0, 1], 2),             # node 1 accepted, its child 3 judged (and rejected)
    ([0, 1, 3], 2),          # a leaf reached: nothing below it was tried
    ([0, 2], 1),             # node 2 is a leaf
])
def test_judged_depths_by_hand(path, judged):
    parents = [-1, 0, 0, 1]                                  # root -> 1, 2; 1 -> 3
    assert tree.judged_depths(parents, path) == judged


class SameDevice(torch.utils._python_dispatch.TorchDispatchMode):
    """What CUDA does and "meta" does not: an op mixing a model-device tensor with a CPU tensor (not a 0-d scalar)
    raises. Run with the model on "meta", it shows on a CPU-only machine what would break on a GPU."""
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        devs = {x.device.type for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0}
        if len(devs) > 1:
            raise RuntimeError(f"{func}: tensors on {sorted(devs)}")
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not HAVE, reason="needs the shipped Medusa heads")
def test_ranks_follow_the_models_device(target_model):
    import copy
    target = copy.deepcopy(target_model).to("meta")
    heads = load_head("medusa", target)
    x = torch.randint(0, 256, (2, 24))                           # token ids on the CPU, as generate's lists give
    with SameDevice():
        with pytest.raises(RuntimeError, match="tensors on"):    # the check itself catches a mismatch
            target.wte.weight + torch.ones(target.wte.weight.shape[-1])
        ranks = medusa_tree.ranks_of(target, heads, x, prompt_len=8)
    K = heads.num_heads
    assert ranks.device.type == "meta" and ranks.shape == (2, 24 - 8 - K, K)
