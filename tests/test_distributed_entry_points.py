"""The command line and the server with tensor parallelism and disaggregation: real processes, real HTTP."""
from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

import httpx
import pytest

from minibatch import LLM, SamplingParams
from minibatch.serve import ServerThread
from minibatch.engine.core import engine_state, idle_check
from minibatch.serve.server import add_arguments, make_llm_in_core

ROOT = pathlib.Path(__file__).resolve().parents[1]       # this checkout, whatever an editable install points at


def test_generate_with_tensor_parallel_size_2_prints_the_same_text(target_model):
    want = LLM(target_model).generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=16))[0]
    run = subprocess.run([sys.executable, "-m", "minibatch", "generate", "def fib(n):", "--max-tokens", "16",
                          "--tensor-parallel-size", "2", "--device", "cpu"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "def fib(n):" + want.outputs[0].text + "\n"
    bad = subprocess.run([sys.executable, "-m", "minibatch", "generate", "x", "-tp", "3", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "does not divide the model's 4 attention heads" in bad.stderr


@pytest.mark.serve
@pytest.mark.parametrize("option", ["--disaggregated", "--tensor-parallel-size=2"])
def test_serve_answers_as_colocated_with_its_engine_core_in_a_process(target_model, option):
    """As `python -m minibatch serve` runs them: the engine core in a process of its own (the default), which
    starts processes of its own (a prefill and a decode instance; two tensor-parallel workers). Same text, whole
    and streamed, and every block back in the pool(s) once idle."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args([option, "--device", "cpu", "--max-num-seqs", "4"])
    body = {"model": "target", "prompt": "import os\n", "max_tokens": 12, "temperature": 0}
    want = LLM(target_model).generate(["import os\n"], SamplingParams(temperature=0, max_tokens=12))[0]
    with ServerThread(functools.partial(make_llm_in_core, args), engine_core="process") as srv:
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want.outputs[0].text
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        # the deltas arrive in as many chunks as the server found them: a reader that falls behind the engine gets
        # several steps merged (as vLLM's AsyncLLM merges them), on a loaded 2-core machine the whole answer at once
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == want.outputs[0].text
        deadline = time.monotonic() + 20
        while srv.engine_loop.call(engine_state).result(10)["has_unfinished"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.engine_loop.call(idle_check).result(30)["error"] is None
        if option == "--disaggregated":                  # each instance's pool, checked in its own process
            assert len(srv.engine_loop.call(pool_stats).result(30)) == 2
        assert srv.engine_loop.error is None and srv.engine_loop.process.is_alive()


def pool_stats(engine) -> dict:                          # run in the engine core (a call must pickle)
    return engine.pool_stats()


@pytest.mark.parametrize("option", ["tensor_parallel_size=2", "disaggregated=True"])
def test_a_script_without_a_main_guard_gets_a_clear_error_at_once(tmp_path, option):
    """Worker processes are spawned and import the main module again: a script that starts them at its top
    level is told so as soon as a worker dies, instead of waiting out the group's timeout."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"from minibatch import LLM\nLLM('target', device='cpu', {option})\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MINIBATCH_DIST_TIMEOUT": "100", "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0
    assert 'guard its entry point with `if __name__ == "__main__":`' in run.stderr
