"""vLLM itself as the peer: the shipped weights in vLLM's CPU build, token for token, and timed.

    python -m minibatch.bench.vllm_peer setup        make (or reuse) vLLM's venv (minibatch/bench/vllm_venv.py)
    python -m minibatch.bench vllm [--num-requests 32 --max-num-seqs 16 --max-tokens 128 --ks 4 --repeats 3
                                    --threads 1 --attention-backend cpu --cuda-graph-mode compile]

The target (and the draft) are exported with ``minibatch.export`` to a temporary GPT2LMHeadModel directory;
vLLM runs it in its venv's python (``vllm_worker.py``), in one process that holds one ``LLM`` per row,
built before the timing starts. The rows are ``bench peers``' (same workload, same timing: alternating
minibatch and vLLM runs, best of ``--repeats``, min-max spread), each checked for equal greedy tokens:
  continuous  32 long-tail requests at 16 slots, both sides continuous batching;
  plain       batch 1 (max_num_seqs=1), 4 prompts x 128 tokens;
  ngram k     prompt lookup, k drafts a step, n-grams of 1..3 on both sides;
  draft k     the draft model (vLLM's ``"method": "draft_model"``) where vLLM's CPU build runs it.
vLLM's CPU attention takes KV blocks in multiples of 32 tokens, so it keeps its own block size.
One thread a side by default (``--threads N`` for N): minibatch's engines get num_threads=N (``engine/threads.py``);
vLLM's CPU worker binds its OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND=auto``: one core for the worker's single
thread, one kept for the front end; with N > 1, cores 0..N-1). ``--attention-backend`` picks minibatch's.
vLLM runs three processes (front end, engine core, worker), so on a busy 2-core machine the spread is wide.

How each side runs on this CPU (read in the venv's vllm 0.32.0 source), and where minibatch now does the same:
  - torch.compile: vLLM compiles its model once (``compilation_config`` mode DYNAMO_TRACE_ONCE, Inductor, one
    graph for every batch size, dynamic shapes), warmed up at start-up and cached on disk. minibatch compiles its
    padded decode step per batch size with ``--cuda-graph-mode compile`` (``engine/cuda_graphs.py``); plain by
    default (the start-up cost: minibatch/kv/README.md, "On a CPU").
  - attention: vLLM's C++ kernels (``cpu_attention_with_kv_cache``, ``cpu_attn_reshape_and_cache``) read and write
    its paged cache in place; so do minibatch's "cpu" backend's (``kv/backends/cpu.py``), the default on a CPU.
  - GEMMs: vLLM makes a oneDNN matmul per linear layer with the weight prepacked
    (``model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``); minibatch calls ``F.linear`` (a transposed
    copy of each weight was tried: minibatch/kv/README.md says why it was not kept).
  - the engine core: vLLM's runs in a process of its own (``v1/engine/core_client.py``, ``MPClient``), in the
    offline ``LLM`` too; minibatch's does for ``serve`` (``--engine-core process``), while ``LLM`` steps in-process.
  - input preparation: vLLM's ``InputBatch`` keeps running requests' tokens and block tables in preallocated
    arrays; minibatch's compiled (and CUDA-graph) decode steps keep their block tables the same way
    (``engine/input_batch.py``), its plain steps build their tensors from lists.
  - the n-gram proposer is numba-compiled in vLLM (``v1/spec_decode/ngram_proposer.py``, ``@njit``).
A vLLM worker spins on its shared-memory queue for a second after its last message before it sleeps
(``distributed/device_communicators/shm_broadcast.py``, ``busy_loop_s=1``): with one thread a side it spins on
the other core; with two, the first second of minibatch's next timed run shares its cores with it.

Where minibatch's decode step goes: ``python -m minibatch.bench profile`` (minibatch/kv/README.md, "On a CPU").
"""
from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import threading

import torch

from minibatch.bench import vllm_venv
from minibatch.bench.peers import MB_ENGINE, format_rows, mb_side, parse_args, race
from minibatch.bench.workload import describe, make_workload
from minibatch.export import export_hf
from minibatch.model.tokenizer import encode
from minibatch.model.weights import load_model

WORKER = pathlib.Path(__file__).with_name("vllm_worker.py")
REPLY = "REPLY "


class VLLMPeer:
    """vLLM's offline LLM in the venv's python, one process: ``load(key, ...)``, then ``run(key, ...)``.

    in_process=True keeps vLLM's engine core and worker in that one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    the ``uni`` executor): it starts in about half the time, for tests and notebooks; the bench times vLLM's
    default, three processes.
    """

    def __init__(self, model_dir, in_process: bool = False, timeout: float = 600.0, threads: int = 1):
        why = vllm_venv.problem()
        if why:
            raise RuntimeError(why)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_LOGGING_LEVEL": "WARNING"}
        if threads > 1:               # "auto" keeps a core for the front end: bind the worker's threads to cores 0..
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        if in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.executor, self.timeout = ("uni" if in_process else None), timeout
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-peer-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(vllm_venv.vllm_python()), str(WORKER), str(model_dir)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.version = self._reply()["vllm"]

    def _pump(self) -> None:                    # stdout lines -> queue; vLLM's own log lines are dropped
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self._lines.put(json.loads(line[len(REPLY):]))
        self._lines.put(None)

    def _reply(self) -> dict:
        try:
            r = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            r = {"error": f"no answer in {self.timeout:.0f} s"}
        if r is None or "error" in r:
            self.log.flush()
            tail = pathlib.Path(self.log.name).read_text().splitlines()[-15:]
            why = r["error"] if r else f"the vLLM process ended (exit {self.proc.wait()})"
            raise RuntimeError(f"vLLM peer: {why}\n  last lines of its log ({self.log.name}):\n    " + "\n    ".join(tail))
        return r

    def _send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def load(self, key: str, speculative_config=None, max_num_seqs: int = 16, **kw) -> None:
        self._send(op="load", key=key, speculative_config=speculative_config, max_num_seqs=max_num_seqs,
                   executor=self.executor, **kw)

    def run(self, key: str, prompts: list, max_tokens: list) -> tuple[list, float]:
        """Token id lists in, greedy (token id lists, seconds of generate) out."""
        r = self._send(op="run", key=key, prompts=[list(p) for p in prompts], max_tokens=list(max_tokens))
        return r["tokens"], r["seconds"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def vllm_side(peer: VLLMPeer, key: str, prompts: list, max_tokens: list):
    ids = [encode(p) for p in prompts]
    return lambda: peer.run(key, ids, max_tokens)


def time_rows(args, peer: VLLMPeer, target, draft_dir) -> dict:
    """name -> (vLLM's configuration in words, race result); vLLM's LLMs are built (and run once) untimed."""
    wl = make_workload("longtail", num_requests=args.num_requests, seed=args.seed)
    short = [w.prompt for w in make_workload("longtail", num_requests=args.num_prompts, seed=args.seed)]
    prompts, lens, per_req = [w.prompt for w in wl], [w.max_tokens for w in wl], [w.sampling_params() for w in wl]
    kv = dict(max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size)
    from minibatch import SamplingParams
    one, n1 = SamplingParams(temperature=0, max_tokens=args.max_tokens), [args.max_tokens] * len(short)
    cases = {"continuous": ("LLM, max_num_seqs=%d" % args.max_num_seqs, None, args.max_num_seqs, prompts, lens,
                            mb_side(target, prompts, per_req, max_num_seqs=args.max_num_seqs, **kv)),
             "plain": ("LLM, max_num_seqs=1", None, 1, short, n1, mb_side(target, short, one, max_num_seqs=1))}
    for k in args.ks:
        for method, theirs in (("ngram", {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
                               ("draft", {"method": "draft_model", "model": str(draft_dir)})):
            spec = {"method": method, "num_speculative_tokens": k}
            mb = mb_side(target, short, one, max_num_seqs=1, speculative_config=spec,
                         **({"draft_model": "draft"} if method == "draft" else {}))
            cases[f"{method} k={k}"] = (f"{theirs['method']}, k={k}", {**theirs, "num_speculative_tokens": k}, 1,
                                        short, n1, mb)
    rows = {}
    for name, (words, spec, slots, ps, ns, mb) in cases.items():
        try:
            peer.load(name, spec, max_num_seqs=slots, max_num_batched_tokens=args.max_num_batched_tokens)
            peer.run(name, [encode(ps[0])], [min(8, ns[0])])                 # warm-up, untimed
        except RuntimeError as e:
            print(f"{name}: vLLM's CPU build does not run it: {str(e).splitlines()[0]}")
            continue
        rows[name] = (words, race(mb, vllm_side(peer, name, ps, ns), args.repeats))
        print(format_rows({name: rows[name]}, peer="vLLM").splitlines()[-1], flush=True)
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["setup"]:                      # make (or check and reuse) vLLM's venv
        import argparse
        argparse.ArgumentParser(prog="python -m minibatch.bench.vllm_peer setup",
                                description=vllm_venv.setup.__doc__).parse_args(argv[1:])
        return vllm_venv.setup()
    args = parse_args("python -m minibatch.bench vllm", __doc__.splitlines()[0], argv, ks=(4,))
    why = vllm_venv.problem()
    if why:
        print(f"bench vllm needs vLLM's CPU build in a venv of its own: {why}", file=sys.stderr)
        return 2
    target = load_model("target", device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    MB_ENGINE.update(num_threads=args.threads, attention_backend=args.attention_backend,
                     cuda_graph_mode=args.cuda_graph_mode, prefix_cache=args.prefix_cache)
    with tempfile.TemporaryDirectory(prefix="minibatch-export-") as tmp, torch.no_grad():
        model_dir = export_hf(target, pathlib.Path(tmp) / "target")
        draft_dir = export_hf(load_model("draft", device="cpu"), pathlib.Path(tmp) / "draft")
        with VLLMPeer(model_dir, threads=args.threads) as peer:
            print(f"vLLM {peer.version} (its venv: {vllm_venv.vllm_python()}) against minibatch, torch "
                  f"{torch.__version__}, CPU, {args.threads} thread(s) a side, minibatch's attention backend "
                  f"{args.attention_backend or 'the default (cpu on a CPU)'}, decode step "
                  f"{'compiled per batch size (cuda_graph_mode=compile)' if args.cuda_graph_mode == 'compile' else 'plain'}.\ncontinuous: "
                  f"{describe(make_workload('longtail', num_requests=args.num_requests, seed=args.seed))}\n"
                  f"batch-1 rows: {args.num_prompts} prompts x {args.max_tokens} tokens, greedy; best of "
                  f"{args.repeats} alternating runs (min-max); mb/vLLM = ratio of bests (range over rounds)")
            rows = time_rows(args, peer, target, draft_dir)
        if args.prefix_cache == "radix":
            rows["continuous, radix / hash"] = radix_against_hash(args, target)
    torch.set_num_threads(threads)
    print(format_rows(rows, peer="vLLM"))
    return 0 if all(r["same"] == r["n"] for _, r in rows.values()) else 1


def radix_against_hash(args, target) -> tuple:
    """The continuous row's minibatch side raced against itself: the radix tree (this run's) against the hash
    chain, alternating, the same tokens (issue 44's target: the tree no slower). In the table's peer columns."""
    wl = make_workload("longtail", num_requests=args.num_requests, seed=args.seed)
    prompts, per_req = [w.prompt for w in wl], [w.sampling_params() for w in wl]
    kv = dict(max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs)
    r = race(mb_side(target, prompts, per_req, **kv),
             mb_side(target, prompts, per_req, **kv, prefix_cache="hash"), args.repeats)
    print(f"continuous, radix / hash: {max(r['mb']) / max(r['hf']):.2f}x, {r['same']}/{r['n']} same", flush=True)
    return "minibatch, prefix_cache='hash'", r


if __name__ == "__main__":
    sys.exit(main())
