"""``python -m minibatch.export hf OUT_DIR``: a directory transformers loads, whose logits are minibatch's.

The conversion's own checks (shapes, the tied head, padded positions) are in tests/test_peers.py; here the
written directory is loaded back the way a user would, with ``from_pretrained``.
"""
import json

import pytest
import torch

from minibatch import export
from minibatch.bench import peers


def test_export_dir_loads_in_transformers_with_equal_logits(tmp_path, target_model, draft_model, capsys):
    transformers = pytest.importorskip("transformers", reason=f"pip install {peers.HF_REQUIREMENT}")
    for name, model in (("target", target_model), ("draft", draft_model)):
        out = tmp_path / name
        assert export.main(["hf", str(out), "--model", name]) == 0
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
        hf = transformers.GPT2LMHeadModel.from_pretrained(out, use_kernels=False).eval()   # no HF kernel hub
        assert hf.config.n_layer == model.config.n_layer and hf.dtype == torch.float32
        assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
        tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            assert (peers.minibatch_logits(model, tokens) - hf(tokens).logits).abs().max() <= peers.LOGITS_TOL
    assert "wrote draft as GPT2LMHeadModel" in capsys.readouterr().out


def test_export_needs_no_transformers(tmp_path, target_model, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)
    out = export.export_hf(target_model, tmp_path / "t")
    from safetensors.torch import load_file
    state = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in state                         # tied to wte, as HF saves GPT-2
    assert torch.equal(state["transformer.h.0.attn.c_attn.weight"], target_model.h[0].attn.c_attn.weight.t())


def test_bad_exports_are_clear_errors(tmp_path, capsys):
    assert export.main(["hf", str(tmp_path / "x"), "--model", "medusa"]) == 2
    assert "unknown model 'medusa'; choose one of ['target', 'draft', 'llama']" in capsys.readouterr().err
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert export.main(["hf", str(full)]) == 2
    assert "is not empty; pass --force" in capsys.readouterr().err
    assert not (full / "config.json").exists()
    assert export.main(["hf", str(full), "--force"]) == 0 and (full / "model.safetensors").exists()
    assert export.main(["hf", str(full / "keep.txt")]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export.main(["onnx", str(tmp_path / "y")])


TEXTS = ["def f(x):\n    return x  + 1\n", "  two leading spaces", " . , ' s n't", "\x00\x01\t\r\n\x0b\x7f\x80",
         "héllo wörld — 日本語 🙂", "ß" * 3 + "\u00ad\u00a0"]
BROKEN = [[0xe6, 0x97], [0xff, 0x41], [0xf0, 0x9f, 0x99], [0xc3, 0x28, 0x80, 0x80], [0xed, 0xa0, 0x80]]


def test_the_byte_tokenizer_is_minibatchs(tmp_path):
    """The exported tokenizer (what `vllm serve` streams text with) encodes and decodes exactly as
    minibatch/model/tokenizer.py: every byte alone, text with multi-byte UTF-8 and the bytes GPT-2's map shifts,
    and cut or invalid UTF-8 (both give U+FFFD alike); through transformers' loader too, as vLLM loads it."""
    tokenizers = pytest.importorskip("tokenizers")
    from minibatch.model.tokenizer import decode, encode
    symbols = export.bytes_to_unicode()
    assert len(set(symbols.values())) == 256 and symbols[ord(" ")] == "Ġ" and symbols[ord("a")] == "a"
    export.write_byte_tokenizer(tmp_path, 512)
    fast = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert fast.get_vocab_size() == 256
    for b in range(256):
        assert fast.decode([b]) == decode([b])
        assert fast.id_to_token(b) == symbols[b]
    for text in TEXTS:
        assert fast.encode(text).ids == encode(text), text
        assert fast.decode(encode(text)) == text
    for ids in BROKEN:
        assert fast.decode(ids) == decode(ids), ids
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(hf) == 256 and hf.bos_token_id is None and hf.eos_token_id is None
    for text in TEXTS:
        assert hf(text)["input_ids"] == encode(text) and hf.decode(encode(text)) == text, text
