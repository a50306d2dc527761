"""The speculative heads (Medusa, EAGLE, early exit): their shipped weights, their training, their shapes."""
import json
import shutil

import numpy as np
import pytest
import torch

from minibatch.model.heads import MedusaHeads, load_head
from minibatch.model.model import DenseAttention
from minibatch.model.data import load_corpus
from minibatch.model.weights import WEIGHTS_DIR, ChecksumError, read_manifest

SHIPPED = [m for m in ("medusa", "early_exit", "eagle") if (WEIGHTS_DIR / f"{m}.safetensors").exists()]


@pytest.mark.parametrize("preset", SHIPPED)
def test_shipped_head_loads_without_pickle_and_matches_its_manifest(target_model, preset):
    raw = (WEIGHTS_DIR / f"{preset}.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")                      # safetensors: u64 header length, then JSON
    header = json.loads(raw[8:8 + n])
    assert all(v["dtype"] == "F16" for k, v in header.items() if k != "__metadata__")
    head = load_head(preset, target_model)
    man = read_manifest(preset)
    assert head.num_params() == man["num_params"] and man["target_sha256"] == read_manifest("target")["sha256"]
    assert not head.training and next(head.parameters()).dtype == target_model.dtype
    assert "command" in man and man["command"].startswith("python -m minibatch.model.train --preset " + preset)


@pytest.mark.parametrize("preset", SHIPPED)
def test_a_corrupt_head_file_is_a_clear_error(tmp_path, preset):
    for ext in ("json", "safetensors"):
        shutil.copy(WEIGHTS_DIR / f"{preset}.{ext}", tmp_path / f"{preset}.{ext}")
    raw = bytearray((tmp_path / f"{preset}.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / f"{preset}.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="SHA-256"):
        load_head(preset, directory=tmp_path)
    (tmp_path / f"{preset}.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_head(preset, directory=tmp_path)


def test_missing_or_mismatched_heads_are_clear_errors(tmp_path, target_model):
    with pytest.raises(FileNotFoundError, match="train them"):
        load_head("medusa", directory=tmp_path)
    with pytest.raises(ValueError, match="unknown preset"):
        load_head("hydra")
    from minibatch.model.model import GPT, GPTConfig
    other = GPT(GPTConfig("wide", n_layer=1, n_head=2, n_embd=64))
    if "medusa" in SHIPPED:
        with pytest.raises(ValueError, match="another model"):
            load_head("medusa", other)


def test_medusa_heads_start_as_the_identity_and_the_target_head(target_model):
    heads = MedusaHeads.from_target(target_model, 3)
    h = torch.randn(5, 256)
    logits = heads(h)                                          # [N, K, V]
    assert logits.shape == (5, 3, 256)
    for i in range(3):                                         # W = 0: every head is the tied LM head at first
        torch.testing.assert_close(logits[:, i], h @ target_model.wte.weight.t())


@pytest.mark.skipif("medusa" not in SHIPPED, reason="no shipped medusa heads")
def test_medusa_heads_guess_held_out_code(target_model):
    """Each head's top-1 accuracy on held-out code (its manifest records 32k positions; here 2k), falling with
    the distance it guesses at, far above chance (1/256) and above the tied head asked the same question."""
    val = load_corpus("val")
    x = torch.tensor(val[5000:5000 + 2048].astype(np.int64))
    _, hs = target_model(x, torch.arange(512).repeat(4), _dense(4, 512), hidden_states=("final",))
    heads = load_head("medusa", target_model)
    K = heads.num_heads
    h = hs["final"].view(4, 512, -1)[:, : 512 - K - 1].reshape(-1, 256)
    guess = heads(h).argmax(-1).view(4, -1, K)                 # [4, S', K]
    xs = x.view(4, 512)
    acc = [(guess[:, :, i] == xs[:, 2 + i: 512 - K + 1 + i]).float().mean().item() for i in range(K)]
    tied = ((h @ target_model.wte.weight.t()).argmax(-1).view(4, -1) == xs[:, 2: 512 - K + 1]).float().mean().item()
    assert acc[0] > 0.4 and acc[-1] > 0.2 and acc[0] > acc[-1] and acc[0] > tied + 0.1, (acc, tied)
    shipped = read_manifest("medusa")["final"]
    assert shipped["head0_top1_t+2"] > 0.45 and shipped["head0_top5_t+2"] > shipped["head0_top1_t+2"]


@pytest.mark.skipif("early_exit" not in SHIPPED, reason="no shipped early-exit adapter")
def test_early_exit_agrees_with_the_target(target_model):
    """The target's first E blocks + the adapter + ln_f + head pick the target's own argmax far more often than
    the plain exit (the same E blocks straight into ln_f and the head), on held-out code."""
    val = load_corpus("val")
    x = torch.tensor(val[9000:9000 + 2048].astype(np.int64))
    ad = load_head("early_exit", target_model)
    E = ad.exit_layer
    logits, hs = target_model(x, torch.arange(512).repeat(4), _dense(4, 512), hidden_states=(E,))
    best = logits.argmax(-1)
    adapted = (ad.logits(target_model, hs[E]).argmax(-1) == best).float().mean().item()
    plain = ((target_model.ln_f(hs[E]) @ target_model.wte.weight.t()).argmax(-1) == best).float().mean().item()
    assert adapted > 0.8 and adapted > plain + 0.05, (adapted, plain)
    assert read_manifest("early_exit")["final"]["adapter_greedy_agreement"] > 0.85


@pytest.mark.skipif("eagle" not in SHIPPED, reason="no shipped EAGLE head")
def test_eagle_guesses_the_next_feature(target_model):
    """On held-out code, head(f^_p) picks the target's argmax at p (the first draft's greedy acceptance) far more
    often than the target's own head applied to the *previous* feature (what the head improves on)."""
    val = load_corpus("val")
    x = torch.tensor(val[13000:13000 + 1024].astype(np.int64))
    logits, hs = target_model(x, torch.arange(512).repeat(2), _dense(2, 512), hidden_states=("final",))
    f = hs["final"].view(2, 512, -1)
    head = load_head("eagle", target_model)
    f_prev = torch.cat([torch.zeros(2, 1, 256), f[:, :-1]], dim=1)          # entry p reads f_{p-1}; f_{-1} = 0
    f_hat = head(target_model, x, f_prev.reshape(-1, 256), torch.arange(512).repeat(2), _dense(2, 512), 0)
    best = logits.argmax(-1)
    agree = ((f_hat @ target_model.wte.weight.t()).argmax(-1) == best).float().mean().item()
    stale = ((f_prev.reshape(-1, 256) @ target_model.wte.weight.t()).argmax(-1) == best).float().mean().item()
    assert agree > 0.75 and agree > stale + 0.3, (agree, stale)
    assert read_manifest("eagle")["final"]["first_greedy_agreement"] > 0.8


def _dense(batch, seq):
    return DenseAttention([seq] * batch)


@pytest.mark.parametrize("preset,extra", [("medusa", ["--num-heads", "2"]), ("medusa", ["--distill"]),
                                          ("early_exit", ["--exit-layer", "2"]), ("eagle", ["--crop", "32"])])
def test_training_smoke(tmp_path, preset, extra):
    """A few steps of each preset, end to end: precompute, train, evaluate, save; the file loads back."""
    from minibatch.model import train
    train.main(["--preset", preset, "--steps", "3", "--windows", "2", "--val-windows", "2", "--seq-len", "64",
                "--batch-size", "32", "--eval-every", "3", "--threads", "1", "--out", str(tmp_path), *extra])
    man = json.loads((tmp_path / f"{preset}.json").read_text())
    assert man["recipe"]["steps"] == 3 and len(man["log"]) == 1 and "--out" not in man["command"]
    head = load_head(preset, directory=tmp_path)
    assert head.num_params() == man["num_params"]
