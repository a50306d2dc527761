"""One request's walk through the engine, as README.md's Layout tells it: at most 8 files, in order.

A plain request (no logprobs, no sampling controls, no grammar) enters the eight files of the walk and the few
that hold what it carries (its sequence, the block pool, the model, ...), and nothing else of minibatch: the
logits processors, the grammar's matcher and logprobs are reached only when a request asks for them, each
through one hook. Measured with ``sys.setprofile``: every Python function the engine calls is seen.
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.model.model import GPT, GPTConfig

PKG = pathlib.Path(__file__).resolve().parent.parent / "minibatch"

# The walk's stations (README.md, "Read the code" -> "The step"), in the order a step reaches them; sampler.py also holds the
# SamplingParams a request carries, so it is entered earlier too.
WALK = ["llm.py", "engine/engine.py", "engine/scheduler.py", "kv/block_allocator.py", "engine/model_runner.py",
        "kv/attention.py", "sampling/sampler.py", "engine/outputs.py"]
# What the walk carries: data and the layers under a station, entered but not stations of their own
# (kv/backends/: the registry, and on a CPU the default backend, "cpu", and its C++ operator).
CARRIED = {"model/tokenizer.py", "engine/sequence.py", "engine/request_queue.py", "kv/block_pool.py",
           "model/model.py", "kv/metadata.py", "kv/kv_cache.py", "kv/backends/__init__.py", "kv/backends/cpu.py",
           "kv/backends/cpu_kernel.py"}


@pytest.fixture(scope="module")
def llm():
    torch.manual_seed(0)
    model = GPT(GPTConfig("tiny", n_layer=1, n_head=2, n_embd=32, n_ctx=64)).eval()
    llm = LLM(model, block_size=4)
    llm.generate(["warm"], SamplingParams(temperature=0, max_tokens=2))        # lazy set-up out of the way
    return llm


def entered(llm, params) -> list:
    """The minibatch files a generate call enters, in the order of first entry (paths under minibatch/)."""
    seen = {}

    def profile(frame, event, arg):
        f = frame.f_code.co_filename
        if event == "call" and f.startswith(str(PKG)) and f not in seen:
            seen[f] = None
    sys.setprofile(profile)
    try:
        llm.generate(["abcabc"], params)
    finally:
        sys.setprofile(None)
    return [str(pathlib.Path(f).relative_to(PKG)) for f in seen]


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=3, top_k=20)],
                         ids=["greedy", "sampled"])
def test_a_plain_request_walks_eight_files_and_no_other(llm, params):
    files = entered(llm, SamplingParams(max_tokens=4, **params))
    assert len(WALK) <= 8
    stations = [f for f in files if f in WALK and f != "sampling/sampler.py"]
    assert stations == [f for f in WALK if f != "sampling/sampler.py"] and "sampling/sampler.py" in files
    assert set(files) - set(WALK) <= CARRIED, f"a plain request climbed into {sorted(set(files) - set(WALK) - CARRIED)}"


@pytest.mark.parametrize("asks, hook", [
    (dict(logprobs=2), "sampling/logprobs.py"),
    (dict(prompt_logprobs=1), "sampling/logprobs.py"),
    (dict(logit_bias={65: 5.0}), "sampling/logits_processors.py"),
    (dict(repetition_penalty=1.3), "sampling/logits_processors.py"),
    (dict(structured_outputs={"regex": "[a-c]+", "backend": "teaching"}), "sampling/structured/matcher.py"),
])
def test_each_option_is_reached_through_its_hook_only_when_asked(llm, asks, hook):
    params = SamplingParams(temperature=0, max_tokens=4, **asks)
    files = entered(llm, params)
    assert hook in files and set(WALK) <= set(files)
