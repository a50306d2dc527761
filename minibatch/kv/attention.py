"""Paged attention's inputs: the metadata of one flat batch, checked once, and the per-layer call.

One engine step feeds the model T new tokens from B sequences: sequence b owns
query rows ``query_start_loc[b] : query_start_loc[b+1]`` (q_len_b of them) and
has ``seq_lens[b]`` tokens of context *including* those new ones, so its query
i sits at position ``seq_lens[b] - q_len_b + i`` and attends causally to
positions 0..that. Decode (q_len 1), a prefill, a later prefill chunk and a
speculative verification (1 + k queries) are all this one case (vLLM's
"unified" attention; Kwon et al., SOSP'23, §4.1 for the paged form).

A token tree (``minibatch/spec_decode/tree.py``) is verified the same way, plus one mask: its root and
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
(``minibatch/kv/backends.py``): "loop" (the teaching version), "batched" (the
fast default) or "triton" (``kernels/``). The per-layer call checks nothing
again, unless ``MINIBATCH_DEBUG_CHECKS=1`` (or ``PagedAttention(..., debug=True)``)
asks every backend to re-check its inputs on every call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from minibatch.kv import backends, checks
from minibatch.kv.kv_cache import KVCache, block_table_tensor, slot_mapping as _slot_mapping
from minibatch.spec_decode import tree      # tree.mask_bits / positions looked up per call: an exercise patches them

BACKENDS = ("loop", "batched", "triton")
# Backends whose decode forward has no host sync and no data-dependent shape (tests/test_host_sync.py): they can
# run a static batch, so CUDA graphs can capture them. "loop" reads lengths back to the host (the teaching version).
GRAPH_SAFE_BACKENDS = ("batched", "triton")
RENAMED = {"torch": "loop", "dense": "batched"}       # the names before the re-founding said less


def check_backend(name: str) -> str:
    if name in RENAMED:
        raise ValueError(f"attention backend {name!r} is now called {RENAMED[name]!r}; choose one of {list(BACKENDS)}")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {list(BACKENDS)}")
    return name


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64, -1 = do not store
    block_tables: torch.Tensor       # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor           # [B] int32, context length including this step's tokens
    query_start_loc: torch.Tensor    # [B+1] int32
    max_query_len: int
    max_seq_len: int
    positions: Optional[torch.Tensor] = None      # [T] int64: where each new token sits in its sequence
    # host-side copies, so no backend has to read a device tensor back (a sync) to plan its work
    seq_lens_list: list = field(default_factory=list)
    query_lens_list: list = field(default_factory=list)
    max_block_id: int = -1                        # the largest block id any table holds
    plan: dict = field(default_factory=dict)      # backends cache what they derive once per step here
    tree_bits: Optional[torch.Tensor] = None      # [T] int64 tree mask rows (-1: plain causal); None: no tree
    # A fixed-shape decode batch (engine/input_batch.py): every row one query, the tensors views of persistent
    # buffers, padding rows with slot -1 and length 0. A graph-safe backend then plans from the device tensors
    # alone (no host list, no length-dependent shape), so a CUDA graph can replay the step.
    static: bool = False

    @classmethod
    def build(cls, block_tables, num_computed, num_new, block_size: int, device="cpu",
              tree_parents=None) -> "AttentionMetadata":
        """Sequence b has num_computed[b] tokens in the cache already and feeds num_new[b] new ones.

        tree_parents: None, or per sequence None (an ordinary one) or the parent list of the token tree its
        num_new[b] new tokens form (``tree.py``: node 0 = its first new token, the root).
        Every check on the step's shape happens here, once: lengths agree, counts are sane, every
        position has a block (``slot_mapping`` checks that), the tables' block ids are >= 0, trees are trees."""
        if not len(block_tables) == len(num_computed) == len(num_new):
            raise ValueError(f"block_tables, num_computed, num_new have different lengths "
                             f"({len(block_tables)}, {len(num_computed)}, {len(num_new)})")
        if any(n < 1 for n in num_new) or any(c < 0 for c in num_computed):
            raise ValueError(f"need num_new >= 1 and num_computed >= 0, got {list(num_new)}, {list(num_computed)}")
        trees = _check_trees(tree_parents, num_new)
        lens = [c + n for c, n in zip(num_computed, num_new)]
        slots = _slot_mapping(block_tables, num_computed, num_new, block_size, device)
        starts = [0]
        for n in num_new:
            starts.append(starts[-1] + n)
        positions, bits = [], []               # a tree node sits at context + its depth; siblings share one
        for c, n, parents in zip(num_computed, num_new, trees):
            if parents is None:
                positions += range(c, c + n)
                bits += [-1] * n
            else:
                positions += tree.positions(parents, c)
                bits += tree.mask_bits(parents)
        tree_bits = None if all(p is None for p in trees) else torch.tensor(bits, dtype=torch.int64, device=device)
        return cls(slots, block_table_tensor(block_tables, device),
                   torch.tensor(lens, dtype=torch.int32, device=device),
                   torch.tensor(starts, dtype=torch.int32, device=device),
                   max(num_new, default=0), max(lens, default=0),
                   torch.tensor(positions, dtype=torch.int64, device=device),
                   lens, list(num_new), max((max(t) for t in block_tables if len(t)), default=-1),
                   tree_bits=tree_bits)


def _check_trees(tree_parents, num_new) -> list:
    """tree_parents as a list of B entries, each None or a checked parent list of length num_new[b]."""
    if tree_parents is None:
        return [None] * len(num_new)
    if not isinstance(tree_parents, (list, tuple)) or len(tree_parents) != len(num_new):
        n = len(tree_parents) if isinstance(tree_parents, (list, tuple)) else type(tree_parents).__name__
        raise ValueError(f"tree_parents must be a list with one entry (None or a parent list) per sequence: "
                         f"{len(num_new)} sequences, got {n}")
    out = []
    for b, parents in enumerate(tree_parents):
        if parents is not None:
            try:
                parents = tree.check_parents(parents)
            except ValueError as e:
                raise ValueError(f"tree_parents[{b}]: {e}") from None
            if len(parents) != num_new[b]:
                raise ValueError(f"tree_parents[{b}] has {len(parents)} nodes, but sequence {b} feeds "
                                 f"num_new = {num_new[b]} new tokens: one node (the root included) per new token")
        out.append(parents)
    return out


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
        self._store, self._attend = backends.get(backend, checked=self.debug)
        self.kv_cache, self.metadata, self.backend = kv_cache, metadata, backend

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c, md = self.kv_cache, self.metadata
        if self.debug:
            checks.check_layer_inputs(c, md, q, k, v)
        key_cache, value_cache = c.key_cache(layer_idx), c.value_cache(layer_idx)
        self._store(k, v, key_cache, value_cache, md.slot_mapping)        # 1) this step's K/V into their slots
        return self._attend(q, key_cache, value_cache, md, c.head_dim ** -0.5)   # 2) attend
