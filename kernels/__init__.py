"""Triton kernels for the paged KV cache.

- ``store_kv``: write this step's keys/values into their cache slots (slot mapping).
- ``paged_attention``: causal attention of a flat batch (any mix of decode,
  prefill, chunked prefill, speculative verify) over the paged cache.
- ``paged_decode``: the decode-only special case (one query per sequence), a
  simpler kernel to read first.
- ``flash_decode``: decode only, full tiles and the context split over programs
  (flash-decoding); the engine's triton backend uses it for pure-decode steps.

On a machine without CUDA, set ``TRITON_INTERPRET=1`` *before* importing this
package and the kernels run on CPU tensors through Triton's interpreter.
"""
from kernels.flash_decode import flash_decode
from kernels.paged_attention import paged_attention
from kernels.paged_decode import paged_decode
from kernels.store_kv import store_kv

__all__ = ["store_kv", "paged_attention", "paged_decode", "flash_decode"]
