"""One owner per fact: the router checks a prompt with the engine's own check, and a request prefilled elsewhere
joins an engine through ``LLMEngine.admit_prefilled`` (no one else writes the engine's requests or its batch).

No instance processes here: the router's checks run before it talks to them, so its start is skipped."""
from __future__ import annotations

import pytest
import torch

from minibatch import SamplingParams
from minibatch.disagg.instance import admit_handoff, handoff_header
from minibatch.disagg.router import DisaggregatedEngine
from minibatch.distributed.kv_transfer import KVPayload, KVSender
from minibatch.engine.config import EngineConfig
from minibatch.engine.engine import LLMEngine, check_prompt

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def router(target_model, monkeypatch):
    monkeypatch.setattr(DisaggregatedEngine, "_start", lambda self: None)      # no instance processes
    return DisaggregatedEngine(target_model, EngineConfig(disaggregated=True))


def _refusal(add, *args):
    with pytest.raises((TypeError, ValueError)) as e:
        add(*args)
    return type(e.value), str(e.value)


@pytest.mark.parametrize("prompt,max_tokens", [("", 4), ([], 4), ([1] * 500, 20), ("x" * 300, 300), (42, 4),
                                               ([1, 256], 4), ("ok", 1000)])
def test_the_router_refuses_a_prompt_as_the_engine_does(target_model, router, prompt, max_tokens):
    eng = LLMEngine(target_model, EngineConfig(num_gpu_blocks=64))
    params = SamplingParams(max_tokens=max_tokens)
    want = _refusal(eng.add_request, "r", prompt, params)
    assert _refusal(router.add_request, "r", prompt, params) == want
    assert _refusal(check_prompt, "r", prompt, params, target_model.config.n_ctx) == want
    assert not router.requests and not eng.requests


def test_check_prompt_gives_text_and_ids():
    params = SamplingParams(max_tokens=4)
    assert check_prompt("r", "hi", params, 32) == ("hi", [104, 105])
    assert check_prompt("r", (104, 105), params, 32) == ("hi", [104, 105])


def _prefilled(target_model, prompt: str, params: SamplingParams):
    """(header, kv) of a prompt prefilled by one engine (max_tokens = 1), as a prefill instance hands it over."""
    pre = LLMEngine(target_model, EngineConfig(block_size=8))
    sender = pre.scheduler.kv_connector = KVSender(pre.kv_cache, 8, wants=lambda seq: True)
    pre.add_request("p", prompt, SamplingParams(temperature=params.temperature, seed=params.seed, max_tokens=1))
    while pre.has_unfinished_requests():
        pre.step()
    (seq, kv, tr), = sender.pending
    return handoff_header(seq, params, tr), kv


def test_admit_prefilled_joins_the_batch_and_decodes_as_one_engine(target_model):
    prompt, params = "def fib(n):\n    ", SamplingParams(temperature=0, max_tokens=12)
    one = LLMEngine(target_model, EngineConfig(block_size=8))
    one.add_request("p", prompt, params)
    while one.has_unfinished_requests():
        outs = one.step()
    want = outs[0].outputs[0].token_ids
    hdr, kv = _prefilled(target_model, prompt, params)
    dec = LLMEngine(target_model, EngineConfig(block_size=8))
    assert admit_handoff(dec, hdr, kv)
    assert hdr["transfer"].dst_blocks == dec.allocator.block_table("p")
    assert list(dec.requests) == ["p"] and [s.seq_id for s in dec.scheduler.running] == ["p"]
    while dec.has_unfinished_requests():
        outs = dec.step()
    assert outs[0].finished and outs[0].outputs[0].token_ids == want
    assert dec.allocator.num_free_blocks == dec.allocator.num_blocks


def test_admit_prefilled_refuses_when_the_batch_is_full(target_model):
    dec = LLMEngine(target_model, EngineConfig(block_size=8, max_num_seqs=1))
    dec.add_request("busy", "x = 1\n", SamplingParams(temperature=0, max_tokens=8))
    dec.step()                                                  # its prefill: the one seat is taken
    assert len(dec.scheduler.running) == 1
    n_blocks, n_added = dec.allocator.num_free_blocks, dec._num_added
    mc = target_model.config
    kv = KVPayload(torch.zeros(mc.n_layer, 2, 3, mc.num_kv_heads, mc.head_dim, dtype=dec.kv_cache.dtype))
    assert dec.admit_prefilled("late", "abc", [97, 98, 99], 100, SamplingParams(max_tokens=4), kv,
                               arrival_time=0.0, first_token_time=0.0) is None
    assert list(dec.requests) == ["busy"] and [s.seq_id for s in dec.scheduler.running] == ["busy"]
    assert dec.allocator.num_free_blocks == n_blocks and dec._num_added == n_added
    assert not dec.allocator.has_seq("late")
