"""The thread default (minibatch/engine/threads.py): every entry point leaves torch with the engine's choice
(1 thread for the shipped models), not torch's default of one per core, and --threads / num_threads override it.

Each test starts from 2 threads, which is what torch picks on this 2-core machine, so a path that forgot the
default would leave 2 and fail. Speed is the README's to measure, not asserted here.
"""
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.__main__ import main as cli
from minibatch.bench.run import main as bench
from minibatch.engine import threads
from minibatch.engine.config import EngineConfig


@pytest.fixture(autouse=True)
def contended(monkeypatch):
    n = torch.get_num_threads()
    monkeypatch.setattr(threads, "_cli_threads", None)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_default_follows_the_model_size_and_the_machine(target_model, monkeypatch):
    assert threads.default_num_threads(target_model.num_params()) == 1          # 3.4 M parameters
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    assert threads.default_num_threads(124_000_000) == 3                         # GPT-2 small: 124 M // 32 M
    assert threads.default_num_threads(10**12) == 8                              # never more than the cores
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    assert threads.default_num_threads(124_000_000) == 2


def test_llm_construction_applies_it_and_num_threads_overrides(target_model):
    LLM(target_model, max_num_seqs=1)
    assert torch.get_num_threads() == 1
    llm = LLM(target_model, max_num_seqs=1, num_threads=2)
    assert torch.get_num_threads() == 2
    assert llm.generate("x", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=bad)
    with pytest.raises(ValueError, match="num_threads"):
        threads.use_cli(bad)


def test_generate_picks_one_thread_and_threads_overrides(capsys):
    assert cli(["generate", "def f(", "--max-tokens", "2", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert cli(["generate", "def f(", "--max-tokens", "2", "--device", "cpu", "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    assert cli(["generate", "def f(", "--max-tokens", "2", "--device", "cpu", "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    assert cli(["generate", "def f(", "--max-tokens", "2", "--threads", "0"]) == 2
    assert "num_threads" in capsys.readouterr().err


def test_demo_and_serve_set_it_before_any_work(capsys):
    assert cli(["demo", "no-such-scenario"]) == 2              # the default is applied before the scenario fails
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert cli(["serve", "--max-pending-requests", "0"]) == 2  # refused before serving, after the default
    assert torch.get_num_threads() == 1
    assert cli(["serve", "--max-pending-requests", "0", "--threads", "2"]) == 2
    assert torch.get_num_threads() == 2


def test_the_server_engine_gets_it():
    import argparse
    from minibatch.serve.server import add_arguments, make_llm
    p = argparse.ArgumentParser()
    add_arguments(p)
    make_llm(p.parse_args(["--device", "cpu", "--max-num-seqs", "1"]))
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("which", ["batching", "speculative", "peers", "vllm", "trees", "online", "kv", "attention",
                                   "serve"])
def test_every_bench_sets_it_from_its_command_line(which):
    with pytest.raises(SystemExit):                           # a bad option: each bench stops at its parser
        bench([which, "--no-such-option"])
    assert torch.get_num_threads() == 1
    with pytest.raises(SystemExit):
        bench([which, "--threads", "2", "--no-such-option"])
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("which,module", [("peers", "minibatch.bench.peers"), ("vllm", "minibatch.bench.vllm_peer")])
def test_the_peer_benches_get_the_thread_count_for_both_sides(which, module, monkeypatch):
    """`bench vllm --threads 2` once lost its 2 to the front parser and timed one thread a side, saying so."""
    import importlib
    from minibatch.bench.peers import parse_args
    seen = []
    monkeypatch.setattr(importlib.import_module(module), "main", lambda argv: seen.append(parse_args("x", "x", argv)))
    bench([which, "--threads", "2", "--repeats", "1"])
    assert seen[0].threads == 2 and seen[0].repeats == 1
