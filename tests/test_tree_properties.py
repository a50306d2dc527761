"""Token trees under random shapes and random cache pressure (hypothesis): nothing lost, nothing changed.

Each example draws a tree (Medusa choices of any shape up to the heads' depth, or EAGLE-2's dynamic tree at any
size), a block size, a cache small enough to preempt, a token budget, each request's max_tokens, and continuous
or static batching (whose batches reserve every block a member can need, a tree's lookahead included). The
engine then runs a few code prompts greedily, and after every step the allocator's invariants hold for the
live sequences (ref counts, free list, hash chains, nothing owned twice); at the end every block is free and
every output is the plain greedy output cut at its max_tokens.
"""
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from minibatch import LLM, SamplingParams
from minibatch.sampling.reference import generate
from minibatch.model.weights import WEIGHTS_DIR, read_manifest

HAVE = {m: (WEIGHTS_DIR / f"{m}.safetensors").exists() for m in ("medusa", "eagle")}
PROMPTS = [list(p.encode()) for p in ("def parse(line):\n    ", "import os\nimport sys\n\n",
                                       "class Node:\n    def __init__(self, value):\n", "    for key, value in items:\n")]
LONGEST = 40


@pytest.fixture(scope="module")
def longest(target_model):
    return [generate(target_model, p, SamplingParams(temperature=0, max_tokens=LONGEST))[0] for p in PROMPTS]


@st.composite
def medusa_choices(draw, depth: int):
    """A prefix-closed set of rank tuples: each new node extends a node already in (or the root)."""
    nodes = []
    for _ in range(draw(st.integers(1, 20))):
        parent = draw(st.sampled_from([()] + [c for c in nodes if len(c) < depth]))
        rank = draw(st.integers(0, 5))
        if parent + (rank,) not in nodes:
            nodes.append(parent + (rank,))
    return nodes


@st.composite
def tree_configs(draw):
    method = draw(st.sampled_from([m for m, ok in HAVE.items() if ok] or ["none"]))
    if method == "medusa":
        return {"method": "medusa", "tree": draw(medusa_choices(read_manifest("medusa")["config"]["num_heads"]))}
    if method == "eagle":
        depth, topk = draw(st.integers(1, 5)), draw(st.integers(1, 4))
        grown = topk + (depth - 1) * topk * topk
        return {"method": "eagle", "tree": "dynamic", "depth": depth, "topk": topk,
                "num_draft_tokens": draw(st.integers(1, min(grown, 24)))}
    return None


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=tree_configs(), block_size=st.sampled_from([4, 8, 16]), spare_blocks=st.integers(0, 12),
       max_tokens=st.lists(st.integers(1, LONGEST), min_size=len(PROMPTS), max_size=len(PROMPTS)),
       budget=st.sampled_from([32, 64, 512]), scheduling=st.sampled_from(["continuous", "static"]))
def test_random_trees_under_pressure_lose_nothing(target_model, longest, spec, block_size, spare_blocks,
                                                  max_tokens, budget, scheduling):
    if spec is None:
        pytest.skip("no shipped medusa or eagle checkpoint")
    # the fewest blocks one request can ever need (its prompt, outputs and a tree's lookahead), plus spare ones
    need = max(len(p) + m + 25 for p, m in zip(PROMPTS, max_tokens))
    blocks = -(-need // block_size) + spare_blocks
    llm = LLM(target_model, speculative_config=spec, block_size=block_size, num_gpu_blocks=blocks,
              max_num_batched_tokens=budget, max_num_seqs=4, scheduling=scheduling)
    eng = llm.llm_engine
    preempted = []
    eng.add_hook(lambda t: eng.allocator.check_invariants(eng.scheduler.live_seq_ids()))
    eng.add_hook(lambda t: preempted.extend(t.preempted))
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    for o, ref, m in zip(outs, longest, max_tokens):
        assert o.outputs[0].token_ids == ref[:m], spec
    eng.allocator.check_invariants()
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "blocks leaked"
    event(f"{spec['method']}, {scheduling}: {'preempted' if preempted else 'no preemption'}")
