"""CUDA graphs for decode steps, nano-vllm's way (``nanovllm/engine/model_runner.py``: ``capture_cudagraph``,
``run_model``).

Why: the 4-layer target does microseconds of arithmetic per decode step, and launching its ~50-200 kernels
one by one from Python costs far more. A CUDA graph records the launches once and replays them all with one
call. What a graph needs is fixed addresses and fixed shapes, so:

* the step's inputs live in persistent buffers (``input_batch.DecodeBuffers``), written before each replay;
* the batch is padded up to the next captured size, with rows that feed token 0 at position 0, store their K/V
  nowhere (slot -1) and attend over a context of length 0; their logits are computed and dropped;
* the captured sizes are 1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (``capture_sizes``), captured
  largest first after one warm-up run each, all in one memory pool (a smaller graph's memory fits inside
  the largest's);
* only a **pure-decode** step replays: every sequence feeds one token, no drafts, no tree, no padding rows of
  static batching, no hidden states a proposer reads, and at most the largest captured size. Prefill,
  chunked prefill, verification, trees and larger batches run eagerly, as before (``ModelRunner.execute``).
* the backend must be graph-safe (``attention.GRAPH_SAFE_BACKENDS``): no host sync and no shape that depends
  on the data inside the forward (tests/test_host_sync.py holds "batched" to that on the CPU).

Modes (``EngineConfig.cuda_graph_mode``): "auto" captures on CUDA (unless ``enforce_eager=True``) and does
nothing on the CPU, where there is nothing to capture; "eager-replay" runs the very same padded buffers and
fixed-shape forward eagerly, with no capture, on any device: it is how CI, with no GPU, holds the graph path
token for token equal to the plain one (tests/test_cuda_graphs.py).

"compile" is the CPU's counterpart of capturing (vLLM's CPU runner compiles its model the same way): the same
padded forward, ``torch.compile``d (Inductor, ``fullgraph``, fixed shapes) once per size at start-up, largest
first, then called with the buffers rewritten. It needs the "cpu" attention backend, whose store and attention
are ``torch.library`` operators that Inductor calls as they are; "batched"'s store writes the cache with
``index_copy_`` on a view, which a compiled graph turns into a copy of the whole cache every layer (measured:
70 tokens/s against 2,800). What it buys, and why it is not the default on the CPU, is in minibatch/kv/README.md
("On a CPU: where a decode step goes"): each size takes seconds to compile on a laptop, for a full-batch step
about 5 % faster (at batch 1, where Python is most of a step, far more).

On a machine with a GPU, run (about two minutes): the `gpu` tests, then a batch-16 decode step with graphs
against eager in the same process (alternating, best of several; minibatch/kv/README.md's "On a GPU" wants its figures):

    python3 -m pytest -m gpu -q tests/test_cuda_graphs.py && python3 -m minibatch.engine.cuda_graphs --device cuda
"""
from __future__ import annotations

from typing import Optional

import torch

from minibatch.engine.input_batch import DecodeBuffers
from minibatch.kv.attention import GRAPH_SAFE_BACKENDS, PagedAttention

MODES = ("auto", "eager-replay", "compile")
COMPILE_BACKENDS = ("cpu",)          # whose store and attention are operators Inductor calls as they are


def capture_sizes(max_num_seqs: int) -> list:
    """nano-vllm's batch sizes: 1, 2, 4, 8, then every 16 up to max_num_seqs (each <= max_num_seqs)."""
    return [b for b in (1, 2, 4, 8) if b <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))


def make_graph_runner(config, model, kv_cache, needs_hidden: bool) -> Optional["CUDAGraphRunner"]:
    """The engine's graph runner, or None (every step eager), from the config; device-dependent misuse is a
    clear error here, at construction."""
    c, device = config, model.device
    safe = c.attention_backend in GRAPH_SAFE_BACKENDS
    compile_ = c.cuda_graph_mode == "compile"
    if compile_:
        if c.attention_backend not in COMPILE_BACKENDS:
            raise ValueError(f"cuda_graph_mode='compile' needs the attention backend 'cpu' (its store and attention "
                             f"are operators a compiled graph calls in place); got {c.attention_backend!r}")
        if device.type != "cpu":
            raise ValueError(f"cuda_graph_mode='compile' is the CPU's counterpart of CUDA graphs; this engine runs "
                             f"on {device}, where 'auto' captures graphs")
        if c.tensor_parallel_size > 1:
            raise ValueError("cuda_graph_mode='compile' runs one process's forward; with tensor_parallel_size > 1 "
                             "each forward is broadcast to the workers: leave cuda_graph_mode='auto'")
        capture = False
    elif c.cuda_graph_mode == "eager-replay":
        if not safe:
            raise ValueError(f"cuda_graph_mode='eager-replay' needs a graph-safe attention backend, one of "
                             f"{list(GRAPH_SAFE_BACKENDS)}; got {c.attention_backend!r}")
        capture = False
    elif device.type != "cuda":
        if c.cuda_graph_sizes is not None:
            raise ValueError(f"cuda_graph_sizes is a CUDA option, and this engine runs on {device}: there is "
                             f"nothing to capture (cuda_graph_mode='eager-replay' runs the same buffers eagerly)")
        return None
    elif c.tensor_parallel_size > 1:   # each forward broadcasts its inputs to the workers: no capturing that
        return None
    elif c.enforce_eager or not safe:
        if c.cuda_graph_sizes is not None and not safe:
            raise ValueError(f"cuda_graph_sizes needs a graph-safe attention backend, one of "
                             f"{list(GRAPH_SAFE_BACKENDS)}; got {c.attention_backend!r}")
        return None
    else:
        capture = True
    if needs_hidden:                   # a proposer reads hidden states at every step (Medusa, EAGLE): eager
        return None
    sizes = list(c.cuda_graph_sizes) if c.cuda_graph_sizes is not None else capture_sizes(c.max_num_seqs)
    return CUDAGraphRunner(model, kv_cache, c.attention_backend, sizes, capture, compile_)


class CUDAGraphRunner:
    """Runs a pure-decode step through fixed buffers: replaying its captured graph, calling its compiled forward
    (``compile=True``, on the CPU), or (neither) the same padded forward eagerly.
    ``run(tokens, tables, computed) -> logits [B, V]``."""

    def __init__(self, model, kv_cache, backend: str, sizes: list, capture: bool, compile: bool = False):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes, self.capture = sorted(sizes), capture
        self.buffers = DecodeBuffers(self.sizes[-1], model.config.n_ctx, kv_cache.block_size, model.device)
        self.graphs: dict = {}                 # padded size -> torch.cuda.CUDAGraph
        self.logits: dict = {}                 # padded size -> its output buffer [P, V], rewritten by each replay
        self.compiled = None                   # compile: torch.compile(self._forward), one graph per padded size
        if capture:
            self._capture()
        if compile:
            self._compile()

    def padded_size(self, batch: int) -> Optional[int]:
        """The smallest captured size >= batch, or None (the batch runs eagerly)."""
        return next((p for p in self.sizes if p >= batch), None)

    def _forward(self, padded: int) -> torch.Tensor:
        """The model over the first ``padded`` rows of the buffers -> logits [padded, V] (every row samples)."""
        b = self.buffers
        attn = PagedAttention(self.kv_cache, b.metadata(padded), self.backend)
        return self.model(b.dev["input_ids"][:padded], b.dev["positions"][:padded], attn)

    @torch.inference_mode()
    def _capture(self) -> None:
        # The warm-up and the capture run real forwards: row 0 writes slot 0, before any request owns a block
        # (the engine captures at construction), and every later reader of a block has written it first.
        pool = None
        for P in reversed(self.sizes):                      # largest first: one pool, the others fit in it
            self.buffers.fill([0], [[0]], [0], P)
            self._forward(P)                                # warm-up: lazy inits, Triton compiles
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool):
                self.logits[P] = self._forward(P)
            pool = pool if pool is not None else g.pool()
            self.graphs[P] = g
        torch.cuda.synchronize()

    @torch.inference_mode()
    def _compile(self) -> None:
        # Traced once per size here, at start-up, as graphs are captured: row 0 writes slot 0 before any request
        # owns a block. dynamic=False: each size its own graph, fixed shapes as a captured graph's; the padded size
        # is a Python int, so each size is one guarded entry (the cache limit is raised to hold them all).
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(self.sizes))
        self.buffers.fill([0], [[0]], [0], self.sizes[0])
        self._forward(self.sizes[0])                        # eager warm-up first: lazy inits (the C++ build)
        self.compiled = torch.compile(self._forward, dynamic=False, fullgraph=True)
        for P in reversed(self.sizes):
            self.buffers.fill([0], [[0]], [0], P)
            self.compiled(P)

    def run(self, tokens: list, tables: list, computed: list, seq_ids=None) -> torch.Tensor:
        """One decode row per sequence b: token tokens[b] at position computed[b], block table tables[b]
        (seq_ids[b]: which sequence, so that a row keeps its block table written from one step to the next)."""
        B = len(tokens)
        P = self.padded_size(B)
        if P is None:
            raise ValueError(f"a decode batch of {B} is over the largest captured size {self.sizes[-1]}")
        self.buffers.fill(tokens, tables, computed, P, seq_ids)
        if self.capture:
            self.graphs[P].replay()
            return self.logits[P][:B]
        return (self.compiled or self._forward)(P)[:B]
