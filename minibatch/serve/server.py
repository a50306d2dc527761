"""Running the app: ``python -m minibatch serve`` (like ``vllm serve``), or in a background thread.

The command line takes vLLM's engine flags under vLLM's names
(``--max-num-seqs``, ``--max-num-batched-tokens``, ``--block-size``,
``--num-gpu-blocks-override``, ``--no-enable-prefix-caching``,
``--speculative-config``, ``--served-model-name``), so a lecture can put the two
commands side by side.

The engine core runs in a process of its own (``--engine-core process``, the
default, as vLLM V1's ``VLLM_ENABLE_V1_MULTIPROCESSING=1``): the model loads
there, and a bad engine flag fails the command at start-up with the engine's own
message. ``--engine-core thread`` runs it in a thread of the server's process,
as before (one GIL for the event loop and the engine). If the core process dies,
every request, open or new, gets a 503 naming the engine core; the command then
exits with status 1 after ``ENGINE_DEATH_GRACE_S`` (vLLM's API server exits too),
for a supervisor to restart it, unless ``--keep-alive-on-engine-death`` keeps it
answering 503 (vLLM's ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``).

``ServerThread`` runs the same server inside a Python process that goes on
doing other things: a test, or a notebook that serves the class while it
draws. Given an ``LLM`` it runs the engine in a thread; given a picklable
function that makes one (``functools.partial(LLM, "target")``) it starts an
engine-core process. It binds its socket before it returns, so port 0 (any
free port) is race-free and ``.url`` is ready at once.
"""
from __future__ import annotations

import argparse
import functools
import json
import socket
import sys
import threading
import time
from typing import Optional

from minibatch.engine import memory_hierarchy
from minibatch.engine.request_queue import POLICIES
from minibatch.kv import quant
from minibatch.kv.radix_allocator import PREFIX_CACHES

ENGINE_DEATH_GRACE_S = 2.0      # after the engine core dies, seconds of 503s before `serve` exits (status 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="target", help="shipped model: target (GPT-2), llama (RoPE, GQA) or draft")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV cache size in blocks")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--prefix-cache", choices=PREFIX_CACHES, default="hash",
                   help="the prefix cache: vLLM's hash chain, or SGLang's radix tree (the live view draws it)")
    p.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                   help="the waiting queue's order (lpm, dfs-weight: SGLang's cache-aware orders)")
    p.add_argument("--scheduling", choices=["continuous", "static"], default="continuous")
    p.add_argument("--attention-backend", default=None,
                   help="cpu, batched, loop (the teaching version) or triton (default: cpu on a CPU where it builds, "
                        "batched on a GPU)")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    p.add_argument("--max-pending-requests", type=int, default=256,
                   help="most unfinished requests (running + waiting); past it new ones get 503")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model's heads over this many processes (minibatch/distributed/)")
    p.add_argument("--disaggregated", action="store_true",
                   help="a prefill instance and a decode instance behind this endpoint (minibatch/distributed/)")
    p.add_argument("--engine-core", choices=["process", "thread"], default="process",
                   help="where the scheduler and model run: a process of their own (vLLM V1's split, the default) "
                        "or a thread of the server's process")
    p.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="after the engine core dies, keep answering 503 instead of exiting")
    p.add_argument("--log-level", default="info")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule step N+1 while step N's forward runs (vLLM's flag; engine/async_scheduler.py)")
    memory_hierarchy.add_arguments(p)
    quant.add_arguments(p)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (vLLM's flag)")
    p.add_argument("--cuda-graph-mode", default="auto", choices=["auto", "eager-replay", "compile"],
                   help="decode steps: auto (CUDA graphs on a GPU, plain on a CPU), compile (on a CPU: compiled per "
                        "batch size at start-up, engine/cuda_graphs.py), eager-replay (the graphs' buffers, eagerly)")
    from minibatch.engine import threads
    threads.add_argument(p)


def make_llm(args):
    from minibatch.llm import LLM
    spec = args.speculative_config
    return LLM(args.model, device=args.device, draft_model="draft" if spec and spec.get("method") == "draft" else None,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks_override,
               enable_prefix_caching=args.enable_prefix_caching, scheduling=args.scheduling,
               attention_backend=args.attention_backend, speculative_config=spec,
               tensor_parallel_size=args.tensor_parallel_size, disaggregated=args.disaggregated,
               enforce_eager=getattr(args, "enforce_eager", False),
               cuda_graph_mode=getattr(args, "cuda_graph_mode", "auto"),
               async_scheduling=getattr(args, "async_scheduling", False),
               prefix_cache=getattr(args, "prefix_cache", "hash"),
               scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
               **memory_hierarchy.config_kwargs(args), **quant.config_kwargs(args))


def make_llm_in_core(args):
    """``make_llm`` as the engine-core process runs it: --threads applies there, where the model runs."""
    from minibatch.engine import threads
    threads.use_cli(getattr(args, "threads", None))
    return make_llm(args)


def serve(args) -> int:
    if args.max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}")
    from minibatch.serve.app import build_app
    process = getattr(args, "engine_core", "process") == "process"
    name = args.served_model_name or args.model
    app = build_app(functools.partial(make_llm_in_core, args) if process else make_llm(args), served_model_name=name,
                    max_pending_requests=args.max_pending_requests, engine_core=args.engine_core if process else "thread")
    server = uvicorn_server(app, host=args.host, port=args.port, log_level=args.log_level)
    died = []
    if process:
        core = app.state.engine_loop
        print(f"minibatch: engine core in process {core.process.pid}", flush=True)

        def on_dead(why):
            died.append(why)
            if args.keep_alive_on_engine_death:
                print(f"minibatch: {why}; answering 503 (--keep-alive-on-engine-death)", file=sys.stderr, flush=True)
                return
            print(f"minibatch: {why}; exiting in {ENGINE_DEATH_GRACE_S:g} s", file=sys.stderr, flush=True)
            threading.Timer(ENGINE_DEATH_GRACE_S, lambda: setattr(server, "should_exit", True)).start()
        core.on_dead.append(on_dead)
    print(f"minibatch: serving `{name}` on http://{args.host}:{args.port}  (live view at /, API under /v1, "
          f"metrics at /metrics)", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:                 # uvicorn re-raises Ctrl-C once it has shut down cleanly
        pass
    return 1 if died else 0


def uvicorn_server(app, **config):
    """A uvicorn Server that ends the live page's endless event streams as soon as it starts shutting down:
    uvicorn waits for open responses before it tells the app to stop, so they would hold Ctrl-C up."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            app.state.feed.close()
            await super().shutdown(sockets)

    return Server(uvicorn.Config(app, timeout_graceful_shutdown=3, **config))


class ServerThread:
    """``with ServerThread(llm) as srv: OpenAI(base_url=srv.url + "/v1", ...)``; stops on exit."""

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **app_kwargs):
        from minibatch.serve.app import build_app
        self.app = build_app(llm, **app_kwargs)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._server = uvicorn_server(self.app, log_level=log_level)
        self._thread: Optional[threading.Thread] = None

    @property
    def engine_loop(self):
        return self.app.state.engine_loop

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="minibatch-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
