"""Exercise 2: paged attention (Kwon et al., SOSP'23, Sec. 4.1; vLLM's "unified" attention).

One engine step feeds the model T new tokens from B sequences, flattened into
one batch. Sequence b owns query rows ``query_start_loc[b] : query_start_loc[b+1]``
(q_len_b of them) and has ``seq_lens[b]`` tokens of context, *including* the new
ones, whose keys and values are already in the paged cache (the layer stored
them at their slots just before calling you; exercise 1).

So the new tokens are the *last* q_len_b positions of the sequence: its query i
sits at position ``seq_lens[b] - q_len_b + i`` and attends causally to the
positions 0 .. that one. One formula covers every kind of step:

    decode             q_len = 1           the one query sees all seq_len positions
    prefill            q_len = seq_len     an ordinary causal mask
    a later chunk      q_len < seq_len     causal, shifted by the context already cached
    speculative check  q_len = 1 + k       the same as a chunk

Where is position p of sequence b? In physical block ``block_tables[b, p // block_size]``
at offset ``p % block_size``, so its key is ``key_cache[block, offset]``.

Grouped-query attention (GQA): there are H query heads but only Hkv key/value heads;
query head h reads kv head ``h // (H // Hkv)`` (consecutive query heads share one).

Run the tests:  MINIBATCH_STUDENT=paged_attention python -m pytest tests/exercises -m ex2
"""
from __future__ import annotations

import torch  # noqa: F401  (you will need it)


def paged_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """query [T, H, D] -> out [T, H, D] (same dtype as query): causal attention over the paged cache.

    key_cache, value_cache [num_blocks, block_size, Hkv, D]: the pool (one layer).
    block_tables [B, max_blocks] int: row b = sequence b's physical blocks, padded with -1.
    seq_lens [B] int: context length of sequence b, including this step's queries.
    query_start_loc [B+1] int: sequence b's queries are rows query_start_loc[b] : query_start_loc[b+1].
    scale: multiply q . k by this before the softmax (1/sqrt(D) in the model; do not assume it).

    out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j over the positions j the query may see.

    Hints:
      * one sequence at a time is fine: gather its blocks (``key_cache[blocks]`` with a tensor
        of block ids), flatten them to [num_blocks_used * block_size, Hkv, D] and keep the
        first seq_len rows. Slots past seq_len in its last block hold garbage (even NaN):
        never let them into the sum, not even with weight 0 (0 * NaN = NaN).
      * GQA: ``torch.repeat_interleave(k, H // Hkv, dim=1)`` turns [L, Hkv, D] into [L, H, D].
      * mask with -inf before the softmax, on positions j > the query's own position.
      * compute in float32 and cast the result back to query.dtype.
    """
    raise NotImplementedError("Exercise 2: paged_attention_torch (exercises/ex2_paged_attention.py)")
