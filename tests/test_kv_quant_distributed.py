"""Quantized KV blocks across processes: the scales travel with the values (issue 45: "scales travel with their
blocks ... the disaggregated KV transfer, and tensor-parallel shards").

* Tensor parallelism: each rank stores its own heads' values and scales. Per (token, head) that is all there is to
  it; per tensor, calibrated (``calculate_kv_scales``), each rank takes the amax over *every* rank's heads (an
  all-reduce, max), so that every rank, and one engine, quantize with the same scale: greedy-equal to one engine.
* The disaggregated handoff (``kv_transfer.KVPayload``) sends the values as stored (one byte each) and their
  scales. The decode side writes per-(token, head) scales beside the values, adopts a calibrating sender's
  per-tensor scales, and requantizes where its own per-tensor scales differ. One pair of real processes, the rest
  in this process through the same connector (``KVSender``, ``admit_handoff``).
"""
from __future__ import annotations

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.disagg.instance import admit_handoff, handoff_header
from minibatch.distributed.kv_transfer import KVSender, transfer_bytes
from minibatch.engine.config import EngineConfig
from minibatch.engine.engine import LLMEngine
from minibatch.kv import quant
from minibatch.model.weights import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
KW = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64, attention_backend="batched")
CALIBRATED = dict(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
PER_TOKEN_HEAD = dict(kv_cache_dtype="int8", scale_granularity="per_token_head")


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model_name,quant_kw", [("llama", CALIBRATED), ("target", PER_TOKEN_HEAD)])
def test_tensor_parallel_quantized_equals_one_engine(model_name, quant_kw):
    """At tp=2 the Llama's rank 0 holds one of its 2 K/V heads: calibrated on that head alone, its scales would
    be smaller than one engine's wherever the other head held the layer's amax (and the output would drift)."""
    model = load_model(model_name, device="cpu")
    one = LLM(model, **KW, **quant_kw)
    want = _tokens(one.generate(PROMPTS, GREEDY))
    two = LLM(model, **KW, **quant_kw, tensor_parallel_size=2)
    assert _tokens(two.generate(PROMPTS, GREEDY)) == want
    c1, c2 = one.llm_engine.kv_cache, two.llm_engine.kv_cache
    assert c2.num_kv_heads == c1.num_kv_heads // 2 and c2.dtype == c1.dtype and c2.dtype.itemsize == 1
    if "calculate_kv_scales" in quant_kw:   # rank 0 took the amax over both ranks' heads (to the last bits of
        assert (c1.scales != 1).all()       # the split projection, which rounds apart from the whole one)
        torch.testing.assert_close(c2.scales, c1.scales, rtol=1e-5, atol=0)
    assert two.llm_engine.allocator.num_free_blocks == two.llm_engine.allocator.num_blocks


def _handoff(model, prompt, pre_kw, dec_kw):
    """One prompt prefilled by one engine and handed to another in this process, as the instances do; returns
    (decode engine, its first greedy tokens after the handoff, the payload that was sent, the prefill engine)."""
    pre = LLMEngine(model, EngineConfig(**KW, **pre_kw))
    sender = pre.scheduler.kv_connector = KVSender(pre.kv_cache, 8, wants=lambda seq: True)
    pre.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1))
    while pre.has_unfinished_requests():
        pre.step()
    (seq, payload, tr), = sender.pending
    dec = LLMEngine(model, EngineConfig(**KW, **dec_kw))
    assert admit_handoff(dec, handoff_header(seq, GREEDY, tr), payload)
    while dec.has_unfinished_requests():
        outs = dec.step()
    return dec, outs[0].outputs[0].token_ids, payload, tr, pre


@pytest.mark.parametrize("quant_kw", [PER_TOKEN_HEAD, CALIBRATED, dict(kv_cache_dtype="fp8_e5m2")],
                         ids=["int8-per-token-head", "fp8-calibrated", "e5m2-scale-1"])
def test_a_handoff_carries_the_scales_and_decodes_as_one_engine(target_model, quant_kw):
    prompt = PROMPTS[1]
    one = LLMEngine(target_model, EngineConfig(**KW, **quant_kw))
    one.add_request("p", prompt, GREEDY)
    while one.has_unfinished_requests():
        outs = one.step()
    dec, got, payload, tr, pre = _handoff(target_model, prompt, quant_kw, quant_kw)
    assert got == outs[0].outputs[0].token_ids
    n, mc = tr.num_tokens, target_model.config
    values = transfer_bytes(mc.n_layer, n, mc.num_kv_heads, mc.head_dim, 1)          # one byte a value
    scales = 4 * (mc.n_layer * 2 * n * mc.num_kv_heads if "scale_granularity" in quant_kw else mc.n_layer * 2)
    assert payload.kv.dtype.itemsize == 1 and tr.nbytes == values + scales
    if "calculate_kv_scales" in quant_kw:                   # the decode side adopted the sender's scales
        assert torch.equal(dec.kv_cache.scales, pre.kv_cache.scales)


def test_a_handoff_between_other_per_tensor_scales_is_requantized(target_model):
    """A calibrated prefill side (small scales) into a decode side at scale 1.0: the values are requantized onto
    the receiver's scale, so each reads back within the receiver's own round-trip bound of what was sent."""
    dec, _, payload, tr, pre = _handoff(target_model, PROMPTS[0], CALIBRATED, dict(kv_cache_dtype="fp8_e4m3"))
    assert (pre.kv_cache.scales != 1).all() and (dec.kv_cache.scales == 1).all()
    sent = payload.kv.to(torch.float32) * payload.scales[:, :, None, None, None]       # [L, 2, n, Hkv, D]
    L, _, N, bs, H, D = dec.kv_cache.kv.shape
    slots = torch.tensor([tr.dst_blocks[i // bs] * bs + i % bs for i in range(tr.num_tokens)])   # (freed, unwritten)
    got = dec.kv_cache.kv.view(L, 2, N * bs, H, D)[:, :, slots].to(torch.float32)    # scale 1.0
    rel, abs_ = quant.round_trip_bound("fp8_e4m3")
    assert ((got - sent).abs() <= torch.maximum(rel * sent.abs(), torch.tensor(abs_)) + 1e-7).all()
    assert not torch.equal(got, payload.kv.to(torch.float32))     # (written as sent, it would read 1/scale too big)


def test_disaggregated_instances_carry_fp8_bytes_and_their_scales(target_model):
    """The real pair of processes (gloo point-to-point, which has no float8): fp8 sent as its bytes, then its
    per-(token, head) scales. (Per-tensor calibration is left to the in-process tests above: it depends on which
    prompts make up the first batch, and the prefill instance's first batch need not be one engine's.)"""
    kw = dict(kv_cache_dtype="fp8_e4m3", scale_granularity="per_token_head")
    one = LLM(target_model, **KW, **kw)
    want = _tokens(one.generate(PROMPTS, GREEDY))
    two = LLM(target_model, **KW, **kw, disaggregated=True)
    assert _tokens(two.generate(PROMPTS, GREEDY)) == want
    mc = target_model.config
    assert len(two.llm_engine.transfers) == len(PROMPTS)
    for tr in two.llm_engine.transfers:
        assert tr.nbytes == transfer_bytes(mc.n_layer, tr.num_tokens, mc.num_kv_heads, mc.head_dim, 1) \
            + 4 * mc.n_layer * 2 * tr.num_tokens * mc.num_kv_heads
