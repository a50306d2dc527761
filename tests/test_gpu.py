"""For the day a GPU is there: the engine natively on CUDA, every backend, graphs on and off, against the CPU oracle.

Every test here but the last is marked ``gpu`` and skips without CUDA (tests/conftest.py), but is collected everywhere, so a
broken import shows in CI. ``python -m minibatch.bench gpu-check`` runs them on a lent GPU, with the benchmarks.

- Greedy output of the engine on CUDA, for each attention backend ("loop", "batched", "triton"), with CUDA
  graphs (the default on CUDA) and without (``enforce_eager=True``, vLLM's switch), equals the no-cache oracle
  (``minibatch/sampling/reference.py``) run on the CPU, token for token: plain decoding, every speculation method
  (draft, ngram, medusa, eagle, early_exit) and both token trees (Medusa's static, EAGLE's dynamic).
- The kernels at fp16 and bf16 against the torch backend ("batched") on the same paged cache: a mixed batch
  (decode, prefill, chunk, verify, idle), a token tree, and the pure-decode kernel (flash_decode) at long
  contexts with the context split.
"""
from __future__ import annotations

import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.sampling.reference import generate
from minibatch.model.weights import WEIGHTS_DIR, load_model


BACKENDS = ["loop", "batched", "triton"]
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n        self.",
           "The quick brown fox"]
MAX_TOKENS = [24, 17, 30, 9]                            # sequences finish at different steps
SPECS = {   # name: speculative_config (None: plain decoding)
    "plain": None,
    "draft k=4": {"method": "draft", "num_speculative_tokens": 4},
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "medusa k=3": {"method": "medusa", "num_speculative_tokens": 3},
    "eagle k=3": {"method": "eagle", "num_speculative_tokens": 3},
    "early_exit k=3": {"method": "early_exit", "num_speculative_tokens": 3},
    "medusa static tree": {"method": "medusa", "tree": "static"},
    "eagle dynamic tree": {"method": "eagle", "tree": "dynamic"},
}


def _ids(p: str) -> list[int]:
    return list(p.encode())


@pytest.fixture(scope="module")
def cpu_oracle():
    """The no-cache oracle's greedy tokens, computed on the CPU in float32."""
    model = load_model("target", device="cpu")
    return [generate(model, _ids(p), SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def cuda_models():
    return load_model("target", device="cuda"), load_model("draft", device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", list(SPECS))
def test_engine_on_cuda_equals_the_cpu_oracle(cuda_models, cpu_oracle, spec, backend, eager):
    cfg = SPECS[spec]
    if cfg is not None and cfg["method"] not in ("draft", "ngram") \
            and not (WEIGHTS_DIR / f"{cfg['method']}.safetensors").exists():
        pytest.skip(f"no shipped {cfg['method']} checkpoint")
    target, draft = cuda_models
    llm = LLM(target, draft_model=draft if cfg and cfg["method"] == "draft" else None, speculative_config=cfg,
              attention_backend=backend, enforce_eager=eager, block_size=8, max_num_seqs=4)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    outs = llm.generate([_ids(p) for p in PROMPTS], params, use_tqdm=False)
    for i, o in enumerate(outs):
        assert o.outputs[0].token_ids == cpu_oracle[i], f"{spec}, {backend}, eager={eager}: request {i} differs"


# ----------------------------------------------------------------------------- kernels against the torch backend
def _torch_backend(batch, scale, tree_bits=None):
    from minibatch.kv.backends import paged_attention_batched
    return paged_attention_batched(*(batch[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                                                        "seq_lens", "query_start_loc")), scale, tree_bits=tree_bits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [(4, 4), (32, 8)])
def test_kernels_equal_the_torch_backend_in_half_precision(dtype, tol, heads):
    import kernels
    from test_kernels import make_batch
    H, Hkv = heads
    scale = 64 ** -0.5
    # decode, prefill, chunked prefill, verify k = 4, idle
    batch = make_batch([1, 300, 64, 5, 0, 1], [2000, 300, 900, 700, 40, 1], 16, H, Hkv, 64, dtype=dtype, seed=1)
    args = [batch[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")]
    torch.testing.assert_close(kernels.paged_attention(*args, scale), _torch_backend(batch, scale),
                               atol=tol, rtol=tol)
    # a token tree of 5 nodes over a context (parents -1, 0, 0, 1, 2): bit i of row t = node t sees node i
    tree = make_batch([5], [333], 16, H, Hkv, 64, dtype=dtype, seed=2)
    bits = torch.tensor([0b1, 0b11, 0b101, 0b1011, 0b10101], dtype=torch.int64, device="cuda")
    targs = [tree[n] for n in ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")]
    torch.testing.assert_close(kernels.paged_attention(*targs, scale, tree_bits=bits),
                               _torch_backend(tree, scale, bits), atol=tol, rtol=tol)
    # pure decode: batch 1 (many splits) and 16 (few), contexts up to 4000
    for lens in ([4000], [1, 17, 1000, 2051, 4000] + [300 + 97 * i for i in range(11)]):
        dec = make_batch([1] * len(lens), lens, 16, H, Hkv, 64, dtype=dtype, seed=len(lens))
        out = kernels.flash_decode(*(dec[n] for n in ("query", "key_cache", "value_cache", "block_tables",
                                                      "seq_lens")), scale)
        torch.testing.assert_close(out, _torch_backend(dec, scale), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- the prepared check (runs on a CPU)
def test_gpu_check_lists_its_steps_and_refuses_without_cuda(capsys, tmp_path):
    from minibatch.bench.run import main
    assert main(["gpu-check", "--dry-run"]) == 0
    steps = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in steps]
    assert names[:2] == ["gpu-tests", "attention"] and len(names) == 8
    for bench in ("batching", "speculative", "trees"):            # graphs on, then off, on the GPU
        on, off = (next(s for s in steps if s.startswith(f"{bench}-{g}")) for g in ("graphs", "eager"))
        assert "--device cuda" in on and "--enforce-eager" not in on and "--enforce-eager" in off
    with pytest.raises(SystemExit):
        main(["gpu-check", "--only", "nonsense"])
    assert "the steps are" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            main(["gpu-check", "--out", str(tmp_path)])
        assert not any(tmp_path.iterdir())


def test_every_triton_backend_test_is_marked_interpreter_or_gpu():
    """With CUDA present the interpreter is off, so a test that hands CPU tensors to the "triton" backend must carry
    the ``interpreter`` mark (skipped there) or the ``gpu`` mark (it runs on CUDA). A test id with the parameter
    ``triton`` that neither mark selects away would give compiled Triton CPU pointers on a GPU machine."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "not interpreter and not gpu", "tests"], cwd=root, capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert len(ids) > 500, out.stdout[-2000:] + out.stderr[-2000:]           # the collection itself worked
    unmarked = [i for i in ids if re.search(r"\[(?:[^\]]*-)?triton(?:-[^\]]*)?\]", i)]
    assert not unmarked, f"mark these interpreter (CPU tensors) or gpu: {unmarked}"
