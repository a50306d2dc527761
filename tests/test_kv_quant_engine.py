"""A quantized KV cache inside the engine (EngineConfig.kv_cache_dtype, kv/quant.py): what must hold end to end.

* A prefix-cache hit reads the blocks with the scales they were written with: greedy output on a quantized
  cache (fp8 e4m3 and int8, per (token, head)) is identical whether the prompt's blocks are computed cold or
  come from the cache (SGLang #24198 was the radix-hit path dropping them: silent garbage).
* Swapping moves the scales with the blocks: under memory pressure with preemption_mode="swap" the output is
  the same mode's without pressure.
* The command line takes --kv-cache-dtype; the simulated memory budget counts the quantized bytes; bad
  settings are refused once, at the config, naming the field and the choices.
"""
from __future__ import annotations

import pytest

from minibatch import LLM, SamplingParams
from minibatch.engine.config import EngineConfig
from minibatch.trace import TraceRecorder

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def fib(n):\n    ", "import os\nimport sys\ndef main():\n", "class Stack:\n    def __init__(self):\n",
           "import os\nimport sys\nimport re\n"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
MODES = [("fp8_e4m3", "per_token_head"), ("int8", "per_token_head")]
BACKENDS = ["loop", "batched"]
ROOMY = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
TIGHT = dict(ROOMY, num_gpu_blocks=14)                  # 4 prompts of ~2-3 blocks growing by 3: preempts


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,granularity", MODES)
def test_prefix_hit_and_swap_equal_the_cold_run(target_model, backend, dtype, granularity):
    q = dict(kv_cache_dtype=dtype, scale_granularity=granularity, attention_backend=backend)
    llm = LLM(target_model, **ROOMY, **q)
    kv = llm.llm_engine.kv_cache
    assert kv.kv_cache_dtype == dtype and kv.dtype.itemsize == 1 and kv.scales is not None
    cold = _tokens(llm.generate(PROMPTS, GREEDY))
    hits = llm.llm_engine.allocator.hits
    warm = _tokens(llm.generate(PROMPTS, GREEDY))           # the same prompts: their full blocks are cached
    assert llm.llm_engine.allocator.hits > hits             # (so the second run read them, with their scales)
    assert warm == cold, f"{dtype} {granularity} on {backend}: a prefix hit changed the output"
    swapped = LLM(target_model, **TIGHT, **q, preemption_mode="swap")
    rec = TraceRecorder()
    swapped.llm_engine.add_hook(rec)
    out = _tokens(swapped.generate(PROMPTS, GREEDY))
    assert sum(len(t.swapped_out) for t in rec.traces) > 0 and sum(len(t.preempted) for t in rec.traces) == 0
    assert out == cold, f"{dtype} {granularity} on {backend}: swapping changed the output"
    assert sum(swapped.llm_engine.kv_cache.host_scales.flatten() != 1).item() > 0   # scales went to the host


def test_quantized_output_close_to_full_precision(target_model):
    """Not garbage: on the shipped model int8 per (token, head) keeps most greedy tokens (the accuracy bench
    measures it properly); an engine that dropped the scales would read values off by ~100x."""
    ref = _tokens(LLM(target_model, **ROOMY, attention_backend="batched").generate(PROMPTS, GREEDY))
    q = _tokens(LLM(target_model, **ROOMY, attention_backend="batched", kv_cache_dtype="int8",
                    scale_granularity="per_token_head").generate(PROMPTS, GREEDY))
    same = sum(a == b for r, o in zip(ref, q) for a, b in zip(r, o))
    assert same >= 0.5 * sum(map(len, ref)), (ref, q)


def test_generate_command_line(capsys):
    from minibatch.__main__ import main
    assert main(["generate", "def fib(n):", "--max-tokens", "4", "--device", "cpu", "--attention-backend", "batched",
                 "--kv-cache-dtype", "fp8", "--kv-scale-granularity", "per_token_head"]) == 0
    assert capsys.readouterr().out.strip()


def test_simulated_budget_counts_quantized_bytes():
    """h100:llama-3-8b: an fp8 block is half a bf16 one, so twice the blocks fit (per (token, head), less the
    scales' share: 4 bytes per head_dim = 128 values, so 2 * 128 / 132)."""
    n = {d: EngineConfig(simulate="h100:llama-3-8b", kv_cache_dtype=d, scale_granularity=g).cost_model()
         .num_gpu_blocks(16, 0.9, d, g) for d, g in (("auto", "per_tensor"), ("fp8_e4m3", "per_tensor"),
                                                     ("int8", "per_token_head"))}
    assert abs(n["fp8_e4m3"] / n["auto"] - 2) < 1e-3
    assert abs(n["int8"] / n["auto"] - 2 * 128 / 132) < 1e-3
    big = dict(simulate="h100:llama-3-8b", max_num_seqs=4096)
    assert EngineConfig(**big, kv_cache_dtype="fp8").num_blocks_for(8192) == n["fp8_e4m3"]


@pytest.mark.parametrize("kw,match", [
    (dict(kv_cache_dtype="fp4"), "choose one of .*'fp8_e4m3'.*'int8'"),
    (dict(kv_cache_dtype="int8", scale_granularity="per_row"), "choose one of"),
    (dict(calculate_kv_scales=True), "needs a quantized kv_cache_dtype"),
    (dict(kv_cache_dtype="int8", scale_granularity="per_token_head", calculate_kv_scales=True), "per_tensor"),
])
def test_bad_settings_refused_at_the_config(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_fp8_alias_made_canonical():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"


def test_the_simulated_clock_prices_attention_reads_at_the_cache_dtype():
    """A decode step of Llama-3-8B at batch 64, context 4096 (problem set 12, question 7): attention reads every
    token's K and V once per layer, 2 x 1024 values, at 2 bytes in bf16 and 1 at fp8 (per (token, head) adds a
    4-byte scale per K/V head); the rest of the step is unchanged."""
    from minibatch.perf.cost import CostModel
    rows = [(1, 4096, 1)] * 64
    ops = {}
    for d in ("auto", "fp8_e4m3"):
        cm = CostModel.from_spec("h100:llama-3-8b", d)
        ops[d] = {o.name: o for o in cm.forward_ops(cm.model, rows)}
    m = cm.model
    tokens = 64 * (4096 + 1) * m.n_layer                       # read and written, over the layers
    auto, fp8 = ops["auto"]["attention"].bytes, ops["fp8_e4m3"]["attention"].bytes
    assert auto - fp8 == tokens * 2 * m.kv_dim * (m.dtype_bytes - 1)
    cm8 = CostModel.from_spec("h100:llama-3-8b", "int8", "per_token_head")
    int8 = {o.name: o for o in cm8.forward_ops(cm8.model, rows)}["attention"].bytes
    assert int8 - fp8 == tokens * 2 * m.n_kv_heads * 4
    assert ops["auto"]["mlp"].bytes == ops["fp8_e4m3"]["mlp"].bytes
    assert EngineConfig(simulate="h100:llama-3-8b", kv_cache_dtype="fp8").cost_model().kv_cache_dtype == "fp8_e4m3"
