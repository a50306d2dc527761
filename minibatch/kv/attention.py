"""Paged attention's inputs: the metadata of one flat batch, checked once, and the per-layer call.

One engine step feeds the model T new tokens from B sequences: sequence b owns
query rows ``query_start_loc[b] : query_start_loc[b+1]`` (q_len_b of them) and
has ``seq_lens[b]`` tokens of context *including* those new ones, so its query
i sits at position ``seq_lens[b] - q_len_b + i`` and attends causally to
positions 0..that. Decode (q_len 1), a prefill, a later prefill chunk and a
speculative verification (1 + k queries) are all this one case (vLLM's
"unified" attention; Kwon et al., SOSP'23, §4.1 for the paged form).

A token tree (``minibatch/kv/tree.py``) is verified the same way, plus one mask: its root and
N drafts are the sequence's q_len = N + 1 new tokens, node i at cache index ``context_len + i``, but at
position ``context_len + depth[i]``, and it sees the context and its own ancestors only (SpecInfer, Miao
et al. 2024, §4.1 "tree attention"). ``tree_bits[t]`` carries row t's mask as one int64: bit j set =
it sees this step's token j (``tree.mask_bits``); -1 (every bit) is plain causal, and a step without a
tree has ``tree_bits = None`` and costs nothing extra.

``AttentionMetadata.build`` turns the scheduler's plain lists (block tables, tokens
already computed, new tokens) into tensors *once per step*, checking them as it
goes; ``positions`` come from here too, so the model is fed the positions the
attention assumes. Per layer, ``PagedAttention`` then **stores** the new tokens'
K and V at their slots (the slot mapping) and **attends** through a backend
(``minibatch/kv/backends/``, one module each): "loop" (the teaching version), "batched" (the
default on a GPU), "triton" (``kernels/``) or "cpu" (the default on a CPU: a C++ operator that reads the
blocks in place, ``backends/cpu_kernel.py``, with SDPA for long prefill chunks). The per-layer call checks nothing
again, unless ``MINIBATCH_DEBUG_CHECKS=1`` (or ``PagedAttention(..., debug=True)``)
asks every backend to re-check its inputs on every call.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from minibatch.kv import backends, checks
from minibatch.kv.kv_cache import KVCache
from minibatch.kv.metadata import AttentionMetadata

BACKENDS = ("loop", "batched", "triton", "cpu")
# Backends whose decode forward has no host sync and no data-dependent shape (tests/test_host_sync.py): they can
# run a static batch, so CUDA graphs can capture them. "loop" reads lengths back to the host (the teaching version);
# "cpu" runs on the host only, where no graph is captured.
GRAPH_SAFE_BACKENDS = ("batched", "triton")
RENAMED = {"torch": "loop", "dense": "batched"}       # the names before the re-founding said less


def check_backend(name) -> str:
    if name is None:                   # the engine chooses (default_backend), once it knows the device
        return name
    if name in RENAMED:
        raise ValueError(f"attention backend {name!r} is now called {RENAMED[name]!r}; choose one of {list(BACKENDS)}")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {list(BACKENDS)}")
    return name


def default_backend(device, cuda_graph_mode: str = "auto") -> str:
    """What ``attention_backend=None`` means, as vLLM picks its backend from the platform: on a CPU the C++
    operator "cpu" where it builds (where not, it says why once and this gives "batched"; cuda_graph_mode=
    "compile" then stops, saying it needs "cpu"), except under cuda_graph_mode="eager-replay", whose static
    batch needs a graph-safe backend; "batched" on a GPU."""
    if torch.device(device).type == "cpu" and cuda_graph_mode != "eager-replay":
        return "cpu" if backends.cpu_kernel.load() is not None else "batched"
    return "batched"


# read once: the engine builds a PagedAttention every step
DEBUG_CHECKS = os.environ.get("MINIBATCH_DEBUG_CHECKS", "") not in ("", "0")


class PagedAttention:
    """``model(input_ids, positions, PagedAttention(kv_cache, metadata))``: store, then attend, per layer."""

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata, backend: str = "batched",
                 debug: Optional[bool] = None):
        check_backend(backend)
        if not isinstance(kv_cache, KVCache) or not isinstance(metadata, AttentionMetadata):
            raise TypeError("PagedAttention(kv_cache: KVCache, metadata: AttentionMetadata, backend)")
        self.debug = DEBUG_CHECKS if debug is None else bool(debug)
        if self.debug or metadata.block_tables.device != kv_cache.device:
            T = metadata.slot_mapping.shape[0]
            checks.check_metadata(metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                                  kv_cache.num_blocks, kv_cache.block_size, T, kv_cache.device, "PagedAttention")
            if metadata.slot_mapping.device != kv_cache.device:
                raise ValueError(f"PagedAttention: slot_mapping is on {metadata.slot_mapping.device}, "
                                 f"the cache on {kv_cache.device}")
        if metadata.max_block_id >= kv_cache.num_blocks:
            raise ValueError(f"PagedAttention: a block table holds block {metadata.max_block_id}, but the cache has "
                             f"{kv_cache.num_blocks} blocks")
        if kv_cache.kv_cache_dtype != "auto" and backend not in backends.QUANTIZED_BACKENDS:
            raise ValueError(f"PagedAttention: kv_cache_dtype {kv_cache.kv_cache_dtype!r} is read by the attention "
                             f"backends {list(backends.QUANTIZED_BACKENDS)} only so far, not {backend!r}")
        self._store, self._attend = backends.get(backend, checked=self.debug)
        self.kv_cache, self.metadata, self.backend = kv_cache, metadata, backend

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c, md = self.kv_cache, self.metadata
        if self.debug:
            checks.check_layer_inputs(c, md, q, k, v)
        key_cache, value_cache = c.key_cache(layer_idx), c.value_cache(layer_idx)
        c.calibrate(layer_idx, k, v)             # calculate_kv_scales: the first batch sets the layer's scales
        scales = c.layer_scales(layer_idx)       # {} unless the blocks are quantized (kv/quant.py)
        self._store(k, v, key_cache, value_cache, md.slot_mapping, **scales)      # 1) this step's K/V into their slots
        return self._attend(q, key_cache, value_cache, md, c.head_dim ** -0.5, **scales)   # 2) attend
