"""Tree speculation end to end (Medusa's static tree, EAGLE-2's dynamic tree): lossless, and nothing lost.

Greedy: the output equals plain greedy decoding token for token, for several tree shapes and sizes, under
cache pressure with preemption, with prefix caching, with chunked prefill, on every attention backend; the
allocator's invariants hold after every step, and runs do take paths through later siblings (so the
accepted path's K/V really moved). The cache then holds exactly what a plain prefill of the same tokens
writes. Sampled: the first three tokens follow the target's exact joint law (chi-square at the 0.001
level, as tests/test_spec_methods.py). Bad trees are refused at construction.
"""
from types import SimpleNamespace

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.model.weights import WEIGHTS_DIR
from minibatch.kv.tree import depths as tree_depths
from minibatch.stats import spec_stats
from minibatch.trace import TraceRecorder
from test_engine import PROMPTS
from test_spec_methods import GREEDY, N_SAMPLES, PROMPT, chi_square, exact, refs  # noqa: F401 (fixtures)

HAVE = {m: (WEIGHTS_DIR / f"{m}.safetensors").exists() for m in ("medusa", "eagle")}
TREES = {
    "eagle dynamic (defaults)": {"method": "eagle", "tree": "dynamic"},
    "eagle dynamic 6/3/2": {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 6, "depth": 3, "topk": 2},
    "eagle dynamic topk 1": {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 4, "depth": 4, "topk": 1},
    "medusa static (shipped)": {"method": "medusa", "tree": "static"},
    "medusa static 32": {"method": "medusa", "tree": "static", "num_draft_tokens": 32},
    "medusa choices": {"method": "medusa", "tree": [(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]},
}
CASES = {
    "plain": {},
    "prefix cache": dict(max_num_seqs=3),
    "preemption": dict(block_size=8, num_gpu_blocks=30, max_num_seqs=8),
    "chunked prefill, block 4": dict(max_num_batched_tokens=40, block_size=4),
}


def need(spec):
    if not HAVE[spec["method"]]:
        pytest.skip(f"no shipped {spec['method']} checkpoint")


def run(target, spec, params=GREEDY, prompts=PROMPTS, **cfg):
    need(spec)
    llm = LLM(target, speculative_config=spec, **cfg)
    eng = llm.llm_engine
    rec = TraceRecorder()
    eng.add_hook(rec)
    eng.add_hook(lambda t: eng.allocator.check_invariants(eng.scheduler.live_seq_ids()))
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng.allocator.check_invariants()
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks, "blocks leaked"
    assert not eng.proposer.__dict__.get("state"), "per-sequence state leaked"
    return outs, rec.traces, llm


def tree_steps(traces):
    return [s for t in traces for s in t.scheduled if s.draft_parents]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(TREES))
def test_greedy_equals_plain(target_model, refs, name, case):
    outs, traces, _ = run(target_model, TREES[name], **CASES[case])
    for o, ref in zip(outs, refs):
        assert o.outputs[0].token_ids == ref
    steps = tree_steps(traces)
    assert steps and sum(s.accepted for s in steps) > 0
    for s in steps:                                     # the trace is self-consistent
        assert len(s.draft_parents) == s.proposed + 1 and s.accepted_path[0] == 0
        assert len(s.accepted_path) == s.accepted + 1 and s.new_token_ids[:s.accepted] == \
            [s.draft_token_ids[i - 1] for i in s.accepted_path[1:]]
    # each request's own counters (the scheduler's) agree with its steps in the traces, by depth too
    for o in outs:
        own = spec_stats([SimpleNamespace(scheduled=[x for x in t.scheduled if x.request_id == o.request_id])
                          for t in traces])
        assert o.outputs[0].spec["acceptance_by_position"] == own.acceptance_by_position
        assert len(own.reached_at) <= max([max(tree_depths(x.draft_parents)) for x in steps])
    if case == "preemption":
        assert sum(len(t.preempted) for t in traces) > 0, "meant to force preemption"
    if case == "prefix cache":
        assert traces[-1].prefix_cache_hits > 0


@pytest.mark.parametrize("name", ["eagle dynamic (defaults)", "medusa static (shipped)"])
def test_paths_through_later_siblings_happen(target_model, name):
    """A path that is not the tree's first branch is what makes trees pay, and what moves K/V."""
    _, traces, _ = run(target_model, TREES[name])
    moved = [s for s in tree_steps(traces) if any(n != j for j, n in enumerate(s.accepted_path))]
    assert len(moved) >= 3, "no accepted path went through a later sibling: the test proves nothing"


@pytest.mark.parametrize("backend", ["loop", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_greedy_equals_plain_on_other_backends(target_model, refs, backend):
    spec = dict(TREES["eagle dynamic 6/3/2"])
    outs, _, _ = run(target_model, spec, prompts=PROMPTS[:3], params=GREEDY[:3], attention_backend=backend,
                     block_size=8)
    assert [o.outputs[0].token_ids for o in outs] == refs[:3]
    spec = TREES["medusa choices"]
    outs, _, _ = run(target_model, spec, prompts=PROMPTS[:2], params=GREEDY[:2], attention_backend=backend)
    assert [o.outputs[0].token_ids for o in outs] == refs[:2]


def cached_kv(llm, seq_id, n):
    """The K/V of a live sequence's first n positions, every layer: [L, 2, n, Hkv, D]."""
    eng = llm.llm_engine
    table, bs = eng.allocator.block_table(seq_id), eng.config.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    kv = eng.kv_cache.kv[: eng.model.config.n_layer]
    L, _, N, _, H, D = kv.shape
    return kv.reshape(L, 2, N * bs, H, D)[:, :, slots]


@pytest.mark.parametrize("name", ["eagle dynamic (defaults)", "medusa static (shipped)"])
def test_cache_after_trees_equals_a_plain_prefill(target_model, name):
    """After tree steps, a sequence's cached K/V is what a prefill of its tokens writes (the path moved
    right, and nothing rejected was left among them)."""
    need(TREES[name])
    llm = LLM(target_model, speculative_config=TREES[name], block_size=8)
    eng = llm.llm_engine
    eng.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=60))
    moved = []
    eng.add_hook(lambda t: moved.extend(s for s in t.scheduled if any(n != j for j, n in enumerate(s.accepted_path))))
    while not moved or not eng.scheduler.running[0].is_decoding:
        eng.step()
    seq = eng.scheduler.running[0]
    n = seq.num_computed_tokens
    got = cached_kv(llm, seq.seq_id, n)
    plain = LLM(target_model, block_size=8)
    plain.llm_engine.add_request("b", seq.token_ids[:n] + [0], SamplingParams(temperature=0, max_tokens=2))
    plain.llm_engine.step()                         # one prefill of the same n tokens (+ one we do not compare)
    want = cached_kv(plain, "b", n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["eagle dynamic 6/3/2", "medusa static (shipped)"])
def test_sampled_tokens_are_distributed_as_the_target(target_model, exact, name):  # noqa: F811
    # max_tokens 4: the verify after the first token drafts a tree 2 deep, so tokens 2 and 3 can both come from
    # it (an accepted child and grandchild, a correction below an accepted child, ...): the walk down the tree
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=2000 + i) for i in range(N_SAMPLES)]
    outs, traces, _ = run(target_model, TREES[name], params=params, prompts=[PROMPT] * N_SAMPLES, max_num_seqs=64)
    steps = tree_steps(traces)
    assert len(steps) > N_SAMPLES // 2 and sum(s.accepted for s in steps) > N_SAMPLES // 4
    assert sum(s.accepted >= 2 for s in steps) > N_SAMPLES // 20, "no path went two deep: the walk is untested"
    import numpy as np
    chi2, crit = chi_square(np.array([o.outputs[0].token_ids[:3] for o in outs]), exact)
    assert chi2 < crit, f"{name}: chi-square {chi2:.1f} rejects the target's joint law at 0.001 ({crit:.1f})"


@pytest.mark.parametrize("spec,match", [
    ({"method": "ngram", "num_speculative_tokens": 3, "tree": "dynamic"}, "cannot make a token tree"),
    ({"method": "draft", "num_speculative_tokens": 3, "tree": "static"}, "cannot make a token tree"),
    ({"method": "eagle", "tree": "static"}, "'dynamic'"),
    ({"method": "medusa", "tree": "dynamic"}, "'static'"),
    ({"method": "medusa", "tree": [(0,), (0, 0), (1, 1)]}, "no parent"),
    ({"method": "medusa", "tree": [(0,), (0,)]}, "duplicate"),
    ({"method": "medusa", "tree": []}, "at least one choice"),
    ({"method": "medusa", "tree": "static", "num_draft_tokens": 7}, "shipped"),
    ({"method": "medusa", "tree": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]}, "heads"),
    ({"method": "eagle", "tree": "dynamic", "num_draft_tokens": 64}, "num_draft_tokens"),
    ({"method": "eagle", "tree": "dynamic", "num_draft_tokens": 30, "depth": 2, "topk": 2}, "grows only"),
    ({"method": "eagle", "tree": "dynamic", "depth": 3, "num_speculative_tokens": 4}, "disagree"),
    ({"method": "eagle", "num_speculative_tokens": 3, "topk": 4}, "token tree"),
    ({"method": "medusa", "tree": "static", "acceptance": "typical"}, "typical"),
])
def test_bad_trees_are_refused_at_construction(target_model, spec, match):
    need(spec) if spec["method"] in HAVE else None
    with pytest.raises(ValueError, match=match):
        LLM(target_model, speculative_config=spec)


@pytest.mark.parametrize("name", ["eagle dynamic (defaults)", "medusa static (shipped)"])
@pytest.mark.parametrize("max_tokens", [26, 30, 31])
def test_static_batching_reserves_a_trees_lookahead(target_model, name, max_tokens):
    """A static batch reserves each member's blocks at full length up front and never preempts, so it must count
    the slots a tree's verify writes past the last token; a cache that holds only prompt + max_tokens for each
    (what it once reserved) ran out of blocks mid-batch."""
    need(TREES[name])
    prompts = [list(b"def f("), list(b"x = [1")]
    bs = 8
    tight = sum(-(-(len(p) + max_tokens) // bs) for p in prompts) + 1
    params = [SamplingParams(temperature=0, max_tokens=max_tokens)] * 2
    outs, _, _ = run(target_model, TREES[name], params=params, prompts=prompts, scheduling="static", block_size=bs,
                     num_gpu_blocks=tight)
    plain = LLM(target_model).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_a_dynamic_tree_with_k_left_empty_takes_its_default_depth(target_model):
    need({"method": "eagle"})
    llm = LLM(target_model, speculative_config={"method": "eagle", "tree": "dynamic", "num_speculative_tokens": None})
    assert llm.llm_engine.proposer.k == 5 and llm.llm_engine.proposer.tree["depth"] == 5


def test_a_tree_larger_than_the_token_budget_is_refused(target_model):
    need({"method": "eagle"})
    with pytest.raises(ValueError, match="token budget"):
        LLM(target_model, speculative_config={"method": "eagle", "tree": "dynamic", "num_draft_tokens": 20},
            max_num_batched_tokens=16, block_size=8)
