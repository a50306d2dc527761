"""The KV benches' numbers: the capacity table's arithmetic (bench kv) and the accuracy table (bench kv-accuracy).

* Capacity: one case worked by hand from the definition (2 x layers x K/V heads x (head_dim x bytes + the scale's 4
  bytes per (token, head))), not through ``quant.bytes_per_token``, and the pool's tokens from whole blocks.
* Accuracy, ``--small``: the fp32 cache is the reference, so its row must read KL 0 and every prompt identical
  (the comparison would show a bug in the reference path or in the comparison); every quantized row must show
  KL > 0 (its blocks really were read quantized), and its bpb stay close to fp32's.
"""
import pytest

from minibatch.bench import kv_accuracy, kv_efficiency
from minibatch.perf.models import get_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_capacity_arithmetic_for_llama_3_8b_int8_per_token_head():
    m = get_model("llama-3-8b")                       # 32 layers, 8 K/V heads of 128
    assert (m.n_layer, m.n_kv_heads, m.head_dim) == (32, 8, 128)
    per_token = 2 * 32 * 8 * (128 * 1 + 4)            # int8 values + a float32 scale per (token, head), K and V
    fp32 = 2 * 32 * 8 * 128 * 4
    budget, bs = 2**30, 16
    rows = {r[0]: r for r in kv_efficiency.capacity("llama-3-8b", budget, bs)}
    label, b, share, tokens, ratio = rows["int8 per_token_head"]
    assert b == per_token == 67584
    assert share == pytest.approx(4 / 132)
    assert tokens == budget // (bs * per_token) * bs == 15872
    assert rows["fp32"][1:4] == (fp32, 0.0, budget // fp32)
    assert ratio == pytest.approx(15872 / 4096)
    assert rows["int8 per_tensor"][4] == 4.0 and rows["bf16"][4] == 2.0


def test_kv_accuracy_small_reference_row_is_exact_and_quantized_rows_are_not(capsys):
    out = kv_accuracy.main(["--small", "--models", "llama"])
    rows = out["llama"]["modes"]
    ref = rows["fp32 (model)"]
    assert ref["kl"] == 0.0 and ref["identical"] == ref["prompts"] == kv_accuracy.SIZES["small"]["prompts"]
    assert ref["median_divergence"] is None
    for label, _, _, _, _ in kv_accuracy.MODES[1:]:
        r = rows[label]
        assert r["kl"] > 0, label
        assert abs(r["bpb"] / ref["bpb"] - 1) < 0.02, (label, r["bpb"], ref["bpb"])
    outliers = out["llama"]["k_outliers"]
    assert [layer for layer, _, _ in outliers] == list(range(4))
    assert all(ratios[0] >= ratios[1] >= ratios[2] >= 1.0 for _, ratios, _ in outliers)
    assert "fp8_e4m3 token-head" in capsys.readouterr().out


def test_kv_accuracy_refuses_an_unknown_model():
    with pytest.raises(SystemExit):
        kv_accuracy.main(["--small", "--models", "gpt5"])
