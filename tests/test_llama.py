"""The tiny Llama (RoPE, grouped-query attention, RMSNorm, SwiGLU), served by the whole engine.

The model is held equal to Hugging Face's ``LlamaForCausalLM`` (logits to 1e-4, greedy tokens), and the engine
on it to the no-cache oracle, token for token, on a mixed batch that hits every path where a rotary key's
position matters: prefix-cache hits (a cached block reused at the same position), chunked prefill (a chunk's
queries after an offset), preemption by recompute, n > 1, the eager-replay decode buffers, and speculation
(the shipped GPT draft shares the byte vocabulary; prompt lookup). A token tree's node sits at its depth: a
tree verified in one step gives every node the logits of its own path.
"""
from __future__ import annotations

import json

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.kv.attention import PagedAttention
from minibatch.kv.kv_cache import KVCache
from minibatch.kv.metadata import AttentionMetadata
from minibatch.model import registry
from minibatch.model.llama import Llama, LlamaConfig
from minibatch.model.model import forward_sequences
from minibatch.model.weights import WEIGHTS_DIR, load_model
from minibatch.sampling.reference import generate, generate_with_cache

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [list(b"def fib(n):\n    "), list(b"def fib(n):\n    return"), list(b"import os\nimport sys\n"),
           list(b"class Stack:\n    def push(self, x):\n        self.items.append(x)\n"), list(b"x = 1\n")]


@pytest.fixture(scope="module")
def tiny():
    """A random Llama small enough for every engine path in seconds: 4 query heads over 2 K/V heads."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig("tiny-llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128,
                              n_ctx=128)).eval()
    for p in model.parameters():               # norms away from 1, so a missed weight shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def oracle(tiny):
    params = SamplingParams(temperature=0, max_tokens=24)
    return [generate(tiny, p, params)[0] for p in PROMPTS]


def test_logits_equal_hugging_faces_llama(tiny):
    transformers = pytest.importorskip("transformers")
    from minibatch.export import to_hf
    hf = to_hf(tiny)
    assert isinstance(hf, transformers.LlamaForCausalLM) and hf.config.num_key_value_heads == 2
    ids = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        want = hf(ids).logits[0]
    got = forward_sequences(tiny, [PROMPTS[3]])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_kv_cache_holds_the_kv_heads_only(tiny):
    llm = LLM(tiny, block_size=8)
    cache = llm.llm_engine.kv_cache
    assert cache.num_kv_heads == 2 and cache.head_dim == 16
    gpt_like = KVCache.bytes_per_block(2, 8, 4, 16, torch.float32)              # one K/V head per query head
    assert KVCache.bytes_per_block(2, 8, 2, 16, torch.float32) * 2 == gpt_like


CASES = {
    "prefix": dict(),                                                            # prefix hits: PROMPTS 0 and 1
    "chunked": dict(max_num_batched_tokens=16),                                  # chunked prefill
    "preempt": dict(num_gpu_blocks=26, max_num_seqs=5),                          # preemption (recompute)
    "eager-replay": dict(cuda_graph_mode="eager-replay"),                        # the fixed decode buffers
}


@pytest.mark.parametrize("backend, case", [
    *[("batched", c) for c in CASES], *[("loop", c) for c in ("prefix", "chunked", "preempt")],
    pytest.param("triton", "chunked", marks=pytest.mark.interpreter),
])
def test_the_engine_equals_the_no_cache_oracle(tiny, oracle, backend, case):
    llm = LLM(tiny, block_size=4, attention_backend=backend, **CASES[case])
    params = SamplingParams(temperature=0, max_tokens=24)
    assert llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids == oracle[1]      # its blocks stay cached
    outs = llm.generate(PROMPTS, params)                          # PROMPTS 0 and 1 hit the first one's blocks
    assert [o.outputs[0].token_ids for o in outs] == oracle
    eng = llm.llm_engine
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks                # nothing leaked


def test_prefix_hits_and_preemption_happened(tiny):
    """The cases above are not vacuous: the shared prefix hits the cache, the small pool preempts."""
    from minibatch.stats import run_stats
    from minibatch.trace import TraceRecorder
    for case, key in (("prefix", "prefix_cache_hits"), ("preempt", "preemptions")):
        llm, rec = LLM(tiny, block_size=4, **CASES[case]), TraceRecorder()
        llm.llm_engine.add_hook(rec)
        llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24))
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
        assert run_stats(rec.traces)[key] > 0, key


def test_the_contiguous_cache_oracle_handles_grouped_heads(tiny, oracle):
    params = SamplingParams(temperature=0, max_tokens=24)
    assert [generate_with_cache(tiny, p, params)[0] for p in PROMPTS] == oracle


def test_n_above_one_and_seeds_are_batch_independent(tiny):
    llm = LLM(tiny, block_size=4)
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    alone = llm.generate([PROMPTS[2]], p)[0]
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], p)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3}])
def test_prompt_lookup_is_lossless_on_the_llama(tiny, oracle, spec):
    llm = LLM(tiny, block_size=4, speculative_config=spec)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == oracle


def test_a_tree_node_sits_at_its_depth(tiny):
    """One verify step of a token tree after a cached context: node i's logits equal a plain forward over the
    context and the path root -> i (its K was rotated at context + depth, not context + i)."""
    ctx, parents, tokens = PROMPTS[2][:9], [-1, 0, 0, 1, 1, 2], [105, 109, 112, 111, 114, 32]
    c = tiny.config
    cache = KVCache(c.n_layer, 8, 4, c.num_kv_heads, c.head_dim)
    table = [3, 0, 5, 6]
    with torch.no_grad():
        md = AttentionMetadata.build([table], [0], [len(ctx)], 4)
        tiny(torch.tensor(ctx), md.positions, PagedAttention(cache, md, "batched"))
        md = AttentionMetadata.build([table], [len(ctx)], [len(tokens)], 4, tree_parents=[parents])
        assert md.positions.tolist() == [9, 10, 10, 11, 11, 11]
        got = tiny(torch.tensor(tokens), md.positions, PagedAttention(cache, md, "batched"))
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        want = forward_sequences(tiny, [ctx + path[::-1]])[0][-1]
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)


def test_tensor_parallel_sizes_that_split_no_heads_are_refused_with_the_reason():
    # (a speculative head trained on another checkpoint is refused naming both: tests/test_llama_heads.py)
    if not (WEIGHTS_DIR / "llama.json").exists():
        pytest.skip("the shipped llama is trained by python -m minibatch.model.train --preset llama")
    llama = load_model("llama", device="cpu")
    with pytest.raises(ValueError, match="does not split llama's 4 query heads and 2 K/V heads"):
        LLM(llama, tensor_parallel_size=3)              # 3 divides neither (4 works: K/V heads replicated)


def test_the_shipped_gpt_draft_drafts_for_the_shipped_llama():
    if not (WEIGHTS_DIR / "llama.json").exists():
        pytest.skip("the shipped llama is trained by python -m minibatch.model.train --preset llama")
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = LLM("llama", device="cpu").generate(PROMPTS[:3], params)
    spec = LLM("llama", device="cpu", speculative_config={"method": "draft", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:3], params)] == \
        [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("fields, match", [
    ({"architecture": "MistralForCausalLM", "name": "x"}, r"x\.json: field 'architecture' is 'MistralForCausalLM'"),
    ({"architecture": "LlamaForCausalLM", "n_head": 4, "n_kv_head": 3}, r"x\.json: .*multiple of n_kv_head"),
    ({"architecture": "LlamaForCausalLM", "n_heads": 4}, r"x\.json: unknown field\(s\) \['n_heads'\]"),
])
def test_a_bad_config_names_the_file_and_the_field(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        registry.config_from_dict(fields, "x.json")


def test_a_manifest_without_an_architecture_is_a_gpt_and_llamas_record_theirs():
    from minibatch.model.model import GPT
    assert type(registry.build(registry.config_from_dict({"name": "t", "n_layer": 1}))) is GPT
    d = registry.config_to_dict(registry.get_config("llama"))
    assert d["architecture"] == "LlamaForCausalLM" and json.loads(json.dumps(d))["n_kv_head"] == 2


def test_the_cost_model_reads_the_llama_from_its_checkpoint_and_bench_kv_prints_the_saving(capsys):
    if not (WEIGHTS_DIR / "llama.json").exists():
        pytest.skip("the shipped llama is trained by python -m minibatch.model.train --preset llama")
    from minibatch.bench.kv_efficiency import main
    from minibatch.perf.models import get_model
    prof, model = get_model("llama"), load_model("llama", device="cpu")
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)      # the cost model leaves out norms
    assert prof.num_params == matrices and (prof.n_heads, prof.n_kv_heads) == (4, 2)
    kv = main(["--num-requests", "8", "--max-len", "64"])["kv_bytes_per_token"]
    assert kv["llama"] * 4 // 2 == kv["target"]                  # same width and depth: x Hkv / H
    assert kv["llama-3-8b"] == 2 * 32 * 8 * 128 * 2                # 128 KiB a token in bf16
    assert "llama" in capsys.readouterr().out


def test_the_gpt_draft_samples_as_the_llama_does():
    """Lossless on sampled output too: with the GPT draft proposing for the Llama, the first three sampled tokens
    follow the Llama's exact joint distribution (the same chi-square as tests/test_spec_methods.py)."""
    if not (WEIGHTS_DIR / "llama.json").exists():
        pytest.skip("the shipped llama is trained by python -m minibatch.model.train --preset llama")
    from test_spec_methods import chi_square, exact_joint, sample_tokens
    llama = load_model("llama", device="cpu")
    chi2, crit = chi_square(sample_tokens(llama, "draft", 1), exact_joint(llama))
    assert chi2 < crit, f"chi-square {chi2:.1f} rejects the Llama's distribution at the 0.001 level ({crit:.1f})"
