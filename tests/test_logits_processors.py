"""Sampling controls (sampling/logits_processors.py): the batched version equals the per-row reference; a verify
row counts the drafts before it; greedy output equals a slow oracle with and without speculation; sampled output
under the controls keeps its exact distribution under speculation (chi-square); stop_token_ids and min_tokens."""
import random

import numpy as np
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.sampling.logits_processors import apply_logits_processors, process_row_reference, process_rows
from minibatch.engine.scheduler import ScheduledSeq
from minibatch.engine.sequence import Request, Sequence
from minibatch.model.model import forward_sequences
from test_spec_methods import chi_square

CONTROLS = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.2),
    "presence": dict(presence_penalty=1.5),
    "logit_bias": dict(logit_bias={32: -6.0, 101: 4.0, 10: -100}),
    "min_tokens": dict(min_tokens=6, stop_token_ids=[10, 32]),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.4, logit_bias={40: 3.0}),
}
PROMPTS = ["def fib(n):\n    ", "class Stack:\n    def push(self, x):\n", "    "]


def random_params(rng):
    return SamplingParams(
        repetition_penalty=rng.choice([1.0, 0.7, 1.5]), frequency_penalty=rng.uniform(-2, 2),
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]), min_tokens=rng.choice([0, 3, 8]),
        stop_token_ids=rng.sample(range(256), rng.choice([0, 2])),
        logit_bias={rng.randrange(256): rng.uniform(-100, 100) for _ in range(rng.choice([0, 3]))})


@pytest.mark.parametrize("seed", range(5))
def test_batched_equals_the_per_row_reference(seed):
    rng = random.Random(seed)
    R = 7
    x = torch.randn(R, 256) * 4                                          # both signs, for the repetition rule
    x[0, :5] = float("-inf")                                             # already masked stays masked
    params = [random_params(rng) for _ in range(R)]
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 20))] for _ in range(R)]
    outputs = [[rng.choice([32, 10, 65, rng.randrange(256)]) for _ in range(rng.randrange(0, 12))] for _ in range(R)]
    got = process_rows(x, params, prompts, outputs)
    want = torch.tensor([process_row_reference(x[r].tolist(), params[r], prompts[r], outputs[r]) for r in range(R)])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not torch.equal(got, x), "no control changed anything: the inputs test nothing"


def _scheduled(prompt, output, drafts, params, parents=None):
    req = Request("r", "", prompt, params)
    seq = Sequence("r", req, 0, prompt + output, num_computed_tokens=len(prompt) + len(output) - 1)
    return ScheduledSeq(seq, 1 + len(drafts), seq.num_computed_tokens, "decode", spec_token_ids=drafts,
                        spec_parents=parents)


@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 1, 2]], ids=["chain", "tree"])
def test_a_verify_row_counts_the_drafts_before_it(parents):
    p = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5, min_tokens=3, stop_token_ids=[65])
    prompt, output, drafts = [1, 2, 3], [65 + 1], [7, 8, 7, 9]
    plain = _scheduled([5, 5], [6], [], SamplingParams())               # a row without controls, untouched
    s = _scheduled(prompt, output, drafts, p, parents)
    logits = torch.randn(6, 256)
    got = apply_logits_processors(logits, [plain, s], [[0], [1, 2, 3, 4, 5]])
    assert torch.equal(got[0], logits[0])
    seen = {None: [[], [7], [7, 8], [7, 8, 7], [7, 8, 7, 9]],            # chain: drafts 0 .. j-1
            5: [[], [7], [8], [7, 7], [8, 9]]}[parents and len(parents)]  # tree: the path to node j
    for j, before in enumerate(seen):
        want = process_row_reference(logits[1 + j].tolist(), p, prompt, output + before)
        torch.testing.assert_close(got[1 + j], torch.tensor(want))


def oracle_greedy(model, prompt, params):
    """No cache, no batching: every token from a full forward, the reference controls, then argmax."""
    ids, out = list(prompt), []
    while len(out) < params.max_tokens:
        logits = forward_sequences(model, [ids])[0][-1].tolist()
        tok = int(np.argmax(process_row_reference(logits, params, list(prompt), out)))
        ids.append(tok)
        out.append(tok)
        if tok in params.stop_token_ids:
            break
    return out


@pytest.mark.parametrize("control", list(CONTROLS))
def test_greedy_equals_the_oracle_with_and_without_speculation(target_model, draft_model, control):
    params = SamplingParams(temperature=0, max_tokens=14, **CONTROLS[control])
    prompts = [list(p.encode()) for p in PROMPTS]
    refs = [oracle_greedy(target_model, p, params) for p in prompts]
    plain_refs = [oracle_greedy(target_model, p, SamplingParams(temperature=0, max_tokens=14)) for p in prompts]
    assert refs != plain_refs, f"{control} changes no greedy output here: the test would not see it ignored"
    for spec in (None, {"method": "draft", "num_speculative_tokens": 3}, {"method": "ngram", "num_speculative_tokens": 2},
                 {"method": "eagle", "tree": "dynamic", "num_draft_tokens": 6, "depth": 3, "topk": 2}):
        llm = LLM(target_model, draft_model=draft_model if spec and spec["method"] == "draft" else None,
                  speculative_config=spec, max_num_batched_tokens=32)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs, f"{control}, speculation {spec}"


def test_stop_token_ids_finish_and_min_tokens_holds_them_back(target_model):
    llm = LLM(target_model)
    free = llm.generate(["def f(x):\n"], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    stop = ids[2]                                                          # a token greedy reaches at position 2
    o = llm.generate(["def f(x):\n"], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
                     use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == ids[:ids.index(stop) + 1]   # vLLM keeps the stop token
    late = llm.generate(["def f(x):\n"], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop],
                                                        min_tokens=10), use_tqdm=False)[0].outputs[0]
    assert stop not in late.token_ids[:10]
    assert late.finish_reason == "length" or late.token_ids[-1] == stop


# -- sampled: the processed target distribution, exactly, with and without speculation ---------------------------

PROMPT = list(b"    def __init__(self, ")
SAMPLED = SamplingParams(temperature=1.0, max_tokens=3, repetition_penalty=1.6, frequency_penalty=0.8,
                         presence_penalty=0.5, logit_bias={95: -3.0, 32: 1.5})
N = 800


def exact_processed_joint(target, params, pairs: int = 48) -> dict:
    """P(t1, t2, t3) after PROMPT under the controls (the reference's), exactly, for the likeliest pairs."""
    def probs(seqs):
        rows = [lg[-1].tolist() for lg in forward_sequences(target, [PROMPT + s for s in seqs])]
        return torch.tensor([process_row_reference(r, params, PROMPT, s) for r, s in zip(rows, seqs)]).softmax(-1)
    p1 = probs([[]])[0]
    p2 = probs([[t] for t in range(256)])
    joint = (p1[:, None] * p2).double()
    top = [divmod(int(i), 256) for i in joint.flatten().topk(pairs).indices]
    p3 = probs([list(t) for t in top])
    return {(t1, t2, t3): float(joint[t1, t2] * p3[j, t3]) for j, (t1, t2) in enumerate(top) for t3 in range(256)}


def test_sampled_distribution_under_controls_is_unchanged_by_speculation(target_model, draft_model):
    exact = exact_processed_joint(target_model, SAMPLED)
    params = [SamplingParams(**{**vars(SAMPLED), "seed": 7000 + i}) for i in range(N)]
    llm = LLM(target_model, draft_model=draft_model, max_num_seqs=64,
              speculative_config={"method": "draft", "num_speculative_tokens": 2})
    toks = np.array([o.outputs[0].token_ids for o in llm.generate([PROMPT] * N, params, use_tqdm=False)])
    chi2, crit = chi_square(toks, exact)
    assert chi2 < crit, f"chi-square {chi2:.1f} rejects the processed target distribution ({crit:.1f})"
    plain = {(t1, t2, t3): p for (t1, t2, t3), p in exact_processed_joint(
        target_model, SamplingParams(temperature=1.0, max_tokens=3), pairs=48).items()}
    chi2_plain, _ = chi_square(toks, plain)
    assert chi2_plain > crit, "the samples also fit the unprocessed distribution: the controls are too weak to test"
