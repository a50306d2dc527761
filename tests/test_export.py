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
