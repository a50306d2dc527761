"""The roofline cost model against hand-computed cases, and the profiles' bad input."""
import pytest

from minibatch.perf.cost import CostModel, parse_simulate
from minibatch.perf.hardware import HardwareProfile, get_hardware
from minibatch.perf.models import ModelProfile, get_model
from minibatch.trace import SeqStep, StepTrace


def trace(rows, phase="decode", padding=0, drafted=(), method=None):
    """A StepTrace with rows [(num_tokens, num_computed_before)]; every row produced a token."""
    sched = [SeqStep(f"s{i}", f"s{i}", phase, q, c, 1, 1, new_token_ids=[1]) for i, (q, c) in enumerate(rows)]
    return StepTrace(0, 0.0, 0.0, "continuous", sched, [], [], [], [], [], {}, 1, 16, [], [], 0,
                     sum(q for q, _ in rows), 512, 8, num_padding_slots=padding, speculative_method=method,
                     drafted=[list(d) for d in drafted])


# 1 layer, hidden 4, 1 head of 4, MLP 8 (GELU), vocabulary 10, 2-byte weights
TOY = ModelProfile("toy", 1, 4, 1, 1, 4, 8, 10, 2, gated_mlp=False)
HW = HardwareProfile("toy-hw", {"bf16": 1000.0}, 100.0, 1e6, 0.0)


def test_one_decode_row_by_hand():
    cm = CostModel(HW, TOY)
    ops = {b["op"]: b for b in cm.breakdown(trace([(1, 2)]))}     # q = 1, context after = 3
    # qkv: FLOPs 2*1*4*(4+8) = 96; bytes 2*(4*12 + 1*(4+12)) = 128
    assert (ops["qkv"]["flops"], ops["qkv"]["bytes"]) == (96, 128)
    # attention: FLOPs 4*1*3*4 = 48; bytes 2*(3*2*4 + 1*2*4 + 2*1*4) = 2*(24+8+8) = 80
    assert (ops["attention"]["flops"], ops["attention"]["bytes"]) == (48, 80)
    # o_proj: FLOPs 2*1*4*4 = 32; bytes 2*(16 + 1*(4+4)) = 48
    assert (ops["o_proj"]["flops"], ops["o_proj"]["bytes"]) == (32, 48)
    # mlp: m = 2*4*8 = 64 weights; FLOPs 2*1*64 = 128; bytes 2*(64 + 1*(8 + 16)) = 176
    assert (ops["mlp"]["flops"], ops["mlp"]["bytes"]) == (128, 176)
    # lm_head: FLOPs 2*1*4*10 = 80; bytes 2*4*10 + 4*1*10 = 120
    assert (ops["lm_head"]["flops"], ops["lm_head"]["bytes"]) == (80, 120)
    # all memory-bound at 1000 FLOP/s and 100 B/s (intensity < 10): time = bytes / 100
    assert all(b["bound"] == "memory" for b in ops.values())
    assert cm.step_time(trace([(1, 2)])) == pytest.approx((128 + 80 + 48 + 176 + 120) / 100)


def test_compute_bound_prefill_by_hand():
    cm = CostModel(HardwareProfile("slow-alu", {"bf16": 10.0}, 1e6, 1e9, 0.0), TOY)
    t = trace([(5, 0)], phase="prefill")                          # 5 prompt tokens, logits for the last only
    ops = {b["op"]: b for b in cm.breakdown(t)}
    assert ops["qkv"]["flops"] == 2 * 5 * 4 * 12 and ops["qkv"]["bound"] == "compute"
    assert ops["attention"]["flops"] == 4 * 5 * 5 * 4
    assert ops["lm_head"]["flops"] == 2 * 1 * 4 * 10
    assert cm.step_time(t) == pytest.approx(sum(b["flops"] for b in ops.values()) / 10)


def test_launches_and_graphs():
    hw = HardwareProfile("g", {"bf16": 1e30}, 1e30, 1e9, 1e-3, graph_overhead=5e-3, cuda_graphs=True)
    cm = CostModel(hw, TOY)
    assert cm.step_time(trace([(1, 2)])) == pytest.approx(5e-3)             # pure decode: one graph replay
    kernels = 10 * 1 + 3                                                     # per layer, + the head
    assert cm.step_time(trace([(3, 0)], phase="prefill")) == pytest.approx(kernels * 1e-3)


def test_decode_is_flat_on_a_gpu_and_weights_are_read_once():
    cm = CostModel.from_spec("h100:llama-3-8b")
    m = get_model("llama-3-8b")
    one = cm.step_time(trace([(1, 100)]))
    read = m.weight_bytes - m.vocab * m.hidden * 2              # every weight but the input embedding (a gather)
    assert one == pytest.approx(read / 3.35e12, rel=0.02)                   # batch-1 decode: the weights' read
    assert cm.step_time(trace([(1, 100)] * 64)) < 1.3 * one                # the flat region
    big = cm.breakdown(trace([(4096, 0)], phase="prefill"))
    assert {b["op"]: b["bound"] for b in big}["mlp"] == "compute"
    assert m.num_params == pytest.approx(8.03e9, rel=0.005)                # the published 8B
    assert get_model("llama-3-70b").num_params == pytest.approx(70.55e9, rel=0.005)


def test_speculation_costs_what_ran():
    cm = CostModel.from_spec("h100:llama-3-8b")
    base = trace([(1, 100)])
    verify = trace([(4, 100)])
    assert cm.step_time(verify) < 1.05 * cm.step_time(base)                # verifying 1 + 3 costs about 1
    with_draft = trace([(4, 100)], drafted=[(3, 3, 104)], method="draft")
    draft_pass = get_model("llama-3.2-1b").weight_bytes / 3.35e12
    assert cm.propose_time(with_draft) == pytest.approx(3 * draft_pass + 3 * 10e-6, rel=0.05)
    assert cm.step_time(with_draft) == pytest.approx(cm.step_time(verify) + cm.propose_time(with_draft))
    assert cm.propose_time(trace([(4, 100)], drafted=[(3, 3, 104)], method="ngram")) == 0.0


def test_tensor_parallel_splits_the_weights():
    one, two = CostModel.from_spec("h200:llama-3-70b"), CostModel.from_spec("2xh100:llama-3-70b")
    assert two.tp == 2 and two.step_time(trace([(1, 10)])) < one.step_time(trace([(1, 10)]))
    assert any(b["bound"] == "link" for b in two.breakdown(trace([(1, 10)])))


def test_tensor_parallel_past_the_kv_heads_prices_the_replicated_kv_bytes():
    """vLLM's rule: a rank holds max(1, n_kv / tp) K/V heads. At tp = 4 a model of 2 K/V heads holds one per
    rank (each replicated on 2 ranks): per rank, the cache it reads and writes, its k/v weights and the KV
    pool's block size are those of a model with 4 K/V heads (no GQA) at tp = 4, not half of them; at tp = 2
    they are half. The query side (FLOPs, q and o weights) splits tp ways in both."""
    gqa = ModelProfile("gqa", 2, 256, 4, 2, 64, 512, 100, 2)
    mha = ModelProfile("mha", 2, 256, 4, 4, 64, 512, 100, 2)
    hw = get_hardware("h100")
    long_decode = trace([(1, 4000), (1, 3000)])
    for tp, same in ((4, True), (2, False)):
        ops = [{b["op"]: b for b in CostModel(hw, m, tp=tp).breakdown(long_decode)} for m in (gqa, mha)]
        for op in ("qkv", "attention"):
            assert (ops[0][op]["bytes"] == ops[1][op]["bytes"]) == same, (tp, op)
        assert ops[0]["attention"]["flops"] == ops[1]["attention"]["flops"]       # query heads: split tp ways
        kv_read = [o["attention"]["bytes"] for o in ops]
        assert same or kv_read[0] == pytest.approx(kv_read[1] / 2, rel=0.01)      # the K/V read dominates
    # the KV pool: one block costs a rank the same at tp = 4 whatever n_kv <= 4; at tp = 2 GQA halves it
    b4 = [CostModel(hw, m, tp=4).num_gpu_blocks(16) for m in (gqa, mha)]
    b2 = [CostModel(hw, m, tp=2).num_gpu_blocks(16) for m in (gqa, mha)]
    assert b4[0] == b4[1] and b2[0] == pytest.approx(2 * b2[1], rel=1e-3)
    assert CostModel(hw, gqa, tp=4).num_gpu_blocks(16) < 2 * CostModel(hw, gqa, tp=2).num_gpu_blocks(16)


def test_bad_specs_name_the_choices():
    assert parse_simulate("2xh100:llama-3-70b:llama-3-8b") == ("h100", 2, "llama-3-70b", "llama-3-8b")
    with pytest.raises(ValueError, match="malformed simulate"):
        parse_simulate("h100-llama")
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'.*h100"):
        CostModel.from_spec("tpu:llama-3-8b")
    with pytest.raises(ValueError, match="unknown model profile 'gpt5'.*llama-3-8b"):
        CostModel.from_spec("h100:gpt5")
    with pytest.raises(ValueError, match="do not fit"):
        CostModel.from_spec("h100:llama-3-70b").num_gpu_blocks(16)
    with pytest.raises(ValueError, match="no interconnect"):
        CostModel.from_spec("2xm1-max:llama-3-8b")
    with pytest.raises(ValueError, match="peak_flops"):
        HardwareProfile("x", {"int4": 1.0}, 1.0, 1.0, 0.0)
    assert get_hardware("h100").sources["mem_bandwidth"].startswith("same datasheet")


def test_validation_classifies_steps_and_measures_relative_error():
    from minibatch.bench.validate import errors, format_errors, step_kind
    d, p = trace([(1, 5), (1, 7)]), trace([(8, 0)], phase="prefill")
    mixed = trace([(1, 5)])
    mixed.scheduled += trace([(8, 0)], phase="prefill").scheduled
    verify = trace([(4, 5)])
    verify.scheduled[0].proposed = 3
    tree = trace([(9, 5)])
    tree.scheduled[0].proposed, tree.scheduled[0].draft_parents = 8, [-1, 0, 0, 1, 1, 2, 2, 3, 3]
    assert [step_kind(t) for t in (p, mixed, d, verify, tree)] == ["prefill", "mixed", "decode", "verify", "tree"]
    cm = CostModel(HW, TOY)
    d.cpu_duration = cm.step_time(d) * 1.25                     # predicted 20 % under the measurement
    errs = errors([d], cm)
    assert errs["decode"] == [pytest.approx(0.2)] and "decode" in format_errors(errs)
