"""lm-evaluation-harness, an independent client, scores the repo's own tiny tasks through `python -m minibatch serve`.

lm-eval's ``local-completions`` model sends what it sends to a ``vllm serve``: loglikelihood requests with
``echo: true, max_tokens: 1, logprobs: 1`` (the prompt scored, one token generated) and generate_until
requests with ``stop``. It tokenizes through the server's vLLM endpoints (``/tokenize``, ``/tokenizer_info``:
its "remote" tokenizer), so nothing is downloaded. The tasks (tests/fixtures/lm_eval/) are code snippets: a
loglikelihood task and a generate_until task over one local jsonl file.

Checked: each loglikelihood lm-eval reports equals the offline engine's own, the sum of the continuation's
``prompt_logprobs``, to 1e-5; is_greedy agrees with the engine's ranks; each generation equals the offline
greedy output cut at the newline. The results table is printed (pytest -s).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minibatch import LLM, SamplingParams
from test_serve_load import cli_server  # noqa: F401 (the fixture: `python -m minibatch serve` on 127.0.0.1)

pytestmark = [pytest.mark.serve, pytest.mark.slow]
TASKS = Path(__file__).parent / "fixtures" / "lm_eval"


def lm_eval_python():
    """An interpreter with lm-eval: this one (CI installs it, .ci/run), or $LM_EVAL_PYTHON (a venv of its own)."""
    if importlib.util.find_spec("lm_eval") is not None:
        return sys.executable
    other = os.environ.get("LM_EVAL_PYTHON")
    return other if other and Path(other).exists() else None


def test_lm_eval_loglikelihoods_equal_the_engines(cli_server, tmp_path, capsys):  # noqa: F811
    python = lm_eval_python()
    if python is None:
        pytest.skip("lm-eval is not installed (pip install 'lm_eval[api]'; or set LM_EVAL_PYTHON)")
    args = ",".join([f"base_url={cli_server}/v1/completions", "model=target", "tokenizer_backend=remote",
                     "tokenized_requests=True", "max_length=511", "num_concurrent=4", "max_retries=1"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([python, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", args,
                          "--tasks", "minibatch_code_loglikelihood,minibatch_code_generate", "--include_path", ".",
                          "--output_path", str(tmp_path), "--log_samples"],
                         cwd=TASKS, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    with capsys.disabled():
        print("\n" + run.stdout[run.stdout.find("|"):])
    samples = {p.name.split("_2")[0]: [json.loads(line) for line in p.open()] for p in tmp_path.rglob("samples_*")}
    ll, gen = samples["samples_minibatch_code_loglikelihood"], samples["samples_minibatch_code_generate"]
    docs = [json.loads(line) for line in (TASKS / "code_snippets.jsonl").open()]
    assert len(ll) == len(gen) == len(docs)

    llm = LLM("target", device="cpu")
    for s in ll:
        ctx, tgt = s["doc"]["context"], s["doc"]["target"]
        cut = len(ctx.rstrip())                  # lm-eval moves a context's trailing whitespace to the continuation
        ctx, tgt = ctx[:cut], ctx[cut:] + tgt
        out = llm.generate([ctx + tgt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        n, ids = len(ctx.encode()), out.prompt_token_ids
        entries = out.prompt_logprobs[n:]
        mine = sum(e[t].logprob for e, t in zip(entries, ids[n:]))
        greedy = all(e[t].rank == 1 for e, t in zip(entries, ids[n:]))
        theirs, their_greedy = s["resps"][0][0]
        assert float(theirs) == pytest.approx(mine, abs=1e-5), ctx
        assert (their_greedy in (True, "True")) == greedy
    for s in gen:
        want = llm.generate([s["doc"]["context"]], SamplingParams(temperature=0, max_tokens=16, stop=["\n"]),
                            use_tqdm=False)[0].outputs[0].text
        assert s["resps"][0][0] == want
