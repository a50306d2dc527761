"""Paged attention backends: the same answer four ways, one module each (as vLLM's ``v1/attention/backends/``).

Each backend stores the step's K/V at their slots, then attends causally through the block tables, with the
context offset, grouped-query heads and a token tree's mask (``loop.py`` states the layout and the mask once):

  "loop"    -- ``loop.py``, the teaching version: one sequence at a time, gather its K/V through its block
               table into a contiguous [L, Hkv, D], then a plain masked softmax. Read this one first. Its torch
               store, ``store_kv_torch``, is the "loop" and "batched" backends' store.
  "batched" -- ``batched.py``, the default on a GPU: the rows are split into decodes (q_len 1) and the rest
               (prefill, chunks, verification), and each group is gathered at once into padded [G, L, Hkv, D]
               and handed to ``scaled_dot_product_attention`` with one mask. What it derives from the metadata
               (gather indices, masks) is built once per step, not per layer (``plan.py``, the shared plan).
  "triton"  -- ``triton.py``: ``kernels.paged_attention`` reads blocks in place with an online softmax;
               pure-decode steps go to ``kernels.flash_decode`` (full tiles, the context split over programs).
               Quantized blocks are decoded in registers (``kernels/kv_quant.py``).
  "cpu"     -- ``cpu.py``, the default on a CPU (``attention.default_backend``): a small C++ operator
               (``cpu_kernel.py``, vLLM's CPU attention, compiled at first use) that reads the blocks in place
               with an online softmax, OpenMP over (sequence, KV head), for the rows of up to ``cpu.LONG_QUERY``
               queries; longer rows (prefill chunks) go through "batched"'s SDPA in the same step. "batched"
               where the operator cannot be built (said once, in a warning). It reads and writes quantized
               blocks too (``cpu_quant.py``: int8 and fp8 decoded in its inner loop, the store quantizing).

This module is the registry: ``get(backend)`` hands out a backend's (store, attend). The public functions
(``store_kv_torch``, ``paged_attention_loop``, ``paged_attention_batched``, ``paged_attention_cpu``) check their
inputs (``kv/checks.py``), so a student or a test calling one directly gets a clear error. Inside the engine the
metadata was checked once by ``AttentionMetadata.build``, so ``get`` hands out the unchecked bodies unless debug
checks are on; the exception is the teaching loop, which the engine calls as the public function (checks
included), so that a student's version can stand in for it. What the engine calls by name is looked up in its
backend's module at each call (``loop.paged_attention_loop``, ``triton._triton_attend``): that module is where a
patch (``exercises.patch_engine``, a test's monkeypatch) reaches it.
"""
from __future__ import annotations

from minibatch.kv.backends import batched, cpu, cpu_kernel, loop, plan, triton
from minibatch.kv.backends.batched import paged_attention_batched
from minibatch.kv.backends.cpu import paged_attention_cpu
from minibatch.kv.backends.loop import paged_attention_loop, store_kv_torch
from minibatch.kv.checks import check_accepts

# The backends that read quantized blocks (kv/quant.py): every one, each dequantizing inside its own loop or kernel
QUANTIZED_BACKENDS = ("loop", "batched", "cpu", "triton")

# (the modules loop, batched, cpu, cpu_kernel, plan and triton are attributes too, left out of a star import: one
# named triton would shadow Triton itself)
__all__ = ["get", "QUANTIZED_BACKENDS", "store_kv_torch", "paged_attention_loop", "paged_attention_batched",
           "paged_attention_cpu"]


def _tree(md, fn=None) -> dict:
    """tree_bits=, only when the step has a tree: a student's function (ex2, ex9) has no such parameter, so a tree
    step that reaches one without it (``fn``) stops with a clear error rather than a TypeError deep inside."""
    if md.tree_bits is None:
        return {}
    if fn is not None:
        check_accepts(fn, ["tree_bits"], f"{fn.__module__}.{fn.__name__}")
    return {"tree_bits": md.tree_bits}


def _scales(scales: dict, fn=None) -> dict:
    """k_scale=, v_scale=, only for a quantized cache; a student's function without them stops clearly (see _tree)."""
    if scales and fn is not None:
        check_accepts(fn, list(scales), f"{fn.__module__}.{fn.__name__}")
    return scales


def _checked(fn):
    """A backend body that re-checks its inputs on every call (debug checks)."""
    def attend(query, key_cache, value_cache, md, scale, **scales):
        return fn(query, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
                  **_tree(md, fn), **_scales(scales, fn))
    return attend


def get(backend: str, checked: bool = False):
    """(store, attend) of a backend; attend(query, key_cache, value_cache, metadata, scale) -> [T, H, D].
    A quantized cache's scales go to both as k_scale=, v_scale= (QUANTIZED_BACKENDS: the backends that take them)."""
    if backend == "cpu":          # the C++ operator, built at the first call; where it cannot be, "batched"
        if cpu_kernel.load() is None:                    # (load() said why, once)
            backend = "batched"
        elif checked:
            return store_kv_torch, _checked(cpu.paged_attention_cpu)
        else:
            return cpu.store, cpu._cpu_attend
    if backend == "triton":
        try:
            import kernels                        # lazily: the other backends need no Triton
        except ImportError as e:
            raise ImportError(f"the 'triton' backend needs the kernels package and Triton: {e}") from e
        if checked:                               # the public, checked kernel (ex9 hands its decodes to a student's)
            return kernels.store_kv, lambda q, kc, vc, md, s, **kv: kernels.paged_attention(
                q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc, s, **_tree(md),
                **_scales(kv, kernels.paged_attention))
        return triton._triton_store, lambda q, kc, vc, md, s, **kv: triton._triton_attend(q, kc, vc, md, s, **kv)  # patchable
    if checked:
        attend = loop.paged_attention_loop if backend == "loop" else batched.paged_attention_batched
        return store_kv_torch, _checked(attend)
    if backend == "loop":            # looked up at each call, so exercises.patch_engine can swap in a student's
        return loop._store, lambda q, kc, vc, md, s, **kv: loop.paged_attention_loop(
            q, kc, vc, md.block_tables, md.seq_lens, md.query_start_loc, s, **_tree(md, loop.paged_attention_loop),
            **_scales(kv, loop.paged_attention_loop))
    return loop._store, batched._batched
