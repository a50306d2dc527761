"""The Hugging Face peer: the converted model is minibatch's model, and the peers bench runs end to end.

transformers is optional (``pip install transformers==5.25.0``; CI installs it in ``.ci/run``): without it
every test that needs it skips with that reason, and the bench's own message is still checked. Speed is
never asserted here; the bench measures it.
"""
import re
import sys

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch import export
from minibatch.bench import peers
from minibatch.model.tokenizer import encode

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def hf_pair(target_model, draft_model):
    pytest.importorskip("transformers", reason=f"optional peer not installed: pip install {peers.HF_REQUIREMENT}")
    return {"target": (target_model, export.to_hf(target_model)), "draft": (draft_model, export.to_hf(draft_model))}


def test_without_transformers_the_bench_says_how_to_install_and_fails(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)          # `import transformers` raises ImportError
    assert peers.main([]) == 2
    assert f"pip install {peers.HF_REQUIREMENT}" in capsys.readouterr().err


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        peers.main(["--ks", "0,4"])
    with pytest.raises(SystemExit):
        peers.main(["--repeats", "0"])


def test_to_hf_is_gpt2_with_our_shapes_and_a_tied_head(hf_pair):
    model, hf = hf_pair["target"]
    c = hf.config
    assert (c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head) == (256, 512, 256, 4, 4)
    assert c.activation_function == "gelu_new" and c.layer_norm_epsilon == 1e-5
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == 0.0 and not hf.training
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    # Conv1D holds W [in, out]: the transpose of nn.Linear's [out, in]
    assert torch.equal(hf.transformer.h[0].attn.c_attn.weight, model.h[0].attn.c_attn.weight.t())
    with pytest.raises(TypeError):
        export.to_hf(hf)


@pytest.mark.parametrize("name", ["target", "draft"])
@pytest.mark.parametrize("shape", [(3, 50), (1, 512)])         # (batch, length); 512 = every position
def test_converted_logits_equal_minibatch(hf_pair, name, shape):
    model, hf = hf_pair[name]
    g = torch.Generator().manual_seed(shape[1])
    tokens = torch.randint(0, 256, shape, generator=g)
    with torch.no_grad():
        ours, theirs = peers.minibatch_logits(model, tokens), hf(tokens).logits
    assert ours.shape == theirs.shape == (*shape, 256)
    assert (ours - theirs).abs().max().item() <= peers.LOGITS_TOL
    assert peers.logits_max_diff(model, hf) <= peers.LOGITS_TOL


@pytest.mark.parametrize("name", ["target", "draft"])
def test_greedy_outputs_equal_token_for_token(hf_pair, name):
    model, hf = hf_pair[name]
    outs = LLM(model, max_num_seqs=4).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32),
                                               use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        x = torch.tensor([encode(prompt)])
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                            pad_token_id=export.PAD)
        assert out.outputs[0].token_ids == y[0, x.shape[1]:].tolist()


def test_padding_past_the_context_gets_zero_positions_and_keeps_useful_tokens_exact(hf_pair):
    model, _ = hf_pair["target"]
    long = export.to_hf(model, n_positions=600)
    assert long.config.n_positions == 600 and not long.transformer.wpe.weight[512:].any()
    tokens = torch.randint(0, 256, (2, 512), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (peers.minibatch_logits(model, tokens) - long(tokens).logits).abs().max() <= peers.LOGITS_TOL
    with pytest.raises(ValueError):
        export.to_hf(model, n_positions=100)
    # one padded batch: a 300-byte prompt wanting 2 tokens waits for a short one wanting 250 (300 + 250 > 512)
    prompts, lens = ["x = 1\n" * 50, "def f():\n"], [2, 250]
    outs, _ = peers.hf_padded(model, prompts, lens, slots=2)()
    ours = LLM(model, max_num_seqs=2, scheduling="static").generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == outs and list(map(len, outs)) == lens


def test_slot_bound():
    assert peers.slot_bound([5, 5, 5, 5], 2) == 1.0                  # equal lengths: nothing to win
    assert peers.slot_bound([4, 1, 1, 4], 2) == (4 + 4) * 2 / 10      # two batches, each waits for a 4
    assert peers.slot_bound([7, 1, 1], 2) == (7 + 1) * 2 / 9          # a partial last batch still holds 2 slots


def test_bench_smoke_prints_parity_and_every_row(hf_pair, capsys):
    threads = torch.get_num_threads()
    assert peers.main(["--num-requests", "3", "--max-num-seqs", "2", "--max-tokens", "6", "--num-prompts", "1",
                       "--ks", "2", "--repeats", "1"]) == 0
    assert torch.get_num_threads() == threads and torch.is_grad_enabled()     # left as it found them
    out = capsys.readouterr().out
    assert re.search(r"logits parity.*target \d\.\de-\d\d, draft \d\.\de-\d\d", out)
    assert "greedy tokens equal, 1 code prompts x 6 tokens: target 1/1, draft 1/1: ok" in out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()
            if line.startswith(("continuous ", "static ", "plain ", "draft ", "ngram "))}
    assert list(rows) == ["continuous", "static", "plain", "draft k=2", "ngram k=2"]
    for name, line in rows.items():
        m = re.search(r"(\d+) \((\d+)-(\d+)\)\s+(\d+) \((\d+)-(\d+)\)\s+(\d+\.\d\d) \((\d+\.\d\d)-(\d+\.\d\d)\)\s+"
                      r"(\d+)/(\d+)", line)
        assert m, line
        assert m[10] == m[11], f"{name}: outputs differ from HF's"
    assert re.search(r"slot-model bound, continuous/static at 2 slots: \d+\.\d\dx", out)
    assert re.search(r"minibatch \d+\.\d\dx = \d+\.\d\d of the bound, HF \d+\.\d\dx", out)
