"""The Llama's own speculative heads (Medusa, EAGLE, early exit, EAGLE-3), trained on its hidden states.

Lossless: greedy output equals plain decoding on ``LLM("llama")`` token for token for every method, in chains
and in trees (Medusa's static tree, EAGLE-2's and EAGLE-3's dynamic ones), with prefix hits and preemption;
sampled output follows the Llama's exact joint law of its first three tokens (chi-square at 0.001, the GPT's
helpers) for one chain and one tree. EAGLE-3's training-time test attends as drafting does: its rollout equals
running the head entry by entry over the explicit sequence. Refusals: a head trained on another checkpoint
names both; ``eagle3`` on a model without its head names the head it needs.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.model.eagle3_head import Eagle3Head
from minibatch.model.head_objectives import eagle3_rollout
from minibatch.model.heads import head_for, load_head
from minibatch.model.llama import Llama, LlamaConfig
from minibatch.model.training import batched_causal_attention
from minibatch.model.weights import WEIGHTS_DIR, head_preset, load_model
from minibatch.sampling.reference import generate
from minibatch.trace import TraceRecorder
from test_spec_methods import N_SAMPLES, PROMPT, chi_square, exact_joint

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ("medusa", "eagle", "early_exit", "eagle3")
HAVE = {k: (WEIGHTS_DIR / f"{head_preset(k, 'llama')}.safetensors").exists() for k in KINDS}
PROMPTS = [list(b"def fib(n):\n    "), list(b"import os\nimport sys\n"), list(b"def fib(n):\n    return"),
           list(b"class Stack:\n    def push(self, x):\n")]
MAX_TOKENS = [24, 20, 28, 16]
SPECS = {
    "medusa k4": {"method": "medusa", "num_speculative_tokens": 4},
    "medusa static tree": {"method": "medusa", "tree": "static", "num_draft_tokens": 8},
    "eagle k3": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle dynamic tree": {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 8, "depth": 3, "topk": 2},
    "early_exit k3": {"method": "early_exit", "num_speculative_tokens": 3},
    "eagle3 k4": {"method": "eagle3", "num_speculative_tokens": 4},
    "eagle3 dynamic tree": {"method": "eagle3", "tree": "dynamic", "num_draft_tokens": 8, "depth": 3, "topk": 2},
}


def need(method):
    if not HAVE[method]:
        pytest.skip(f"no shipped {head_preset(method, 'llama')} (python -m minibatch.model.train --preset {method} "
                    f"--model llama)")


@pytest.fixture(scope="module")
def llama():
    if not (WEIGHTS_DIR / "llama.json").exists():
        pytest.skip("the shipped llama is trained by python -m minibatch.model.train --preset llama")
    return load_model("llama", device="cpu")


@pytest.fixture(scope="module")
def llama_refs(llama):
    return [generate(llama, p, SamplingParams(temperature=0, max_tokens=m))[0] for p, m in zip(PROMPTS, MAX_TOKENS)]


def run(model, spec, params, prompts, **cfg):
    llm = LLM(model, speculative_config=spec, **cfg)
    rec = TraceRecorder()
    llm.llm_engine.add_hook(rec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    a = llm.llm_engine.allocator
    a.check_invariants()
    assert a.num_free_blocks == a.num_blocks, "blocks leaked"
    assert not getattr(llm.llm_engine.proposer, "state", None), "per-sequence state leaked"
    return outs, [s for t in rec.traces for s in t.scheduled]


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_equals_plain_decoding_on_the_llama(llama, llama_refs, name):
    need(SPECS[name]["method"])
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    # 3 at a time: the third prompt finds the first's prefix cached; 24 blocks of 8 force a preemption
    outs, steps = run(llama, SPECS[name], params, PROMPTS, max_num_seqs=3, block_size=8, num_gpu_blocks=24)
    for o, ref in zip(outs, llama_refs):
        assert o.outputs[0].token_ids == ref, name
    assert sum(s.accepted for s in steps) > 0.3 * sum(MAX_TOKENS), f"{name}: the head hardly ever guessed right"


@pytest.fixture(scope="module")
def llama_exact(llama):
    return exact_joint(llama)


@pytest.mark.parametrize("name", ["eagle3 k4", "eagle dynamic tree"])
def test_sampled_tokens_are_distributed_as_the_llama(llama, llama_exact, name):
    spec = dict(SPECS[name])
    need(spec["method"])
    if "tree" not in spec:
        spec["num_speculative_tokens"] = 2
    # max_tokens 4: the verify after the first token decides tokens 2 and 3 (accepted, corrected or bonus)
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=3000 + i) for i in range(N_SAMPLES)]
    outs, steps = run(llama, spec, params, [PROMPT] * N_SAMPLES, max_num_seqs=64)
    assert sum(s.accepted for s in steps) > N_SAMPLES // 4, "too few accepted drafts to test the walk"
    chi2, crit = chi_square(np.array([o.outputs[0].token_ids[:3] for o in outs]), llama_exact)
    assert chi2 < crit, f"{name}: chi-square {chi2:.1f} rejects the Llama's joint law at 0.001 ({crit:.1f})"


def test_a_head_trained_on_another_checkpoint_is_refused_naming_both(llama, tmp_path):
    for suffix in (".json", ".safetensors"):            # the GPT's heads, shipped under the Llama's names
        shutil.copy(WEIGHTS_DIR / f"medusa{suffix}", tmp_path / f"llama_medusa{suffix}")
    with pytest.raises(ValueError, match=r"another checkpoint, 'target' \(SHA-256 b81c87532bfc.*not on this "
                                         r"'llama' \(f4e5c5653ff0"):
        LLM(llama, speculative_config={"method": "medusa", "num_speculative_tokens": 2, "model": str(tmp_path)})
    with pytest.raises(ValueError, match="'target'.*'llama'"):
        load_head("eagle", llama)                       # the GPT's own name, asked of the Llama


def test_eagle3_without_its_head_names_the_head_it_needs():
    gpt = load_model("target", device="cpu")
    with pytest.raises(ValueError, match=r"method 'eagle3' needs the head 'eagle3' .* trained on 'target'"):
        LLM(gpt, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    assert head_preset("eagle3", "llama") == "llama_eagle3" and head_preset("medusa", "target") == "medusa"
    with pytest.raises(ValueError, match="another checkpoint, 'target' .* not on this 'draft'"):
        head_for("medusa", load_model("draft", device="cpu"))      # no heads of its own: offered the GPT's


def test_eagle3s_training_rollout_attends_as_drafting_does():
    """Step j of the training-time test at row r = the head run over the explicit sequence: the true entries up
    to r, then the j entries it drafted from there, each reading the previous one's output."""
    torch.manual_seed(0)
    target = Llama(LlamaConfig("t", n_layer=3, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48)).eval()
    head = Eagle3Head.from_target(target, layers=(1, 2, 3)).eval()
    W, S, steps = 2, 16, 3
    toks = torch.randint(0, 256, (W, S + 1))
    hidden = {k: torch.randn(W, S, 32) for k in (1, 2, 3, "final")}
    w, idx = torch.arange(W), torch.arange(2, 11).repeat(W, 1)                         # rows: positions 2 .. 10
    with torch.no_grad():
        rolled = eagle3_rollout(head, target, toks, hidden, w, idx, steps)
        for b, r in ((0, 0), (0, 5), (1, 8)):
            pos = idx[b, : r + 1].tolist()
            ids = toks[b, pos].tolist()
            feats = head.fuse([hidden[i][b, idx[b, : r + 1] - 1] for i in head.layers])    # [r + 1, C]
            for j in range(steps):
                a = head(target, torch.tensor(ids), feats, torch.tensor(pos), batched_causal_attention(1, len(ids)), 0)
                torch.testing.assert_close(head.logits(target, a[-1]), rolled[j][1][b, r], atol=1e-4, rtol=1e-4)
                pos.append(pos[-1] + 1)                                                 # the next drafted entry
                ids.append(int(toks[b, pos[-1]]))
                feats = torch.cat([feats, a[-1:]])
