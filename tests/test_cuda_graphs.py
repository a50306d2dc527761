"""CUDA graphs for decode (engine/cuda_graphs.py): the graph path equals the plain one, token for token.

On the CPU, cuda_graph_mode="eager-replay" runs exactly what a graph would replay (the fixed buffers, the batch
padded up to a captured size with slot -1 / length 0 rows, the fixed-shape forward), with no capture; CI holds
it to the plain path at batch sizes 1, 3, 16 and 17, with sequences finishing mid-batch, greedy and seeded.
The `gpu` test replays real graphs under torch.cuda.set_sync_debug_mode("error").
"""
import pytest
import torch

from minibatch import LLM, SamplingParams
from minibatch.engine.config import EngineConfig
from minibatch.engine.cuda_graphs import capture_sizes
from minibatch.model.data import val_documents

DOCS = val_documents(17, min_len=200, seed=5)


def workload(n, seeded):
    prompts = [list(DOCS[i][: 3 + 7 * i]) for i in range(n)]        # 3 .. 115 bytes: mixed lengths
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=i, max_tokens=4 + i % 5) if seeded
              else SamplingParams(temperature=0, max_tokens=4 + i % 5) for i in range(n)]   # finish mid-batch
    return prompts, params


def generate(model, prompts, params, **cfg):
    llm = LLM(model, max_num_batched_tokens=2048, **cfg)
    runner, calls = llm.llm_engine.model_runner.graphs, []
    if runner is not None:                          # count the steps that went through the graph buffers
        run = runner.run
        runner.run = lambda *a: calls.append(len(a[0])) or run(*a)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], calls


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("n,max_num_seqs", [(1, 32), (3, 32), (16, 32), (17, 32), (17, 17)])
def test_replay_without_capture_equals_the_plain_path(target_model, n, max_num_seqs, seeded):
    prompts, params = workload(n, seeded)
    plain, none = generate(target_model, prompts, params, max_num_seqs=max_num_seqs)
    graph, calls = generate(target_model, prompts, params, max_num_seqs=max_num_seqs, cuda_graph_mode="eager-replay")
    assert none == [] and graph == plain
    largest = capture_sizes(max_num_seqs)[-1]
    assert calls and max(calls) <= largest, "the decode steps went through the graph buffers, up to the largest"
    assert n > largest or max(calls) == n, "every decode step of a batch within the captured sizes did"
    assert len(set(calls)) > 1 or n == 1, "sequences finished mid-batch, and the batch shrank"


@pytest.mark.interpreter
def test_replay_without_capture_equals_the_plain_path_on_triton(target_model):
    """The other graph-safe backend: Triton's kernels over the padded buffers (through the interpreter on the
    CPU; a batch of 3 padded to 4, so one row has slot -1 and length 0)."""
    prompts, params = workload(3, seeded=False)
    params = [SamplingParams(temperature=0, max_tokens=2 + i) for i in range(3)]
    plain, _ = generate(target_model, prompts, params, attention_backend="triton")
    graph, calls = generate(target_model, prompts, params, attention_backend="triton", cuda_graph_mode="eager-replay")
    assert graph == plain and calls and max(calls) == 3


@pytest.mark.parametrize("name", ["target", "llama"])
def test_the_compiled_decode_step_equals_the_plain_path(name):
    """cuda_graph_mode="compile" (the CPU's counterpart of capture): the padded decode forward, compiled once at
    start-up (fullgraph: a graph break is an error, not a silent fallback), equals the plain path token for token,
    greedy and seeded, with a batch of 3 padded to 4 (a padding row stores nowhere and reads nothing) shrinking
    as sequences finish; the GPT and the Llama (RoPE, GQA)."""
    from minibatch.kv.backends import cpu_kernel
    if cpu_kernel.load() is None:
        pytest.skip("the 'cpu' backend's operator cannot be built here")
    from minibatch.model.weights import load_model
    model = load_model(name)
    llm = LLM(model, max_num_batched_tokens=2048, cuda_graph_mode="compile", cuda_graph_sizes=[4])
    runner, calls = llm.llm_engine.model_runner.graphs, []
    assert runner.compiled is not None and llm.llm_engine.config.attention_backend == "cpu"
    run = runner.run
    runner.run = lambda *a: calls.append(len(a[0])) or run(*a)
    for seeded in (False, True):
        prompts, params = workload(3, seeded)
        plain, _ = generate(model, prompts, params)
        compiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert compiled == plain, f"seeded={seeded}"
    assert calls and max(calls) == 3 and min(calls) < 3, "decode steps went through the compiled step, shrinking"


def test_the_decode_buffers_keep_block_tables_and_write_what_changed():
    """The persistent input batch (input_batch.py): a row that still holds a sequence gets only its new blocks
    written; a row another sequence takes, or whose blocks changed (copy-on-write, preemption), is written whole;
    after every fill the buffer holds exactly the tables given, -1 past them and in the padding rows."""
    from minibatch.engine.input_batch import DecodeBuffers
    buf = DecodeBuffers(4, n_ctx=64, block_size=4, device="cpu")          # width 16

    def fill(tables, ids, padded=4):
        before = buf.table_writes
        buf.fill([1] * len(tables), tables, [4 * len(t) - 1 for t in tables], padded, ids)
        want = torch.full((padded, 16), -1, dtype=torch.int32)
        for b, t in enumerate(tables):
            want[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        assert torch.equal(buf.host["block_tables"][:padded], want)
        return buf.table_writes - before

    assert fill([[3, 4], [7]], ["a", "b"]) == 2 * 16                       # both new: written whole
    assert fill([[3, 4], [7]], ["a", "b"]) == 0                            # nothing changed
    assert fill([[3, 4, 9], [7]], ["a", "b"]) == 1                         # a's new block only
    assert fill([[3, 4, 11], [7]], ["a", "b"]) == 16                       # copy-on-write: a's last block replaced
    assert fill([[7], [5, 6]], ["b", "c"]) == 2 * 16                       # a left, rows shifted, c joined
    assert fill([[7], [8, 2]], ["b", "c"]) == 16                           # c preempted, resumed on other blocks
    assert fill([[7]], ["b"], padded=2) == 0 and buf.held[1] is None       # c left: its row is padding now
    assert fill([[7], [8, 2]], ["b", "c"]) == 16                           # ... so c's return is written whole
    assert fill([[7], [8, 2]], None) == 2 * 16                             # without ids: every row, every step


def test_compile_needs_the_cpu_backend(target_model):
    with pytest.raises(ValueError, match="compile' needs the attention backend 'cpu'"):
        LLM(target_model, attention_backend="batched", cuda_graph_mode="compile")
    with pytest.raises(ValueError, match="turns CUDA graphs off"):
        EngineConfig(enforce_eager=True, cuda_graph_mode="compile")


def test_the_graph_path_applies_controls_grammars_and_logprobs(target_model):
    """A replayed decode step goes through the same processing as an eager one: the requests' sampling controls,
    a grammar's mask, and the logprobs they ask for (the graph path once skipped them, silently)."""
    from minibatch.sampling.structured.params import StructuredOutputsParams
    prompts, _ = workload(4, seeded=False)
    params = [SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.8, logprobs=2),
              SamplingParams(temperature=0, max_tokens=8, logit_bias={32: -100.0, 10: -100.0}),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-f]{8}")),
              SamplingParams(temperature=0.9, seed=3, max_tokens=8, presence_penalty=1.5, logprobs=1)]

    def run(**cfg):
        llm = LLM(target_model, **cfg)
        runner, calls = llm.llm_engine.model_runner.graphs, []
        if runner is not None:
            run_ = runner.run
            runner.run = lambda *a: calls.append(len(a[0])) or run_(*a)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.token_ids, [{t: round(l.logprob, 4) for t, l in d.items()} for d in o.logprobs or []])
                for o in outs], calls
    plain, _ = run()
    graph, calls = run(cuda_graph_mode="eager-replay")
    assert calls and graph == plain
    assert all(c in b"abcdef" for c in plain[2][0]) and 32 not in plain[1][0] and plain[0][1]


def test_sizes_are_nano_vllms():
    assert capture_sizes(1) == [1] and capture_sizes(3) == [1, 2]
    assert capture_sizes(17) == [1, 2, 4, 8, 16] and capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_cpu_engines_do_not_capture(target_model):
    assert LLM(target_model).llm_engine.model_runner.graphs is None
    assert LLM(target_model, enforce_eager=True).llm_engine.model_runner.graphs is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(cuda_graph_sizes=[1, 2, 64], max_num_seqs=32), "over max_num_seqs=32"),
    (dict(cuda_graph_sizes=[]), "non-empty list"),
    (dict(cuda_graph_sizes=[0]), "cuda_graph_sizes must be an int >= 1"),
    (dict(cuda_graph_mode="capture"), "choose one of"),
    (dict(enforce_eager=True, cuda_graph_mode="eager-replay"), "turns CUDA graphs off"),
    (dict(enforce_eager="yes"), "True or False"),
])
def test_bad_graph_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_cuda_only_options_on_a_cpu_engine_are_clear_errors(target_model):
    with pytest.raises(ValueError, match="CUDA option, and this engine runs on cpu"):
        LLM(target_model, cuda_graph_sizes=[1, 2])
    with pytest.raises(ValueError, match="graph-safe attention backend"):
        LLM(target_model, attention_backend="loop", cuda_graph_mode="eager-replay")
    LLM(target_model, cuda_graph_sizes=[1, 2], cuda_graph_mode="eager-replay")      # the CPU mode takes them


def test_a_position_past_the_context_is_an_error_at_the_boundary(target_model):
    """Checked on host values before the forward (on CUDA, wpe out of range would be a device-side assert)."""
    from minibatch.engine.model_runner import ModelRunner
    runner = LLM(target_model).llm_engine.model_runner
    with pytest.raises(ValueError, match="position 512 is past the context length 512"):
        ModelRunner._check_context(runner, [500, 3], [13, 1])
    ModelRunner._check_context(runner, [500, 3], [12, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["batched", "triton"])
def test_graph_replay_does_not_sync_and_equals_eager_on_cuda(backend):
    """Real graphs on a GPU: replay under set_sync_debug_mode("error") (a sync inside raises), greedy output
    equal to enforce_eager's."""
    from minibatch.model.weights import load_model
    model = load_model("target", device="cuda")
    prompts, params = workload(17, seeded=False)
    eager, _ = generate(model, prompts, params, attention_backend=backend, enforce_eager=True)
    llm = LLM(model, attention_backend=backend, max_num_batched_tokens=2048)
    runner = llm.llm_engine.model_runner.graphs
    assert runner is not None and runner.graphs, "graphs are on by default on CUDA"
    replay, replays = runner.run, []

    def strict(*a):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return replay(*a)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            replays.append(len(a[0]))
    runner.run = strict
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert replays and [o.outputs[0].token_ids for o in outs] == eager


def test_enforce_eager_on_the_command_lines(capsys):
    """vLLM's --enforce-eager, and --cuda-graph-mode: accepted by generate (the same text each way on a CPU, the
    compiled step included) and by serve's parser; both at once is a clear error."""
    import argparse

    from minibatch.__main__ import main
    from minibatch.serve.server import add_arguments, make_llm
    from minibatch.kv.backends import cpu_kernel
    texts = []
    modes = [[], ["--enforce-eager"]] + ([["--cuda-graph-mode", "compile"]] if cpu_kernel.load() else [])
    for extra in modes:
        assert main(["generate", "def f(x):", "--max-tokens", "6", "--device", "cpu", *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert all(t == texts[0] for t in texts) and texts[0]
    assert main(["generate", "def f(x):", "--enforce-eager", "--cuda-graph-mode", "compile"]) == 2   # a clear error
    assert "turns CUDA graphs off" in capsys.readouterr().err
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--enforce-eager", "--device", "cpu"])
    assert make_llm(args).llm_engine.config.enforce_eager is True
    assert p.parse_args(["--cuda-graph-mode", "compile"]).cuda_graph_mode == "compile"
