"""Speculative decoding inside the engine: lossless for greedy, reproducible when seeded, no leaked blocks."""
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.model.model import GPT, GPTConfig
from minibatch.sampling.reference import generate
from minibatch.trace import TraceRecorder
from test_engine import MAX_TOKENS, PROMPTS

SPEC_CASES = [
    ("draft", 1, {}), ("draft", 3, {}), ("draft", 5, dict(block_size=8, num_gpu_blocks=26, max_num_seqs=8)),
    ("ngram", 2, {}), ("ngram", 4, dict(max_num_batched_tokens=16)),
    ("ngram", 5, dict(block_size=8, num_gpu_blocks=26, max_num_seqs=8, max_num_batched_tokens=32)),
    ("draft", 4, dict(max_num_batched_tokens=16, block_size=8, num_gpu_blocks=30)),
]


@pytest.fixture(scope="module")
def refs(target_model):
    return [generate(target_model, p, SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(PROMPTS, MAX_TOKENS)]


def run(target, draft, method, k, params=None, prompts=PROMPTS, **cfg):
    llm = LLM(target, draft_model=draft, speculative_config={"method": method, "num_speculative_tokens": k}, **cfg)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    params = params or [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    a = llm.llm_engine.allocator
    a.check_invariants()
    assert a.num_free_blocks == a.num_blocks
    prop = llm.llm_engine.proposer
    if hasattr(prop, "allocator"):
        prop.allocator.check_invariants()
        assert prop.allocator.num_free_blocks == prop.allocator.num_blocks, "draft cache leaked blocks"
    return outs, rec.traces


@pytest.mark.parametrize("method,k,cfg", SPEC_CASES)
def test_speculative_greedy_equals_plain(target_model, draft_model, refs, method, k, cfg):
    outs, traces = run(target_model, draft_model, method, k, **cfg)
    for o, ref in zip(outs, refs):
        assert o.outputs[0].token_ids == ref
    proposed = sum(s.proposed for t in traces for s in t.scheduled)
    accepted = sum(s.accepted for t in traces for s in t.scheduled)
    assert proposed > 0 and 0 < accepted <= proposed
    assert all(s.proposed <= k for t in traces for s in t.scheduled)
    if cfg.get("num_gpu_blocks") == 26:
        assert sum(len(t.preempted) for t in traces) > 0, "meant to force preemption"


def test_draft_acceptance_is_high_on_code(target_model, draft_model):
    outs, _ = run(target_model, draft_model, "draft", 3)
    prop = sum(o.outputs[0].spec["proposed"] for o in outs)
    acc = sum(o.outputs[0].spec["accepted"] for o in outs)
    assert acc / prop > 0.5, f"acceptance {acc / prop:.2f}: the distilled draft should mostly agree"


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_seeded_speculative_sampling_is_reproducible(target_model, draft_model, method):
    params = [SamplingParams(temperature=1.0, max_tokens=m, seed=10 + i) for i, m in enumerate(MAX_TOKENS)]
    a, ta = run(target_model, draft_model, method, 3, params=params)
    b, _ = run(target_model, draft_model, method, 3, params=params)
    c, _ = run(target_model, draft_model, method, 3, params=params[2:3], prompts=PROMPTS[2:3])
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert c[0].outputs[0].token_ids == a[2].outputs[0].token_ids, "independent of the rest of the batch"
    rejected = sum(s.proposed - s.accepted for t in ta for s in t.scheduled)
    assert rejected > 0, "temperature 1 should reject some drafts (the rollback path is exercised)"


def test_k_is_shortened_near_max_tokens(target_model, draft_model):
    outs, traces = run(target_model, draft_model, "draft", 8, params=[SamplingParams(temperature=0, max_tokens=3)],
                       prompts=[PROMPTS[0]])
    assert len(outs[0].outputs[0].token_ids) == 3
    assert all(s.proposed <= 1 for t in traces for s in t.scheduled)   # after the prefill token, 2 remain


@pytest.mark.parametrize("cfg,match", [
    ({"method": "draft", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "draft", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "unknown speculative method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown speculative_config"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "n_min"),
])
def test_bad_speculative_config(target_model, cfg, match):
    with pytest.raises(ValueError, match=match):
        LLM(target_model, speculative_config=cfg)


def test_draft_with_another_vocabulary_is_rejected(target_model):
    other = GPT(GPTConfig("odd", n_layer=1, n_head=2, n_embd=32, n_ctx=512, vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target_model, draft_model=other, speculative_config={"method": "draft", "num_speculative_tokens": 2})
