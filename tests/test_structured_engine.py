"""Structured outputs in the engine: greedy equals the oracle's constrained greedy (no-cache model + the teaching
matcher's masks) under batching, chunked prefill, preemption and speculation; sampled outputs always match;
speculation leaves the constrained distribution unchanged (chi-square)."""
import json
import re

import numpy as np
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.sampling.reference import generate, next_logits
from minibatch.model.tokenizer import encode
from minibatch.model.weights import WEIGHTS_DIR
from minibatch.sampling.structured import StructuredOutputsParams
from minibatch.sampling.structured.reference import constrained_generate
from minibatch.sampling.structured.teaching import DFA, TeachingMatcher
from test_engine import run as run_engine
from test_spec_methods import chi_square

pytestmark = pytest.mark.usefixtures("one_thread")

# (prompt, regex or None for an unconstrained row, max_tokens): prompts of different lengths, so chunks and
# decodes mix; the regexes are bounded, so most finish with "stop" before max_tokens.
CASES = [
    ("def add(a, b):\n    return a + b\n\nx = ", r"[0-9]{1,3}(\.[0-9]{1,2})?", 12),
    ("class Stack:\n    def ", r"[a-z_]{1,12}\((self)?\):", 20),
    ("import os\nimport ", None, 16),
    ("# ", r"(TODO|NOTE): [a-z ]{1,16}", 24),
    ("if x is None:\n    return ", r"(True|False|None|self\.[a-z]{1,8})", 14),
    ("for i in range(10):\n    print(i)\n", None, 20),
    ("name = ", r"\"[a-zA-Z ]{0,10}\"", 14),
    ("status = ", r"(ok|error|pending)", 3),             # max_tokens cuts "pending" and "error": "length"
    ("while True:\n    ", r"(break|continue|pass|x \+= [0-9])", 10),
]


def params_for(regex, max_tokens, backend="llguidance", **kw):
    so = None if regex is None else StructuredOutputsParams(regex=regex, backend=backend)
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **kw)


@pytest.fixture(scope="module")
def oracle(target_model):
    """Each case's (output ids, finish reason) from the slow loop: no cache, the teaching DFA's mask each step."""
    refs = []
    for prompt, regex, m in CASES:
        p = params_for(regex, m)
        if regex is None:
            refs.append(generate(target_model, encode(prompt), p))
        else:
            refs.append(constrained_generate(target_model, encode(prompt), p, TeachingMatcher(DFA(regex))))
    return refs


def run(model, params, prompts, draft=None, **cfg):
    """(outputs, traces), every block returned at the end (test_engine's run, with an optional draft model)."""
    outs, traces, _ = run_engine(model, prompts, params, draft_model=draft, **cfg)
    return outs, traces


CONFIGS = {
    "continuous batching": {},
    "static batching": dict(scheduling="static", max_num_seqs=4),
    "chunked prefill": dict(max_num_batched_tokens=16, block_size=8),
    "preemption": dict(block_size=8, num_gpu_blocks=14, max_num_seqs=9),
    "draft k=3": dict(speculative_config={"method": "draft", "num_speculative_tokens": 3}),
    "ngram k=4, chunked": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                               max_num_batched_tokens=16, block_size=8),
    "draft k=4, preemption": dict(speculative_config={"method": "draft", "num_speculative_tokens": 4},
                                  block_size=8, num_gpu_blocks=14, max_num_seqs=9),
    "eagle tree": dict(speculative_config={"method": "eagle", "tree": "dynamic", "num_draft_tokens": 6,
                                           "depth": 3, "topk": 2}),
    "teaching backend": {},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_the_oracle(target_model, draft_model, oracle, name):
    cfg = dict(CONFIGS[name])
    if name == "eagle tree" and not (WEIGHTS_DIR / "eagle.safetensors").exists():
        pytest.skip("no shipped eagle checkpoint")
    backend = "teaching" if name == "teaching backend" else "llguidance"
    params = [params_for(r, m, backend) for _, r, m in CASES]
    outs, traces = run(target_model, params, [p for p, _, _ in CASES], draft=draft_model, **cfg)
    for o, (ref, why), (prompt, regex, _) in zip(outs, oracle, CASES):
        assert o.outputs[0].token_ids == ref, f"{name}: {prompt!r} under {regex!r}"
        assert o.outputs[0].finish_reason == why
        if regex is not None and why == "stop":
            assert re.fullmatch(regex, o.outputs[0].text)
    assert {why for _, why in oracle} == {"stop", "length"}
    if "preemption" in name:
        assert sum(len(t.preempted) for t in traces) > 0, "meant to force preemption"
    if "chunked" in name:
        assert any(s.phase == "prefill" and not s.new_token_ids for t in traces for s in t.scheduled), "meant to chunk"
    if "speculative_config" in cfg:
        steps = [s for t in traces for s in t.scheduled]
        assert sum(s.proposed for s in steps) > 0 and sum(s.accepted for s in steps) > 0


# -- sampled: always valid --------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": False}
ARRAY = {"type": "array", "items": {"enum": ["a", "b", "cd"]}, "maxItems": 3}
CHOICE = ["red", "green", "blue"]
REGEX = r"[a-z]{1,6}(_[a-z0-9]{1,4})?"


def valid(kind, text):
    if kind == "schema":
        v = json.loads(text)
        return set(v) == {"ok", "n"} and isinstance(v["ok"], bool) and type(v["n"]) is int and 0 <= v["n"] <= 99
    if kind == "array":
        v = json.loads(text)
        return isinstance(v, list) and len(v) <= 3 and all(x in ("a", "b", "cd") for x in v)
    return text in CHOICE if kind == "choice" else re.fullmatch(REGEX, text) is not None


def mixed_batch(n):
    kinds = ["schema", "array", "choice", "regex", None]
    spec = {"schema": dict(json=SCHEMA, disable_any_whitespace=True), "array": dict(json=ARRAY,
            disable_any_whitespace=True), "choice": dict(choice=CHOICE), "regex": dict(regex=REGEX)}
    prompts = ["x = ", "def f():\n    return ", "config = ", "# colour: ", "    "]
    batch = [(kinds[i % 5], prompts[i % 7 % 5]) for i in range(n)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=32,
                             structured_outputs=None if k is None else spec[k]) for i, (k, _) in enumerate(batch)]
    return [k for k, _ in batch], [p for _, p in batch], params


@pytest.mark.parametrize("spec", [None, {"method": "draft", "num_speculative_tokens": 3}], ids=["plain", "draft"])
def test_sampled_outputs_always_match(target_model, draft_model, spec):
    kinds, prompts, params = mixed_batch(250)
    outs, _ = run(target_model, params, prompts, draft=draft_model, speculative_config=spec, max_num_seqs=64)
    stopped = 0
    for kind, p, o in zip(kinds, params, outs):
        c = o.outputs[0]
        if kind is None:
            continue
        if c.finish_reason == "stop":
            stopped += 1
            assert valid(kind, c.text), f"{kind}: {c.text!r}"
        else:                                # cut by max_tokens: still a prefix the grammar takes
            assert c.finish_reason == "length" and len(c.token_ids) == p.max_tokens
            m = p.structured_outputs.new_matcher()
            assert all(m.accept(t) for t in c.token_ids), f"{kind}: {c.text!r} left the grammar"
    assert stopped >= 0.9 * 200, f"only {stopped} of 200 constrained requests finished their grammar"


# -- lossless under speculation ---------------------------------------------------------------------------------
PROMPT, TRIPLE = encode("def f(x):\n    return x"), r"[ +\-*/][0-9a-z][ )]"


@torch.no_grad()
def exact_strings(target, dfa, prefix=(), state=0, p=1.0):
    """{output: probability} exactly, for every string the (finite) regex allows: the product of the target's
    masked softmax at each step, walking the DFA."""
    allowed = dfa.masks[state]
    if not allowed.any():
        return {prefix: p}
    probs = next_logits(target, PROMPT + list(prefix)).float().masked_fill(~allowed, float("-inf")).softmax(-1)
    out = {}
    for b in allowed.nonzero().flatten().tolist():
        out.update(exact_strings(target, dfa, prefix + (b,), dfa.next[state][b], p * float(probs[b])))
    return out


@pytest.fixture(scope="module")
def exact(target_model):
    return exact_strings(target_model, DFA(TRIPLE))


@pytest.mark.parametrize("spec", [None, {"method": "draft", "num_speculative_tokens": 2},
                                  {"method": "ngram", "num_speculative_tokens": 2}], ids=["plain", "draft", "ngram"])
def test_constrained_sampling_is_distributed_as_the_masked_target(target_model, draft_model, exact, spec):
    n = 1000                                # max_tokens > 3: the drafts run past the grammar's end, and are cut
    params = [SamplingParams(temperature=1.0, seed=7000 + i, max_tokens=8, structured_outputs={"regex": TRIPLE})
              for i in range(n)]
    outs, traces = run(target_model, params, [PROMPT] * n, draft=draft_model, speculative_config=spec,
                       max_num_seqs=128)
    toks = np.array([o.outputs[0].token_ids for o in outs])
    assert toks.shape == (n, 3) and all(o.outputs[0].finish_reason == "stop" for o in outs)
    if spec:
        assert sum(s.proposed for t in traces for s in t.scheduled) > n // 2
    chi2, crit = chi_square(toks, exact)
    assert chi2 < crit, f"chi-square {chi2:.1f} rejects the masked target's distribution at 0.001 ({crit:.1f})"


# -- ends, dead ends, refusals ----------------------------------------------------------------------------------
def test_a_dead_end_finishes_the_request(target_model):
    """A matcher left with no byte allowed short of accepting (an automaton cut after "c") finishes "dead_end"."""
    dfa = DFA("cd")
    s = dfa.next[0][ord("c")]
    dfa.next[s], dfa.masks[s] = [-1] * 256, False      # cut the automaton after "c": a state with no way on
    so = StructuredOutputsParams(regex="cd", backend="teaching")
    so._compiled = dfa
    outs = LLM(target_model).generate(["x = "], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so),
                                      use_tqdm=False)
    assert outs[0].outputs[0].text == "c" and outs[0].outputs[0].finish_reason == "dead_end"


def test_n_greater_than_one_each_sample_follows_the_grammar(target_model):
    p = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, structured_outputs={"choice": CHOICE})
    outs = LLM(target_model).generate(["colour = "], p, use_tqdm=False)
    assert [o.text in CHOICE and o.finish_reason == "stop" for o in outs[0].outputs] == [True] * 4


@pytest.mark.parametrize("so,match", [
    ({"regex": "a("}, "regex does not compile"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, "json does not compile"),
    ({"json": "{bad"}, "json"),
    ({"grammar": "start: a\na: b\n"}, "grammar does not compile"),
    ({"regex": "[^\\x00-\\x{10FFFF}]"}, "admits no string"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "(", "backend": "teaching"}, "unclosed group"),
    ({"json": {}, "backend": "teaching"}, "regex and choice only"),
    ({"regex": "a", "backend": "xgrammar"}, "choose one of"),
    ({"regexp": "a"}, "unknown field"),
])
def test_bad_constraints_are_refused_when_the_params_are_made(so, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=so)
